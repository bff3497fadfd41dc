"""BERT as an encoder: bidirectional attention (the family's score function says so from the config), with padding,
under every head transformers gives it, against transformers' own attention (`output_attentions`). The causal
`BertLMHeadModel` (`is_decoder=True`) is the family's tiny model and runs every family test; this file holds what
only the encoder does."""

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import attnlens
from attnlens import verification
from attnlens.checks import failures, read_everything
from attnlens.family import block_list

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128)
HEADS = ("BertForMaskedLM", "BertModel", "BertForSequenceClassification", "BertForTokenClassification")
PROMPT = "Hello world"


def encoder(head: str, **config) -> attnlens.StandardizedEncoder:
    torch.manual_seed(0)
    inner = getattr(transformers, head)(transformers.BertConfig(**SIZES, attn_implementation="eager", **config))
    return attnlens.StandardizedEncoder(inner.eval(), tokenizer=attnlens.models.char_tokenizer())


@pytest.mark.parametrize("head", HEADS)
def test_every_head_serves_bidirectional_attention_equal_to_transformers(head):
    model = encoder(head)
    assert not model.family.score_function().causal(model.config)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[], []]
    verification.verify(model)  # the load-time verification finds nothing wrong either
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model._module(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(model.num_layers):
        pattern = saved[(layer, "attention_probabilities")]
        assert torch.equal(pattern, reference.attentions[layer])
        assert (pattern[..., 1:, :1] > 0).all(), "an earlier key is seen by every later query, and the reverse:"
        assert (pattern[..., :1, 1:] > 0).all()
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    if head == "BertModel":  # no head: the prefix `bert.` of the family's paths dropped, and no logits
        assert model.family.layers == "encoder.layer"
        assert model.support()["logits"].startswith("BertModel is a base model without a head")
    else:
        assert torch.equal(saved["logits"], reference.logits)


def test_padding_is_masked_in_every_row_and_the_score_function_reproduces_it():
    model = encoder("BertForMaskedLM")
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    keys = batch.attention_mask.bool()
    with torch.no_grad(), model.trace(prompts):
        attention = model.layers[1].self_attn
        queries, keys_read = attention.attention_queries.save(), attention.attention_keys.save()
        scores, pattern = attention.attention_scores.save(), attention.attention_probabilities.save()
    with torch.no_grad():
        reference = model._module(**batch, output_attentions=True).attentions[1]
    real = keys[:, None, :, None] & keys[:, None, None, :]  # rows and columns of real tokens
    assert torch.allclose(pattern[real.expand_as(pattern)], reference[real.expand_as(pattern)], atol=1e-6)
    assert (pattern.masked_select(~keys[:, None, None, :].expand_as(pattern)) == 0).all()
    heads = model.layers[1].self_attn.heads
    rebuilt = model.family.score_function().scores(heads, model.config, queries, keys_read, 1, batch.attention_mask)
    assert torch.allclose(rebuilt, scores)


def test_a_head_ablated_moves_the_masked_lm_logits_as_recomputed_by_hand():
    """Zeroing head 2's output in layer 0 equals zeroing its slice of what `attention.self` returns, by a hook."""
    model = encoder("BertForMaskedLM")
    with torch.no_grad(), model.trace(PROMPT):
        heads = model.layers[0].self_attn.attention_head_outputs
        heads[:, :, 2] = 0
        logits = model.logits.save()

    def zero_head(module, args, output):
        merged, weights = output
        merged = merged.clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 2] = 0
        return merged, weights

    inner = model._module
    handle = inner.bert.encoder.layer[0].attention.self.register_forward_hook(zero_head)
    try:
        with torch.no_grad():
            expected = inner(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        plain = inner(model.tokenizer(PROMPT, return_tensors="pt").input_ids).logits
    assert not torch.allclose(logits, plain, atol=1e-3)


def test_support_says_what_the_encoder_is():
    report = encoder("BertForMaskedLM").support(0)
    assert report.notes["self_attn.attention_probabilities"].startswith("bidirectional")
    assert report["attention_norm_output"].startswith("BERT normalises after each residual add")
    causal = attnlens.models.tiny("bert").support(0)
    assert causal.notes["self_attn.attention_probabilities"].startswith("causal")


#: transformers' masked-LM registry: every type in it is built tiny below, and served or refused with its reason.
MASKED_LM = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
#: Types served as encoders outside that registry, by the class that holds their encoder.
OTHER_ENCODERS = {"bert-generation": "BertGenerationEncoder"}
#: What a type's config needs beyond `SIZES` to build small at all (a served family's own `tiny.kwargs` apply too).
BUILD = {
    "big_bird": dict(attention_type="original_full"),  # what it runs at these lengths; block_sparse is refused
    "funnel": dict(num_hidden_layers=None, block_sizes=[1, 1]),
    "mobilebert": dict(embedding_size=64, intra_bottleneck_size=64, true_hidden_size=64),
    "reformer": dict(axial_pos_embds_dim=[32, 32], axial_pos_shape=[4, 8], attn_layers=["local", "lsh"]),
    "squeezebert": dict(embedding_size=64),
    "xmod": dict(default_language="en_XX"),
    **{  # a text encoder beside a vision tower: both small
        model_type: dict(
            text_config=dict(SIZES, pad_token_id=0),
            vision_config=dict(SIZES, hidden_size=32, num_hidden_layers=1, image_size=32, patch_size=8),
        )
        for model_type in ("modernvbert", "ultravbert")
    },
}
ENCODER_CASES = attnlens.models.tiny_cases(causal=False)


def masked_lm(model_type: str) -> torch.nn.Module:
    """`model_type`'s tiny model, of the class that holds its encoder (its masked LM), eager, float32, seeded."""
    family = attnlens.registered().get(model_type)
    own = family.tiny.kwargs if model_type in ENCODER_CASES else {}  # an encoder-only family's own recipe
    sizes = {k: v for k, v in {**SIZES, "pad_token_id": 0, **BUILD.get(model_type, {}), **own}.items() if v is not None}
    config = transformers.AutoConfig.for_model(model_type, **sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    inner = getattr(transformers, {**MASKED_LM, **OTHER_ENCODERS}[model_type])(config).eval()
    return attnlens.models._perturbed(inner)


def assert_equal_to_transformers(model: attnlens.StandardizedEncoder, inner: torch.nn.Module) -> None:
    """Every value's identities on every block, and transformers' own attention, block outputs and logits, on one
    prompt and on a padded batch (whose padded keys get exactly zero weight)."""
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
    verification.verify(model)
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = inner(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(model.num_layers):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer]), layer
    for layer in range(model.num_layers - 1):
        assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1]), layer
    # transformers' last hidden state is the final norm's output where there is one
    last = saved.get("final_norm_output", saved[(model.num_layers - 1, "layer_output")])
    assert torch.equal(last, reference.hidden_states[-1])
    if "logits" in saved:
        assert torch.equal(saved["logits"], reference.logits)
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    patterns = []  # (a name bound in a trace body does not outlive it; a list from outside does)
    with torch.no_grad(), model.trace(prompts):
        for layer in range(model.num_layers):
            patterns.append(model.layers[layer].self_attn.attention_probabilities.save())
    with torch.no_grad():
        expected = inner(**batch, output_attentions=True).attentions
    keys = batch.attention_mask.bool()
    real = (keys[:, None, :, None] & keys[:, None, None, :]).expand_as(patterns[0])
    for pattern, want in zip(patterns, expected):
        assert torch.allclose(pattern[real], want[real], atol=1e-6)
        assert (pattern[1, :, : keys[1].sum(), ~keys[1]] == 0).all(), "a padded key gets exactly zero weight"
        assert (pattern[1, :, 0, 1:2] > 0).all(), "bidirectional: the first position reads the second"


@pytest.mark.parametrize("model_type", sorted({*MASKED_LM, *OTHER_ENCODERS}))
def test_every_masked_lm_type_is_served_equal_to_transformers_or_refused_with_its_reason(model_type):
    """transformers' masked-LM registry, type by type: an encoder-decoder is sent to `StandardizedSeq2Seq`; a type
    with a family is served (`assert_equal_to_transformers`); one without loads with what needs no family (block
    inputs and outputs, equal to transformers' hidden states) and every attention value raises `Unavailable` with
    the reason `support()` gives, or, with no list of blocks to find, is refused naming the type."""
    inner = masked_lm(model_type)
    tokenizer = attnlens.models.char_tokenizer()
    if inner.config.is_encoder_decoder:
        with pytest.raises(TypeError, match=r"attnlens\.StandardizedSeq2Seq"):
            attnlens.StandardizedEncoder(inner, tokenizer=tokenizer)
        return
    if model_type in attnlens.registered():
        model = attnlens.StandardizedEncoder(inner, tokenizer=tokenizer)
        assert model.config.model_type in model.family.model_types
        assert_equal_to_transformers(model, inner)
        return
    if block_list(inner) is None:  # nothing to serve: refused at load, naming the type
        with pytest.raises(attnlens.UnknownFamily, match=repr(model_type)):
            attnlens.StandardizedEncoder(inner, tokenizer=tokenizer)
        return
    with pytest.warns(attnlens.UnknownFamilyWarning, match="an encoder"):
        model = attnlens.StandardizedEncoder(inner, tokenizer=tokenizer)
    reason = model.support(0)["self_attn.attention_probabilities"]
    assert "an encoder" in reason and "docs/extending.md" in reason
    assert attnlens.registry.refused_encoders().get(model_type, "") in reason  # why, where attnlens knows it
    with pytest.raises(attnlens.Unavailable) as unavailable, torch.no_grad(), model.trace(PROMPT):
        model.layers[0].self_attn.attention_probabilities.save()
    assert str(unavailable.value).endswith(reason)
    if "layer_output" in model.support(0).available:  # what the last block returned, as a hook on it sees it
        outputs, returned = [], []
        block = model.layers[-1]._module
        hook = block.register_forward_hook(lambda module, args, output: returned.append(output))
        try:
            with torch.no_grad(), model.trace(PROMPT):
                outputs.append(model.layers[-1].layer_output.save())
        finally:
            hook.remove()
        assert torch.equal(outputs[0], returned[0] if torch.is_tensor(returned[0]) else returned[0][0])


def test_an_encoder_attnlens_knows_and_does_not_serve_says_why_on_every_value_or_at_load():
    """Funnel (`families/funnel.py`, a `RefusedEncoder`): the tiny model (whose decoder's layers are as many as the
    config's num_hidden_layers) loads with the reason on every value of its blocks, their inputs and outputs too (the
    list found is the decoder's, not the model's blocks in order), its embeddings and logits served; the released
    layout (no list as long as num_hidden_layers) is refused at load with the reason."""
    why = attnlens.registry.refused_encoders()["funnel"]
    tokenizer = attnlens.models.char_tokenizer()
    with pytest.warns(attnlens.UnknownFamilyWarning, match="pools the queries"):
        model = attnlens.StandardizedEncoder(masked_lm("funnel"), tokenizer=tokenizer)
    report = model.support(0)
    assert report["layer_input"] == why and report["layer_output"] == why
    assert why in report["self_attn.attention_scores"] and why in report["mlp.mlp_output"]
    assert report["embeddings"] is None and report["logits"] is None
    with pytest.raises(attnlens.Unavailable, match="pools the queries"), torch.no_grad(), model.trace(PROMPT):
        model.layers[0].layer_output.save()
    sizes = {k: v for k, v in SIZES.items() if k != "num_hidden_layers"}  # block_sizes gives it
    released = transformers.FunnelConfig(**sizes, block_sizes=[2, 2], pad_token_id=0)
    with pytest.raises(attnlens.UnknownFamily, match="pools the queries"), pytest.warns(attnlens.UnknownFamilyWarning):
        attnlens.StandardizedEncoder(transformers.FunnelForMaskedLM(released).eval(), tokenizer=tokenizer)
