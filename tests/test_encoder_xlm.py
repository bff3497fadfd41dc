"""XLM and FlauBERT (`families/xlm.py`): blocks that are no modules, their sublayers in parallel lists of the model,
served as gathered blocks (`attnlens.applications.GatheredBlock`); XLM's language embeddings; a head ablated by hand;
the configurations refused (XLM built causal, FlauBERT's pre_norm) with their reasons."""

import pytest
import torch
import transformers
from test_encoders import assert_equal_to_transformers

import attnlens
from attnlens.applications import GatheredBlock

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, pad_token_id=0)
PROMPT = "Hello world"
HEADS = {"xlm": "XLMWithLMHeadModel", "flaubert": "FlaubertWithLMHeadModel"}
#: Two languages, so that XLM has language embeddings.
OWN = {"xlm": {"n_langs": 2}, "flaubert": {}}


def built(model_type: str, head: str | None = None, **config) -> torch.nn.Module:
    """The type's masked LM (or `head`), tiny, with wide weights (as tests/test_encoders.py builds it)."""
    kwargs = {**SIZES, **OWN[model_type], **config}
    torch.manual_seed(0)
    made = getattr(transformers, head or HEADS[model_type])(transformers.AutoConfig.for_model(model_type, **kwargs))
    inner = made.eval()
    return attnlens.models._perturbed(inner)


def encoder(inner: torch.nn.Module) -> attnlens.StandardizedEncoder:
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())


def ids(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


@pytest.mark.parametrize("model_type", sorted(HEADS))
def test_each_block_gathers_the_models_own_modules_and_leaves_the_model_as_it_was(model_type):
    inner = built(model_type)
    keys = list(inner.state_dict())
    model = encoder(inner)
    assert list(inner.state_dict()) == keys  # nothing registered in the model
    for i in range(model.num_layers):
        block = model.layers[i]._module
        assert isinstance(block, GatheredBlock)
        assert block.self_attn is inner.transformer.attentions[i] and block.mlp is inner.transformer.ffns[i]
        assert block.layer_norm1 is inner.transformer.layer_norm1[i]
        assert block.layer_norm2 is inner.transformer.layer_norm2[i]
    with pytest.raises(attnlens.Unavailable, match="no input or output of its own"):
        model.layers[0].output  # noqa: B018
    with pytest.raises(attnlens.Unavailable, match="no cross-attention"), model.trace(PROMPT):
        model.layers[1].cross_attn.attention_queries.save()  # a sublayer the block lacks says why, as a module's
    # each read lands on its own block's modules: block 1's input is block 0's output, not block 0's input
    inputs, outputs, read = [], [], []  # (a name bound in a trace body does not outlive it; a list from outside does)
    hooks = [
        inner.transformer.attentions[1].register_forward_pre_hook(lambda m, args: inputs.append(args[0].clone())),
        inner.transformer.layer_norm2[0].register_forward_hook(lambda m, args, out: outputs.append(out.clone())),
    ]
    try:
        with torch.no_grad(), model.trace(PROMPT):
            read += [model.layers[0].layer_output.save(), model.layers[1].layer_input.save()]
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(read[0], outputs[0]) and torch.equal(read[1], inputs[0])


@pytest.mark.parametrize("head", ["XLMModel", "XLMForTokenClassification"])
def test_a_bare_model_and_a_classifier_gather_the_same_blocks(head):
    """A bare XLMModel (the paths rebased: no `transformer.` prefix, the gathered paths with them) and a classifier:
    every identity, and transformers' own patterns and block outputs."""
    inner = built("xlm", head)
    model = encoder(inner)
    assert model.layers[1]._module.self_attn is inner.get_submodule(
        "attentions.1" if head == "XLMModel" else "transformer.attentions.1"
    )
    assert_equal_to_transformers(model, inner)


def test_language_embeddings_join_the_first_block_input_as_recomputed_by_hand():
    """With `langs`, XLM adds `lang_embeddings(langs)` to the word and position embeddings before `layer_norm_emb`:
    layers[0].layer_input recomputed from the model's own modules, and the logits equal to transformers' given the same
    languages, and different from another language's."""
    inner = built("xlm")
    model = encoder(inner)
    tokens = ids(model)
    langs = torch.ones_like(tokens)
    read = []
    with torch.no_grad(), model.trace(tokens, langs=langs):
        read += [model.embeddings.save(), model.layers[0].layer_input.save(), model.logits.save()]
    words, first, logits = read
    transformer = inner.transformer
    positions = transformer.position_embeddings(torch.arange(tokens.shape[1]))[None]
    languages = transformer.lang_embeddings(langs)
    expected = transformer.layer_norm_emb(transformer.embeddings(tokens) + positions + languages)
    assert torch.equal(words, transformer.embeddings(tokens))
    assert torch.allclose(first, expected, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(logits, inner(tokens, langs=langs).logits)
        other = inner(tokens, langs=torch.zeros_like(tokens)).logits
    assert not torch.allclose(logits, other, atol=1e-3)


@pytest.mark.parametrize("model_type", sorted(HEADS))
def test_a_head_ablated_moves_the_logits_as_a_hook_on_transformers_predicts(model_type):
    """Zeroing head 2's output in block 1 equals zeroing its slice of what `attentions[1].out_lin` receives."""
    inner = built(model_type)
    model = encoder(inner)
    read = []
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.attention_head_outputs[:, :, 2] = 0
        read.append(model.logits.save())
    logits = read[0]

    def zero_head(module, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 2] = 0
        return (merged,)

    handle = inner.transformer.attentions[1].out_lin.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = inner(ids(model)).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(logits, inner(ids(model)).logits, atol=1e-3)


@pytest.mark.parametrize(
    ("model_type", "config", "reason"),
    [("xlm", {"causal": True}, "config.causal"), ("flaubert", {"pre_norm": True}, "pre_norm=True does not run")],
)
def test_a_configuration_attnlens_does_not_serve_says_why_on_every_value(model_type, config, reason):
    """XLM built causal is a decoder (`StandardizedTransformer` takes it, `StandardizedEncoder` sends it there), its
    values unserved; FlauBERT's pre_norm an encoder whose forward transformers cannot run."""
    inner = built(model_type, **config)
    serves = attnlens.StandardizedTransformer if config.get("causal") else attnlens.StandardizedEncoder
    if config.get("causal"):
        with pytest.raises(TypeError, match="attends causally"):
            encoder(inner)
    model = serves(inner, tokenizer=attnlens.models.char_tokenizer())
    report = model.support(0)
    assert all(reason in report[key] for key in ("layer_input", "self_attn.attention_probabilities", "layer_output"))
    with pytest.raises(attnlens.Unavailable, match=reason.replace(".", r"\.")), model.trace(PROMPT):
        model.layers[0].self_attn.attention_probabilities.save()
