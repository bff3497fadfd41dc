"""ModernBERT and the rotary encoders served beside it (families/modernbert.py, llama_encoders.py, gte.py), each a
tiny masked LM built as tests/test_encoders.py builds it: the identities on every layer and the patterns
against transformers' own; ModernBERT's local band, zero outside it on both sides and nowhere else; each kind of
layer rotating with its own theta, recomputed by hand; and what each other type adds (ESM C's scaled residual
branches, GTE's post-norm block, a padded batch's masked keys)."""

import pytest
import torch
import transformers
from conftest import needs
from transformers.models.auto import modeling_auto

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.modernbert import ModernBert
from attnlens.registry import family_for

SIZES = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=128, vocab_size=128,
             pad_token_id=0)  # fmt: skip
PROMPT = "Hello world"  # 11 tokens: wider than a local band of 2 keys each side
TYPES = ("modernbert", "eurobert", "ultrabert", "esmc", "gte", "nomic_bert", "jina_embeddings_v3")
WITH_FINAL_NORM = ("modernbert", "eurobert", "ultrabert", "esmc")


def inner(model_type: str, **overrides) -> torch.nn.Module:
    """The tiny masked LM tests/test_encoders.py builds: its sizes, the family's tiny kwargs, then `overrides`
    (skipped where the installed transformers lacks the type: UltraBERT is newer than 5.19)."""
    needs(model_type)
    config = transformers.AutoConfig.for_model(
        model_type, **{**SIZES, **family_for(model_type).tiny.kwargs, **overrides}
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    masked_lm = getattr(transformers, modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES[model_type])
    return attnlens.models._perturbed(masked_lm(config).eval())


def encoder(model_type: str, family=None, **overrides) -> attnlens.StandardizedEncoder:
    kwargs = {} if family is None else {"family": family, "verify": False}
    return attnlens.StandardizedEncoder(
        inner(model_type, **overrides), tokenizer=attnlens.models.char_tokenizer(), **kwargs
    )


def rotated(x: torch.Tensor, theta: float, fraction: float = 1.0) -> torch.Tensor:
    """`x` [batch, heads, seq, head_dim] rotated at positions 0.. with base `theta`, by hand (rotate-half layout), on
    each head's first `fraction` of channels."""
    dim = int(x.shape[-1] * fraction)
    x, rest = x[..., :dim], x[..., dim:]
    inverse = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(x.shape[2], dtype=torch.float32)[:, None] * inverse
    angles = torch.cat((angles, angles), dim=-1)
    half = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return torch.cat((x * angles.cos() + half * angles.sin(), rest), dim=-1)


@pytest.mark.parametrize("model_type", TYPES)
def test_every_type_holds_its_identities_and_equals_transformers(model_type):
    model = encoder(model_type)
    assert not model.family.score_function().causal(model.config)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model._module(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(model.num_layers):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer])
        if layer < model.num_layers - 1 or model_type not in WITH_FINAL_NORM:
            assert torch.equal(saved[(layer, "layer_output")], reference.hidden_states[layer + 1])
    if model_type in WITH_FINAL_NORM:  # transformers ties its last hidden state to the final norm's output
        assert torch.equal(saved["final_norm_output"], reference.hidden_states[-1])
        assert not torch.equal(saved[(model.num_layers - 1, "layer_output")], reference.hidden_states[-1])
    assert torch.equal(saved["logits"], reference.logits)


@pytest.mark.parametrize("model_type", ["modernbert", "ultrabert"])
def test_a_local_layer_is_exactly_zero_outside_its_band_on_both_sides(model_type):
    model = encoder(model_type)
    local = model.config.layer_types.index("sliding_attention")
    full = model.config.layer_types.index("full_attention")
    band = model.config.sliding_window
    assert band == 2
    first, second = sorted((local, full))
    with torch.no_grad(), model.trace(PROMPT):  # in forward order
        earlier = model.layers[first].self_attn.attention_probabilities.save()
        later = model.layers[second].self_attn.attention_probabilities.save()
    pattern, everywhere = (earlier, later) if local == first else (later, earlier)
    n = pattern.shape[-1]
    distance = torch.arange(n)[:, None] - torch.arange(n)[None, :]  # query - key
    before, after = distance > band, distance < -band  # keys too far back, keys too far ahead
    assert before.any() and after.any()
    assert (pattern[..., before] == 0).all() and (pattern[..., after] == 0).all()
    assert (pattern[..., distance.abs() <= band] > 0).all()
    assert (everywhere > 0).all(), "a global layer sees every key"
    assert f"within {band} positions on either side" in model.support(local).notes["self_attn.attention_probabilities"]
    mask = model.family.score_function().mask(n, n, model.config, local)[0, 0]
    assert torch.equal(mask == 0, distance.abs() <= band)


def test_a_band_one_key_too_wide_fails_the_identities():
    class Wider(ModernBert):
        class ScoreFunction(ModernBert.ScoreFunction):
            def half_window(self, config, layer):
                band = super().half_window(config, layer)
                return None if band is None else band + 1

    model = encoder("modernbert", family=Wider)
    saved = read_everything(model, PROMPT)
    assert failures(model, saved, 0) == []  # the global layer has no band
    found = failures(model, saved, 1)
    assert "scores == family score function" in found and "visible entries positive" in found


@pytest.mark.parametrize("model_type", ["modernbert", "ultrabert", "neomme"])
def test_each_kind_of_layer_rotates_with_its_own_theta(model_type):
    """The queries and keys served are the projections rotated by hand with the theta of the layer's kind, and not
    with the other kind's: swapped thetas fail."""
    model = encoder(model_type, num_hidden_layers=3)
    parameters = model.config.rope_parameters
    thetas = {kind: parameters[kind]["rope_theta"] for kind in ("full_attention", "sliding_attention")}
    assert len(set(thetas.values())) == 2
    read = []
    with torch.no_grad(), model.trace(PROMPT):
        for i in range(3):
            layer = model.layers[i]
            names = (layer.attention_norm_output, layer.self_attn.attention_queries, layer.self_attn.attention_keys)
            read.append(tuple(value.save() for value in names))
    for layer, (x, queries, keys) in enumerate(read):
        attention = model.layers[layer].self_attn._module
        d = attention.head_dim
        with torch.no_grad():
            if model_type == "modernbert":
                q, k, _ = attention.Wqkv(x).view(*x.shape[:2], 3, -1, d).unbind(dim=2)
            else:
                q, k = attention.q_proj(x).view(*x.shape[:2], -1, d), attention.k_proj(x).view(*x.shape[:2], -1, d)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            if model_type == "neomme":  # normalised per head before the rotation
                q, k = attention.q_norm(q), attention.k_norm(k)
        kind = model.config.layer_types[layer]
        (other,) = set(thetas) - {kind}
        fraction = parameters[kind].get("partial_rotary_factor", 1.0)  # NeoMME's global layers: a quarter
        assert torch.allclose(rotated(q, thetas[kind], fraction), queries, atol=1e-5), (layer, kind)
        assert torch.allclose(rotated(k, thetas[kind], fraction), keys, atol=1e-5), (layer, kind)
        wrong = rotated(q, thetas[other], fraction)
        assert (wrong - queries).abs().max() > 1e-2, (layer, "the other theta gives these too")
        assert f"theta {thetas[kind]:g}" in model.support(layer).notes["self_attn.attention_queries"]


def test_padding_masks_the_padded_keys_inside_the_band_and_the_score_function_reproduces_it():
    """transformers 5.25 runs a padded ModernBERT batch masked (never unpadded): the band and the padded keys."""
    model = encoder("modernbert")
    prompts = ["Hello world", "Hi"]
    batch = model.tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad(), model.trace(prompts):
        attention = model.layers[1].self_attn
        queries, keys = attention.attention_queries.save(), attention.attention_keys.save()
        scores, pattern = attention.attention_scores.save(), attention.attention_probabilities.save()
    with torch.no_grad():
        expected = model._module(**batch, output_attentions=True).attentions[1]
    real = batch.attention_mask.bool()
    rows = real[:, None, :, None] & real[:, None, None, :]
    assert torch.allclose(pattern[rows.expand_as(pattern)], expected[rows.expand_as(pattern)], atol=1e-6)
    assert (pattern[1][:, real[1]][..., ~real[1]] == 0).all(), "the short prompt's real queries: padded keys zero"
    # a padded query with no real key inside its band has every key masked alike: the softmax spreads it evenly
    n, short = real.shape[1], int(real[1].sum())
    lonely = torch.arange(n) - (short - 1) > 2
    assert lonely.any() and torch.allclose(pattern[1][:, lonely], torch.full_like(pattern[1][:, lonely], 1 / n))
    heads = model.layers[1].self_attn.heads
    rebuilt = model.family.score_function().scores(heads, model.config, queries, keys, 1, batch.attention_mask)
    assert torch.allclose(rebuilt, scores)


def test_a_head_ablated_on_a_local_layer_moves_the_logits_as_a_hook_on_wo_predicts():
    model = encoder("modernbert")
    with torch.no_grad(), model.trace(PROMPT):
        model.layers[1].self_attn.attention_head_outputs[:, :, 2] = 0
        logits = model.logits.save()

    def zero_head(module, args):
        merged = args[0].clone()
        merged.view(*merged.shape[:2], 4, 16)[:, :, 2] = 0
        return (merged,)

    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    handle = model._module.model.layers[1].attn.Wo.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = model._module(ids).logits
    finally:
        handle.remove()
    assert torch.allclose(logits, expected, atol=1e-5)
    with torch.no_grad():
        assert (model._module(ids).logits - expected).abs().max() > 1e-3


def test_esmc_scales_each_residual_branch():
    model = encoder("esmc")
    scale = (model.config.num_hidden_layers / 36) ** 0.5
    saved = read_everything(model, PROMPT)
    for layer in range(model.num_layers):
        v = {name: saved[(layer, name)] for name in ("layer_input", "attention_output", "layer_mid", "mlp_output")}
        assert torch.allclose(v["layer_mid"], v["layer_input"] + v["attention_output"] / scale, atol=1e-5)
        assert not torch.allclose(v["layer_mid"], v["layer_input"] + v["attention_output"], atol=1e-3)
        assert torch.allclose(saved[(layer, "layer_output")], v["layer_mid"] + v["mlp_output"] / scale, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gte", "nomic_bert", "jina_embeddings_v3"])
def test_gte_shaped_blocks_are_post_norm_and_attend_from_the_block_input(model_type):
    model = encoder(model_type)
    saved = read_everything(model, PROMPT)
    theta = model.config.rope_parameters["rope_theta"]
    for layer in range(model.num_layers):
        block = model.layers[layer]._module
        x = saved[(layer, "layer_input")]
        with torch.no_grad():
            q = block.self_attn.q_proj(x).view(*x.shape[:2], 4, 16).transpose(1, 2)
            assert torch.allclose(rotated(q, theta), saved[(layer, "attention_queries")], atol=1e-5)
            mid = x + saved[(layer, "attention_output")]
            assert torch.allclose(mid, saved[(layer, "layer_mid")], atol=1e-6)
            stream = block.post_attention_layernorm(mid)
            assert torch.allclose(stream, saved[(layer, "mlp_norm_output")], atol=1e-6)
            out = block.post_mlp_layernorm(stream + saved[(layer, "mlp_output")])
            assert torch.allclose(out, saved[(layer, "layer_output")], atol=1e-6)
    assert model.support(0)["attention_norm_output"].startswith("this encoder normalises after each residual add")
    assert "no final norm" in model.support(0)["final_norm_output"]


def neomme() -> attnlens.StandardizedEncoder:
    """NeoMME's tiny masked LM with the weights its initialisation zeroes drawn at random (the output projection, the
    MLP's down projection, exclusive self-attention's alpha, the value embeddings, the mix with the first input), so
    every branch the identities check carries something."""
    model = inner("neomme")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight", "value_embeddings.weight")):
                parameter.normal_(0, 0.2)
            elif name.endswith(("alpha", "lambdas")):
                parameter.uniform_(0.3, 0.9)
    return attnlens.StandardizedEncoder(model, tokenizer=attnlens.models.char_tokenizer())


def test_neomme_holds_its_identities_with_every_branch_carrying_something():
    model = neomme()
    assert [model.config.per_layer_config[i].sliding_window for i in range(3)] == [2, 1024, None]
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(3)] == [[], [], []]
    ids = model.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        reference = model._module(ids, output_attentions=True, output_hidden_states=True)
    for layer in range(3):
        assert torch.equal(saved[(layer, "attention_probabilities")], reference.attentions[layer])
        assert saved[(layer, "attention_output")].abs().max() > 1e-2 and saved[(layer, "mlp_output")].abs().max() > 1e-2
    assert torch.equal(saved[(1, "layer_output")], reference.hidden_states[2])
    assert torch.equal(saved["logits"], reference.logits)
    pattern = saved[(0, "attention_probabilities")]  # the short band: 2 keys each side
    distance = torch.arange(11)[:, None] - torch.arange(11)[None, :]
    assert (pattern[..., distance.abs() > 2] == 0).all() and (pattern[..., distance.abs() <= 2] > 0).all()
    assert "within 2 positions" in model.support(0).notes["self_attn.attention_probabilities"]


def test_neomme_output_path_is_exclusive_self_attention_then_the_gate_which_is_why_no_premix_is_served():
    model = neomme()
    saved = read_everything(model, PROMPT)
    for layer in range(3):
        attention = model.layers[layer].self_attn._module
        heads, values = saved[(layer, "attention_head_outputs")], saved[(layer, "attention_values")]
        x = saved[(layer, "attention_norm_output")]
        with torch.no_grad():
            unit = torch.nn.functional.normalize(values.repeat_interleave(2, dim=1).transpose(1, 2), dim=-1)
            alpha = torch.tanh(attention.exclusive_self_attention.alpha).view(1, 1, -1, 1)
            exclusive = heads - alpha * (heads * unit).sum(-1, keepdim=True) * unit
            gate = torch.sigmoid(attention.output_projection.gate_proj(x))
            output = attention.output_projection.o_proj(exclusive.flatten(-2) * gate)
            merged_gated = attention.output_projection.o_proj(heads.flatten(-2) * gate)
        assert torch.allclose(output, saved[(layer, "attention_output")], atol=1e-5)
        assert (merged_gated - saved[(layer, "attention_output")]).abs().max() > 1e-3
    reason = model.support(0)["self_attn.attention_premix"]
    assert reason.startswith("NeoMME does not merge the head outputs") and "exclusive self-attention" in reason
