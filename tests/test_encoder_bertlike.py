"""The BERT-like encoders (`families/layoutlm.py`, `bert_inline.py`, `convbert.py`, `ibert.py`, `mobilebert.py`,
`xmod.py`): each served through `StandardizedEncoder` equal to transformers, and what each does beyond BERT: LayoutLM's
boxes, X-MOD's language adapters, ConvBERT's attention heads beside its convolution, MobileBERT's bottleneck and
feed-forward stack, BigBird's and I-BERT's refused modes, the inline attention's scores."""

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.locations.cache import NO_CACHE

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
PROMPT = "Hello world"
#: What each type needs to build small and to run (beyond SIZES): its family's tiny recipe's own kwargs where that is
#: a masked LM, and BigBird's full attention, X-MOD's default language where the recipe is the causal LM.
OWN = {
    "layoutlm": {},
    "tapas": {},
    "rembert": {"input_embedding_size": 32, "output_embedding_size": 32},
    "big_bird": {"attention_type": "original_full"},
    "convbert": {"embedding_size": 32},
    "ibert": {},
    "mobilebert": {
        "true_hidden_size": 64,
        "intra_bottleneck_size": 64,
        "embedding_size": 32,
        "initializer_range": 0.05,
    },
    "xmod": {"default_language": "en_XX"},
}


def encoder(model_type, **config):
    config = transformers.AutoConfig.for_model(model_type, **SIZES, pad_token_id=0, **{**OWN[model_type], **config})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    masked_lm = getattr(transformers, modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type])
    inner = attnlens.models._perturbed(masked_lm(config).eval())
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())


@pytest.mark.parametrize("model_type", sorted(OWN))
def test_each_encoder_equals_transformers_and_its_identities_hold(model_type):
    model = encoder(model_type)
    assert model.family.model_types == (model_type,)
    assert not model.family.score_function().causal(model.config)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model._module(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(2):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer])
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    assert torch.equal(saved["logits"], reference.logits)


def test_layoutlm_boxes_move_the_embeddings_not_the_attention_wiring():
    """A bounding box per token changes layer 0's input (LayoutLMEmbeddings adds its edges' embeddings) and so every
    pattern; the attention's identities hold, and the patterns are transformers' own with the same boxes."""
    model = encoder("layoutlm")
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    boxes = torch.tensor([[[10 * i, 20, 10 * i + 8, 40 + i] for i in range(ids.shape[1])]])
    plain = read_everything(model, {"input_ids": ids})
    boxed = read_everything(model, {"input_ids": ids, "bbox": boxes})
    assert torch.equal(plain["embeddings"], boxed["embeddings"]), "the word embeddings do not see the boxes"
    assert not torch.allclose(plain[(0, "layer_input")], boxed[(0, "layer_input")], atol=1e-3)
    assert not torch.allclose(plain[(0, "attention_probabilities")], boxed[(0, "attention_probabilities")], atol=1e-4)
    assert [failures(model, boxed, layer) for layer in range(2)] == [[], []]
    with torch.no_grad():
        reference = model._module(ids, bbox=boxes, output_attentions=True, output_hidden_states=True)
        embeddings = model._module.layoutlm.embeddings
        by_hand = embeddings.LayerNorm(
            embeddings.word_embeddings(ids)
            + embeddings.position_embeddings(torch.arange(ids.shape[1]))[None]
            + embeddings.x_position_embeddings(boxes[..., 0])
            + embeddings.y_position_embeddings(boxes[..., 1])
            + embeddings.x_position_embeddings(boxes[..., 2])
            + embeddings.y_position_embeddings(boxes[..., 3])
            + embeddings.h_position_embeddings(boxes[..., 3] - boxes[..., 1])
            + embeddings.w_position_embeddings(boxes[..., 2] - boxes[..., 0])
            + embeddings.token_type_embeddings(torch.zeros_like(ids))
        )
    assert torch.allclose(boxed[(0, "layer_input")], by_hand, atol=1e-6)
    for layer in range(2):
        assert torch.equal(boxed[(layer, "attention_probabilities")], reference.attentions[layer])
    assert boxed[(0, "attention_probabilities")].shape == plain[(0, "attention_probabilities")].shape


def test_xmod_language_adapter_runs_inside_layer_output():
    """Two rows of one prompt in two languages: everything up to the MLP's output is equal across the rows; the
    adapter of each row's language (inside layer_output) parts them, and the identities recompute it from lang_ids."""
    model = encoder("xmod", languages=["en_XX", "de_DE"])
    batch = model.tokenizer([PROMPT, PROMPT], return_tensors="pt")
    lang_ids = torch.tensor([0, 1])
    saved = read_everything(model, {**batch, "lang_ids": lang_ids})
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    mlp_output, layer_output = saved[(0, "mlp_output")], saved[(0, "layer_output")]
    assert torch.equal(mlp_output[0], mlp_output[1])
    assert not torch.allclose(layer_output[0], layer_output[1], atol=1e-4)
    block = model._module.roberta.encoder.layer[0]
    with torch.no_grad():
        summed = block.attention.output.LayerNorm(saved[(0, "layer_mid")]) + mlp_output
        normed = block.output.LayerNorm(summed)
        for row, language in enumerate(("en_XX", "de_DE")):
            adapted = block.output.adapter_modules[language](normed[row]) + normed[row]
            assert torch.allclose(layer_output[row], block.output.LayerNorm(adapted), atol=1e-5)
    # the identity's own arithmetic needs the languages: with every row in the first, it fails for the second row
    wrong = model.family.identities.residual_add(
        block, "mlp", saved[(0, "layer_mid")], mlp_output, lang_ids=torch.tensor([0, 0])
    )
    assert torch.allclose(wrong[0], layer_output[0], atol=1e-5)
    assert not torch.allclose(wrong[1], layer_output[1], atol=1e-4)
    assert "language adapter" in model.support(0).notes["layer_output"]


def test_convbert_serves_its_attention_heads_and_refuses_the_premix_that_holds_the_convolution():
    model = encoder("convbert")
    attention = model.layers[0].self_attn
    config = model.config
    assert attention.num_heads == config.num_attention_heads // config.head_ratio == 2
    assert attention.head_dim == config.hidden_size // attention.num_heads // 2 == 16
    saved = read_everything(model, PROMPT)
    assert saved[(0, "attention_probabilities")].shape[1] == 2
    assert saved[(0, "attention_head_outputs")].shape[2:] == (2, 16)
    assert "convolution" in model.support(0)["self_attn.attention_premix"]
    # zeroing the attention heads leaves the convolution's half of output.dense's input as it was
    received = []
    dense = model._module.convbert.encoder.layer[0].attention.output.dense
    handle = dense.register_forward_hook(lambda module, args, output: received.append(args[0].detach().clone()))
    try:
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[0].self_attn.attention_head_outputs[:] = 0
            logits = model.logits.save()
        with torch.no_grad():
            plain = model._module(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    finally:
        handle.remove()
    edited, original = received
    # torch.cat along the heads: the 2 attention heads' 16 features each, then the convolution's 2 x 16
    assert (edited[..., :32] == 0).all() and not (original[..., :32] == 0).all()
    assert torch.equal(edited[..., 32:], original[..., 32:])
    assert not torch.allclose(logits, plain, atol=1e-4)


def test_mobilebert_bottleneck_and_feed_forward_stack_hold_at_real_widths():
    """A real bottleneck (true_hidden_size 32 inside hidden_size 64) and four feed-forward networks: the identities
    run the earlier networks with the block's own modules; zeroing the last network's output equals a hook doing so."""
    model = encoder("mobilebert", true_hidden_size=32, intra_bottleneck_size=32, num_feedforward_networks=4)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    assert saved[(0, "layer_mid")].shape[-1] == 32 and saved[(0, "layer_output")].shape[-1] == 64
    block = model._module.mobilebert.encoder.layer[0]
    with torch.no_grad():  # mlp_input is what the first of the earlier networks receives
        assert torch.equal(saved[(0, "mlp_input")], saved[(0, "mlp_norm_output")])
        x = saved[(0, "mlp_input")]
        for ffn in block.ffn:
            x = ffn(x)
        assert torch.allclose(block.intermediate(x), saved[(0, "mlp_activation")], atol=1e-6)
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[0].mlp.mlp_output[:] = 0
        logits = model.logits.save()
    handle = block.output.dense.register_forward_hook(lambda module, args, output: torch.zeros_like(output))
    try:
        with torch.no_grad():
            expected = model._module(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)


def test_inline_attention_score_edit_moves_the_pattern_as_its_softmax():
    """RemBERT's inline attention: adding 5 to key 0's scores in head 1 of layer 1 gives a pattern that is the
    softmax of the edited scores, and logits equal a hook adding the same to transformers' own scores."""
    model = encoder("rembert")
    with torch.no_grad(), model.trace(PROMPT):
        scores = model.layers[1].self_attn.attention_scores
        scores[:, 1, :, 0] += 5
        edited = scores.save()
        pattern = model.layers[1].self_attn.attention_probabilities.save()
        logits = model.logits.save()
    assert torch.allclose(pattern, edited.softmax(-1), atol=1e-6)
    assert (pattern[:, 1, :, 0] > 0.5).all()
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    attention = model._module.rembert.encoder.layer[1].attention.self
    softmax = torch.nn.functional.softmax

    def shifted(x, dim=-1, **kwargs):
        x = x.clone()
        x[:, 1, :, 0] += 5
        return softmax(x, dim=dim, **kwargs)

    from transformers.models.rembert import modeling_rembert

    original = modeling_rembert.nn.functional.softmax
    modeling_rembert.nn.functional.softmax = lambda x, dim=-1, **kw: (
        shifted(x, dim, **kw) if x.dim() == 4 and attention._hooked else original(x, dim=dim, **kw)
    )
    attention._hooked = False
    pre = attention.register_forward_pre_hook(lambda module, args: setattr(module, "_hooked", True))
    post = attention.register_forward_hook(lambda module, args, output: setattr(module, "_hooked", False))
    try:
        with torch.no_grad():
            expected = model._module(ids).logits
    finally:
        modeling_rembert.nn.functional.softmax = original
        pre.remove()
        post.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model._module(ids).logits, expected, atol=1e-4), "the edit moved the logits"


def test_refused_modes_say_why():
    sparse = encoder("big_bird", attention_type="block_sparse", block_size=2, num_random_blocks=1)
    for name in ("self_attn.attention_probabilities", "self_attn.attention_queries"):
        assert sparse.support(0)[name].startswith("config.attention_type='block_sparse'")
    assert sparse.support(0)["self_attn.attention_premix"] is None
    quantised = encoder("ibert", quant_mode=True)
    assert quantised.support(0)["self_attn.attention_probabilities"].startswith("config.quant_mode=True")
    assert quantised.support(0)["layer_output"] is None
    pre_norm = encoder("xmod", pre_norm=True)
    assert pre_norm.support(0)["mlp.mlp_output"].startswith("config.pre_norm=True")
    assert encoder("tapas").support(0)["self_attn.attention_cache_keys"] == NO_CACHE  # every encoder's reason
