"""The pre-norm BERT-shaped encoders (Megatron-BERT, RoBERTa-PreLayerNorm, XLM-RoBERTa-XL, ESM) and RoFormer
(`families/prenorm_bert.py`), as masked LMs through `StandardizedEncoder`, against transformers' own arithmetic: the
norms in front of each sublayer (an edit of a norm's output lands where the sublayer reads it; a post-norm wiring of
the same values fails), the final norm, and the rotary embedding on the queries and the keys (ESM's rotary layout,
RoFormer)."""

import functools
import math

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.prenorm_bert import PreNormBert
from attnlens.parts import identities

SIZES = dict(
    num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128, pad_token_id=0
)
PROMPT = "Hello world"
PRE_NORM = ("megatron-bert", "roberta-prelayernorm", "xlm-roberta-xl", "esm")
#: The rotary layouts, with weights wide enough that patterns are far from uniform.
ROTARY = {
    "esm": {"position_embedding_type": "rotary", "initializer_range": 0.2},
    "roformer": {"initializer_range": 0.2},
}
#: Each pre-norm type's masked LM: where the module the attention's `self` reads from and the one `intermediate.dense`
#: reads from are (transformers' code, not the family's data), and its LM head (what the final norm feeds).
HEADS = {"megatron-bert": "cls", "roberta-prelayernorm": "lm_head", "xlm-roberta-xl": "lm_head", "esm": "lm_head"}


@functools.cache
def encoder(model_type: str, **config) -> attnlens.StandardizedEncoder:
    """The type's masked LM, built as tests/test_encoders.py builds it: tiny, eager, its norms perturbed."""
    built = transformers.AutoConfig.for_model(model_type, **{**SIZES, **config})
    built._attn_implementation = "eager"
    torch.manual_seed(0)
    masked_lm = getattr(transformers, modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type])(built)
    inner = attnlens.models._perturbed(masked_lm.eval())
    return attnlens.StandardizedEncoder(inner, tokenizer=attnlens.models.char_tokenizer())


def ids(model, prompt=PROMPT):
    return model.tokenizer(prompt, return_tensors="pt").input_ids


def blocks(model):
    return model._module.get_submodule(model.family.layers)


def hooked(model, module, hook, prompt=PROMPT, pre=True):
    """transformers' logits with `hook` on `module` (a forward pre-hook on its first input, or a forward hook)."""
    handle = (
        module.register_forward_pre_hook(lambda m, args: (hook(args[0]), *args[1:]))
        if pre
        else module.register_forward_hook(lambda m, args, output: hook(output))
    )
    try:
        with torch.no_grad():
            return model._module(ids(model, prompt)).logits
    finally:
        handle.remove()


@pytest.mark.parametrize("case", [*PRE_NORM, "roformer", "esm:rotary"])
def test_every_value_equals_transformers_and_the_last_hidden_state_is_the_final_norms(case):
    model_type, _, layout = case.partition(":")
    model = encoder(model_type, **(ROTARY[model_type] if layout else {}))
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    with torch.no_grad():
        reference = model._module(ids(model), output_attentions=True, output_hidden_states=True)
    for layer in range(2):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer])
    assert torch.equal(saved[(0, "layer_output")], reference.hidden_states[1])
    assert torch.equal(saved["logits"], reference.logits)
    if model_type == "roformer":  # post-norm, no final norm: the last block's output is the last hidden state
        assert torch.equal(saved[(1, "layer_output")], reference.hidden_states[2])
        assert model.support()["final_norm_output"].startswith("BERT has no final norm")
        return
    # transformers ties the last hidden state to the final norm's output; the block's own output is before it
    assert torch.equal(saved["final_norm_output"], reference.hidden_states[2])
    final = model._module.get_submodule(model.family.final_norm)
    assert torch.allclose(final(saved[(1, "layer_output")]), saved["final_norm_output"], atol=1e-6)
    assert not torch.allclose(saved[(1, "layer_output")], reference.hidden_states[2], atol=1e-2)


@pytest.mark.parametrize("model_type", PRE_NORM)
def test_the_residual_adds_are_plain_sums_and_the_norms_feed_the_sublayers(model_type):
    """Pre-norm: layer_mid = layer_input + attention_output and layer_output = layer_mid + mlp_output exactly as
    summed (a norm after either add breaks it), the attention norm's output is what the query projection reads, the
    MLP norm's what intermediate.dense reads."""
    model = encoder(model_type)
    saved = read_everything(model, PROMPT)
    block = blocks(model)[0]
    v = {name: saved[(0, name)] for name in ("layer_input", "attention_output", "layer_mid", "mlp_output")}
    assert torch.allclose(v["layer_input"] + v["attention_output"], v["layer_mid"], atol=1e-6)
    assert torch.allclose(v["layer_mid"] + v["mlp_output"], saved[(0, "layer_output")], atol=1e-6)
    assert torch.allclose(saved[(0, "layer_output")], saved[(1, "layer_input")])
    queries = block.attention.self.query(saved[(0, "attention_norm_output")]).view(1, -1, 4, 16).transpose(1, 2)
    if model_type == "esm":  # ESM scales its queries before the attention interface (whose scaling is 1)
        queries = queries * 16**-0.5
        assert model.layers[0].self_attn.heads.scale == 1.0
    assert torch.allclose(queries, saved[(0, "attention_queries")], atol=1e-6)
    neurons = block.intermediate.dense(saved[(0, "mlp_norm_output")])
    assert torch.allclose(torch.nn.functional.gelu(neurons), saved[(0, "mlp_activation")], atol=1e-5)
    assert not torch.allclose(saved[(0, "attention_norm_output")], v["layer_input"], atol=1e-2)


@pytest.mark.parametrize("model_type", PRE_NORM)
def test_editing_each_norms_output_lands_where_its_sublayer_reads_it(model_type):
    """Zeroing attention_norm_output (mlp_norm_output) of layer 0 gives transformers' logits with the self-attention's
    (intermediate.dense's) input zeroed by a hook; doubling final_norm_output, those with the LM head's input doubled.
    A family that read these values after the residual adds, post-norm, would edit other tensors."""
    model = encoder(model_type)
    block, inner = blocks(model)[0], model._module
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[0].attention_norm_output[:] = 0
        zero_attention = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[0].mlp_norm_output[:] = 0
        zero_mlp = model.logits.save()
    with torch.no_grad(), model.trace(PROMPT):
        model.final_norm_output[:] *= 2
        doubled = model.logits.save()
    assert torch.allclose(zero_attention, hooked(model, block.attention.self, torch.zeros_like), atol=1e-5)
    assert torch.allclose(zero_mlp, hooked(model, block.intermediate.dense, torch.zeros_like), atol=1e-5)
    assert torch.allclose(doubled, hooked(model, inner.get_submodule(HEADS[model_type]), lambda x: x * 2), atol=1e-5)
    with torch.no_grad():
        plain = inner(ids(model)).logits
    for edited in (zero_attention, zero_mlp, doubled):
        assert not torch.allclose(edited, plain, atol=1e-3)


def test_a_post_norm_wiring_of_the_same_values_fails_the_identities():
    """The identities tell the wirings apart: the pre-norm family's residual adds (plain sums) hold; the same family
    with BERT's post-norm adds (the sum normalised by the sublayer's norm) is refused at load on every layer."""

    class PostNormWired(type(encoder("xlm-roberta-xl").family)):
        class Identities(identities.Identities):
            def residual_add(self, block, sublayer, stream, update, **arguments):
                norm = block.attention.self_attn_layer_norm if sublayer == "attention" else block.LayerNorm
                return norm(stream + update)

    model = encoder.__wrapped__("xlm-roberta-xl")  # a model of its own: wrapped again below
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(2)] == [[], []]
    with pytest.raises(attnlens.Miswired) as refused:
        attnlens.StandardizedEncoder(model._module, tokenizer=attnlens.models.char_tokenizer(), family=PostNormWired)
    for layer in range(2):
        assert f"layer {layer}, layer input + attention output == layer mid" in str(refused.value)
        assert f"layer {layer}, layer mid + mlp output == layer output" in str(refused.value)
    assert isinstance(model.family, PreNormBert) and not isinstance(encoder("roformer").family, PreNormBert)


def rotated(x, positions, interleaved):
    """`x` [batch, heads, seq, head_dim] rotated by the rotary embedding at `positions`, written from the papers'
    formulas (not transformers'): angle p / 10000^(2i/d) on pair i, the pairs interleaved (RoFormer: dimensions 2i,
    2i+1) or split in halves (ESM: dimensions i, i + d/2)."""
    d = x.shape[-1]
    angles = positions[:, None].double() / 10000 ** (torch.arange(0, d, 2).double() / d)
    cos, sin = angles.cos().float(), angles.sin().float()
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : d // 2], x[..., d // 2 :])
    turned = (first * cos - second * sin, second * cos + first * sin)
    if interleaved:
        return torch.stack(turned, dim=-1).flatten(-2)
    return torch.cat(turned, dim=-1)


@pytest.mark.parametrize("model_type", sorted(ROTARY))
def test_rotary_turns_the_keys_as_well_as_the_queries(model_type):
    """The keys served are the key projection rotated at each position (by hand), not the projection itself; on a
    prompt of one repeated token (the same layer-0 input at every position: no absolute positions) the scores
    depend only on the query-key offset, which needs both the queries and the keys rotated."""
    model = encoder(model_type, **ROTARY[model_type])
    prompt = "aaaaaaa"
    with torch.no_grad(), model.trace(prompt):
        attention = model.layers[0].self_attn
        read = model.layers[0].attention_norm_output if model_type == "esm" else model.layers[0].layer_input
        attention_input = read.save()
        keys = attention.attention_keys.save()  # (the keys first: a family reading them before rotary reads early)
        queries = attention.attention_queries.save()
        scores = attention.attention_scores.save()
    module = blocks(model)[0].attention.self
    raw_keys = module.key(attention_input).view(1, -1, 4, 16).transpose(1, 2)
    positions = torch.arange(len(prompt))
    interleaved = model_type == "roformer"
    assert torch.allclose(keys, rotated(raw_keys, positions, interleaved), atol=1e-5)
    assert not torch.allclose(keys[..., 1:, :], raw_keys[..., 1:, :], atol=1e-3)  # rotary was applied
    raw_queries = module.query(attention_input).view(1, -1, 4, 16).transpose(1, 2)
    if model_type == "esm":
        raw_queries = raw_queries * 16**-0.5
    assert torch.allclose(queries, rotated(raw_queries, positions, interleaved), atol=1e-5)
    scale = model.layers[0].self_attn.heads.scale
    assert torch.allclose(scores, queries @ keys.transpose(-1, -2) * scale, atol=1e-5)
    for offset in range(-3, 4):  # constant along each diagonal: a function of i - j alone
        diagonal = scores.diagonal(offset, dim1=-2, dim2=-1)
        assert torch.allclose(diagonal, diagonal[..., :1].expand_as(diagonal), atol=1e-4), offset
    skipped = queries @ raw_keys.transpose(-1, -2) * scale  # rotary skipped on the keys: no longer so
    assert not torch.allclose(skipped.diagonal(1, -2, -1), skipped.diagonal(1, -2, -1)[..., :1], atol=1e-3)


@pytest.mark.parametrize("model_type", sorted(ROTARY))
def test_keys_written_unrotated_move_the_pattern_as_recomputed_by_hand(model_type):
    """Assigning layer 0's keys their unrotated projection: the pattern is then softmax(q . k_raw * scale), computed
    by hand; the edit lands after the rotary embedding, where the scores' product reads the keys."""
    model = encoder(model_type, **ROTARY[model_type])
    module = blocks(model)[0].attention.self
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[0].self_attn
        read = model.layers[0].attention_norm_output if model_type == "esm" else model.layers[0].layer_input
        attention_input = read.save()
    raw_keys = module.key(attention_input).view(1, -1, 4, 16).transpose(1, 2).detach()
    with torch.no_grad(), model.trace(PROMPT):
        attention = model.layers[0].self_attn
        queries = attention.attention_queries.save()
        attention.attention_keys = raw_keys
        pattern = attention.attention_probabilities.save()
        logits = model.logits.save()
    scale = model.layers[0].self_attn.heads.scale
    assert torch.allclose(pattern, (queries @ raw_keys.transpose(-1, -2) * scale).softmax(-1), atol=1e-6)
    with torch.no_grad():
        plain = model._module(ids(model), output_attentions=True)
    assert not torch.allclose(pattern, plain.attentions[0], atol=1e-2)
    assert not torch.allclose(logits, plain.logits, atol=1e-3)


def test_esm_serves_absolute_positions_by_default_and_says_which():
    assert transformers.EsmConfig().position_embedding_type == "absolute"
    absolute, rotary = encoder("esm"), encoder("esm", **ROTARY["esm"])
    assert "no rotary embedding" in absolute.support(0).notes["self_attn.attention_keys"]
    assert "absolute" in absolute.support(0).notes["self_attn.attention_queries"]
    assert rotary.support(0).notes["self_attn.attention_keys"].startswith("rotated")
    assert rotary._module.esm.embeddings.position_embedding_type == "rotary"
    assert absolute._module.esm.embeddings.position_embedding_type == "absolute"


@pytest.mark.parametrize("model_type", ["megatron-bert", "roformer"])
def test_own_attention_masks_padding_as_the_score_function_does(model_type):
    """Megatron-BERT and RoFormer add the mask in their own forward: on a padded batch the scores read are the
    family's score function of the queries and keys read, with the padding masked, and padding gets no weight."""
    model = encoder(model_type)
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), model.trace(prompts):
        attention = model.layers[1].self_attn
        queries, keys = attention.attention_queries.save(), attention.attention_keys.save()
        scores, pattern = attention.attention_scores.save(), attention.attention_probabilities.save()
    heads = model.layers[1].self_attn.heads
    assert math.isclose(heads.scale, 16**-0.5)
    expected = model.family.score_function().scores(heads, model.config, queries, keys, 1, batch.attention_mask)
    assert torch.allclose(expected, scores, atol=1e-5)
    padding = ~batch.attention_mask.bool()[:, None, None, :].expand_as(pattern)
    assert padding.any() and (pattern[padding] == 0).all()


@pytest.mark.parametrize("model_type", ["roberta-prelayernorm", "xlm-roberta-xl", "megatron-bert"])
def test_left_padding_changes_values_only_where_the_family_says(model_type):
    """RoBERTa's position ids count real tokens only, so transformers' own left-padded run keeps a prompt's values,
    while Megatron-BERT's count from the padded start; both families say padding changes values under attnlens, the
    RoBERTa ones because nnsight gives a left-padded batch 0-based positions (`bert.ROBERTA_POSITIONS`)."""
    model = encoder(model_type)
    inner = model._module
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids(model, "Hi")], dim=1)
    mask = (padded != 0).long()
    with torch.no_grad():
        alone = inner(ids(model, "Hi"), output_hidden_states=True).hidden_states[1]
        left = inner(padded, attention_mask=mask, output_hidden_states=True).hidden_states[1][:, 3:]
    assert torch.allclose(alone, left, atol=1e-5) == (model_type != "megatron-bert")
    assert model.family.padding_changes_values is not None
