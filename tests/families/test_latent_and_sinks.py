"""DeepSeek-V2/V3 (latent attention), DeepSeek-V4 (shared key/value head, sinks, compressed keys, hyper-connections),
GPT-OSS and MiMo-V2-Flash (sinks): what the shared identities cannot see."""

import math

import pytest
import torch
from conftest import PROMPT, tiny
from identities import trace

import attnlens

# --- DeepSeek-V2 and V3: latent attention ----------------------------------------------------------------------


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3"])
def test_latent_keys_and_values_are_expanded_per_head_from_the_latent(case):
    model = tiny(case)
    attn = model.layers[0].self_attn
    module, config = attn._module, model.config
    nope, rope, v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
    assert (attn.num_heads, attn.num_kv_heads, attn.qk_head_dim, attn.head_dim) == (4, 4, nope + rope, v_dim)
    got = trace(model, lambda m: {"x": m.layers[0].attention_norm_output, "q": m.layers[0].self_attn.attention_queries,
                                  "k": m.layers[0].self_attn.attention_keys,
                                  "v": m.layers[0].self_attn.attention_values})
    assert got["q"].shape[-1] == got["k"].shape[-1] == nope + rope and got["v"].shape[-1] == v_dim
    # Rebuilt from the latent the way MLA defines it: kv_b_proj(norm(latent)) split into each head's key and value.
    with torch.no_grad():
        latent = module.kv_a_proj_with_mqa(got["x"])[..., :config.kv_lora_rank]
        expanded = module.kv_b_proj(module.kv_a_layernorm(latent)).view(1, len(PROMPT), 4, nope + v_dim).transpose(1, 2)
    assert torch.allclose(got["k"][..., :nope], expanded[..., :nope], atol=1e-5)
    assert torch.allclose(got["v"], expanded[..., nope:], atol=1e-5)
    # The rotary part of the key is one slice shared by every head; the rest differs per head.
    shared = got["k"][..., nope:]
    assert torch.equal(shared, shared[:, :1].expand_as(shared))
    assert not torch.allclose(got["k"][:, 0, :, :nope], got["k"][:, 1, :, :nope])


def test_yarn_mscale_is_part_of_the_score_scale():
    plain, yarn = tiny("deepseek_v3"), tiny("deepseek_v3:yarn")
    qk = plain.config.qk_nope_head_dim + plain.config.qk_rope_head_dim
    assert plain.layers[0].self_attn.scale == pytest.approx(qk ** -0.5)
    rope = yarn.config.rope_parameters
    mscale = 0.1 * rope["mscale_all_dim"] * math.log(rope["factor"]) + 1.0
    attn = yarn.layers[0].self_attn
    assert attn.scale == pytest.approx(qk ** -0.5 * mscale ** 2) and attn.scale > qk ** -0.5 * 1.2
    got = trace(yarn, lambda m: {"q": m.layers[0].self_attn.attention_queries,
                                 "k": m.layers[0].self_attn.attention_keys,
                                 "s": m.layers[0].self_attn.attention_scores})
    causal = torch.ones(len(PROMPT), len(PROMPT), dtype=torch.bool).tril()
    by_hand = (got["q"] @ got["k"].transpose(2, 3) * qk ** -0.5 * mscale ** 2)[..., causal]
    assert torch.allclose(got["s"][..., causal], by_hand, atol=1e-5)


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3", "mimo_v2_flash"])
def test_dense_layers_serve_the_activation_and_moe_layers_say_why_not(case):
    model = tiny(case)
    assert model.support(0)["mlp.mlp_activation"] is None and model.support(0)["mlp.mlp_neurons"] is None
    reason = model.support(1)["mlp.mlp_activation"]
    assert "mixture-of-experts" in reason and "loop over experts" in reason
    with pytest.raises(attnlens.Unavailable, match="loop over experts"):
        with model.trace(PROMPT):
            model.layers[1].mlp.mlp_neurons.save()
    got = trace(model, lambda m: {"a": m.layers[0].mlp.mlp_activation, "out": m.layers[1].mlp.mlp_output})
    assert got["a"].shape == (1, len(PROMPT), model.config.intermediate_size)
    assert got["out"].shape == (1, len(PROMPT), 64)


def test_latent_attention_under_sdpa_serves_everything_but_the_pattern():
    eager, sdpa = tiny("deepseek_v2"), tiny("deepseek_v2", attn_implementation="sdpa")
    assert "attn_implementation='eager'" in sdpa.support(1)["self_attn.attention_probabilities"]
    names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs", "attention_premix")
    got = [trace(m, lambda m: {n: getattr(m.layers[1].self_attn, n) for n in names}) for m in (eager, sdpa)]
    for name in names:
        assert torch.allclose(got[0][name], got[1][name], atol=1e-5), name


# --- sinks: GPT-OSS, MiMo-V2-Flash, DeepSeek-V4 ----------------------------------------------------------------


@pytest.mark.parametrize(("case", "layer"), [("gpt_oss", 0), ("gpt_oss", 1), ("mimo_v2_flash", 0), ("deepseek_v4", 0)])
def test_sink_share_is_the_softmax_mass_of_the_sink_logit(case, layer):
    model = tiny(case)
    attn = model.layers[layer].self_attn
    got = trace(model, lambda m: {"s": m.layers[layer].self_attn.attention_scores,
                                  "sinks": m.layers[layer].self_attn.attention_sinks,
                                  "p": m.layers[layer].self_attn.attention_probabilities})
    logits = attn._module.sinks.detach().reshape(1, -1, 1, 1).expand(*got["s"].shape[:3], 1)
    by_hand = torch.cat([got["s"], logits], dim=-1).softmax(-1)
    assert torch.allclose(got["sinks"], by_hand[..., -1], atol=1e-6)
    assert torch.allclose(got["p"], by_hand[..., :-1], atol=1e-6)
    assert (got["sinks"] > 0).all() and got["sinks"].max() > 0.1  # the sink takes a real share


@pytest.mark.parametrize("case", ["gpt_oss", "deepseek_v4"])
def test_sinks_are_read_between_scores_and_pattern_and_are_read_only(case):
    model = tiny(case)
    order = model.order(0)
    assert order["self_attn.attention_scores"] < order["self_attn.attention_sinks"] \
        < order["self_attn.attention_probabilities"]
    with pytest.raises(attnlens.OrderError, match="attention_sinks"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_probabilities.save()
            model.layers[0].self_attn.attention_sinks.save()
    with pytest.raises(attnlens.EditError, match="read-only"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_sinks = torch.zeros(1, 4, len(PROMPT))
    assert "read-only" in model.support(0).notes["self_attn.attention_sinks"]


def test_mimo_sinks_and_doubled_kv_heads_only_on_sliding_layers():
    model = tiny("mimo_v2_flash")
    sliding, full = model.layers[0].self_attn, model.layers[1].self_attn
    assert (sliding.num_kv_heads, full.num_kv_heads) == (4, 2)
    assert (sliding.qk_head_dim, sliding.head_dim) == (16, 8)
    assert model.support(0)["self_attn.attention_sinks"] is None
    assert "only to its sliding-window layers" in model.support(1)["self_attn.attention_sinks"]
    with pytest.raises(attnlens.Unavailable, match="sliding-window layers"):
        with model.trace(PROMPT):
            model.layers[1].self_attn.attention_sinks.save()
    got = trace(model, lambda m: {"p": m.layers[1].self_attn.attention_probabilities})
    assert torch.allclose(got["p"].sum(-1), torch.ones(1, 4, len(PROMPT)), atol=1e-6)


def test_mimo_values_carry_the_attention_value_scale():
    model = tiny("mimo_v2_flash")
    scale = model.config.attention_value_scale
    assert scale == 0.5
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "v": m.layers[1].self_attn.attention_values})
    with torch.no_grad():
        projected = model.layers[1].self_attn._module.v_proj(got["x"]).view(1, len(PROMPT), 2, 8).transpose(1, 2)
    assert torch.allclose(got["v"], projected * scale, atol=1e-6)
    assert "attention_value_scale=0.5" in model.support(1).notes["self_attn.attention_values"]


def test_score_function_serves_decode_queries_against_a_sliding_window():
    # Fewer queries than keys, as at a decode step: the family's mask must place them at the end.
    model = tiny("gpt_oss")
    got = trace(model, lambda m: {"q": m.layers[0].self_attn.attention_queries,
                                  "k": m.layers[0].self_attn.attention_keys,
                                  "s": m.layers[0].self_attn.attention_scores})
    module = model.layers[0].self_attn._module
    last = model.family.scores(model.family.geometry(module), model.config, got["q"][:, :, -3:], got["k"], 0)
    assert torch.equal(last == torch.finfo(last.dtype).min, got["s"][:, :, -3:] == torch.finfo(last.dtype).min)
    assert torch.allclose(last, got["s"][:, :, -3:], atol=1e-5)
    assert model.family.sliding_window(model.config, 0) == 4 and model.family.sliding_window(model.config, 1) is None


def test_gpt_oss_mlp_output_is_the_first_item_of_the_moe_output():
    model = tiny("gpt_oss")
    assert "loop over experts" in model.support(0)["mlp.mlp_activation"]
    got = trace(model, lambda m: {"x": m.layers[0].mlp_input, "out": m.layers[0].mlp.mlp_output})
    with torch.no_grad():
        out, router_scores = model.layers[0].mlp._module(got["x"])
    assert torch.equal(got["out"], out) and router_scores.shape[-1] == model.config.num_experts_per_tok


# --- DeepSeek-V4 -------------------------------------------------------------------------------------------------


def v4_attention(layer):
    names = ("attention_keys", "attention_values", "attention_probabilities", "attention_head_outputs",
             "attention_premix", "attention_output")
    return lambda m: {n: getattr(m.layers[layer].self_attn, n) for n in names}


def test_v4_keys_and_values_are_one_shared_head():
    model = tiny("deepseek_v4")
    attn = model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_head_dim) == (4, 1, 16, 16)
    got = trace(model, v4_attention(0))
    assert got["attention_keys"].shape == (1, 1, len(PROMPT), 16)
    assert got["attention_keys"].data_ptr() == got["attention_values"].data_ptr()
    note = model.support(0).notes["self_attn.attention_values"]
    assert "one tensor passed as both key and value" in note


def test_v4_assigning_values_leaves_the_scores_and_an_in_place_edit_of_keys_reaches_values():
    model = tiny("deepseek_v4")
    clean = trace(model, v4_attention(0))
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_values = attn.attention_values * 2
        probs, heads = attn.attention_probabilities.save(), attn.attention_head_outputs.save()
    assert torch.allclose(probs, clean["attention_probabilities"], atol=1e-6)
    assert torch.allclose(heads, 2 * clean["attention_head_outputs"], atol=1e-5)
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_keys[:] = 0  # the same tensor as the values: both become zero
        probs, heads = attn.attention_probabilities.save(), attn.attention_head_outputs.save()
    assert torch.equal(heads, torch.zeros_like(heads))
    visible = probs[0, :, -1, -4:]  # all scores zero: the last query spreads evenly over its window
    assert torch.allclose(visible, visible[:, :1].expand_as(visible))


def test_v4_premix_is_the_grouped_projection_input_after_the_inverse_rotation():
    model = tiny("deepseek_v4")
    family, module = model.family, model.layers[0].self_attn._module
    got = trace(model, v4_attention(0))
    heads, premix = got["attention_head_outputs"], got["attention_premix"]
    assert premix.shape == (1, len(PROMPT), 64)
    assert not torch.allclose(heads.reshape(1, len(PROMPT), -1), premix, atol=1e-3)  # the rotation matters
    assert torch.allclose(family.merge_heads(module, heads), premix, atol=1e-5)
    rope = model.config.qk_rope_head_dim  # only the trailing rotary channels of each head change
    assert torch.allclose(heads[..., :-rope].reshape(1, len(PROMPT), 4, -1),
                          premix.view(1, len(PROMPT), 4, 16)[..., :-rope], atol=1e-6)


def test_v4_premix_edits_land_in_place_and_by_assignment():
    model = tiny("deepseek_v4")
    family, module = model.family, model.layers[0].self_attn._module
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_premix[:, :, :16] = 0  # head 0, through the flattened view
        edited, out = attn.attention_premix.save(), attn.attention_output.save()
    assert torch.equal(edited[..., :16], torch.zeros(1, len(PROMPT), 16))
    assert torch.allclose(out, family.project_output(module, edited), atol=1e-6)
    with torch.no_grad(), model.trace(PROMPT):
        attn = model.layers[0].self_attn
        attn.attention_premix = torch.ones(1, len(PROMPT), 64)
        out = attn.attention_output.save()
    assert torch.allclose(out, family.project_output(module, torch.ones(1, len(PROMPT), 64)), atol=1e-6)


def test_v4_residual_is_hyper_connection_streams():
    model = tiny("deepseek_v4")
    hc = model.config.hc_mult
    got = trace(model, lambda m: {"e": m.embeddings, "in": m.layers[0].layer_input,
                                  "a": m.layers[0].self_attn.attention_output, "mid": m.layers[0].layer_mid,
                                  "out": m.layers[0].layer_output})
    assert got["in"].shape == got["mid"].shape == got["out"].shape == (1, len(PROMPT), hc, 64)
    assert torch.equal(got["in"], got["e"][:, :, None].expand(-1, -1, hc, -1))
    assert not torch.allclose(got["mid"], got["in"] + got["a"][:, :, None], atol=1e-3)  # not a plain sum
    block = model.layers[0]._module
    with torch.no_grad():
        mixed = model.family.residual_add(block, "attention", got["in"], got["a"])
    assert torch.allclose(mixed, got["mid"], atol=1e-5)
    notes = model.support(0).notes
    assert all("hyper-connection streams" in notes[k] for k in ("layer_input", "layer_mid", "layer_output"))


@pytest.mark.parametrize(("layer", "kind", "entries"), [(1, "heavily_compressed_attention", 18 // 8),
                                                  (2, "compressed_sparse_attention", 18 // 4)])
def test_v4_compressed_layers_report_their_longer_key_axis(layer, kind, entries):
    model = tiny("deepseek_v4")
    report = model.support(layer)
    for key in ("attention_keys", "attention_values", "attention_scores", "attention_probabilities",
                "attention_sinks"):
        assert kind in report[f"self_attn.{key}"] and "seq + seq // compress_rate" in report[f"self_attn.{key}"]
    for key in ("attention_queries", "attention_head_outputs", "attention_premix", "attention_output"):
        assert report[f"self_attn.{key}"] is None
    with pytest.raises(attnlens.Unavailable, match=kind):
        with model.trace(PROMPT):
            model.layers[layer].self_attn.attention_keys.save()
    # What the reason claims: the attention function receives the sliding keys plus the compressor's entries.
    with torch.no_grad(), model.trace(PROMPT):
        keys = model.layers[layer].self_attn.source.attention_interface_1.inputs[0][2].save()
        queries = model.layers[layer].self_attn.attention_queries.save()
    assert keys.shape == (1, 1, len(PROMPT) + entries, 16) and queries.shape == (1, 4, len(PROMPT), 16)
