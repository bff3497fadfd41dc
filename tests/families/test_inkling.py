"""Inkling (attnlens/families/inkling.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import needs, tiny
from identities import N, trace

import attnlens
from attnlens.models import char_tokenizer, tiny_model


@pytest.mark.parametrize("layer", [0, 1])
def test_inkling_scores_add_the_hidden_state_bias_within_its_extent(layer):
    model = tiny("inkling_text")
    attn = model.layers[layer].self_attn
    module = attn._module
    got = trace(
        model,
        lambda m: {
            "x": m.layers[layer].attention_norm_output,
            "q": m.layers[layer].self_attn.attention_queries,
            "k": m.layers[layer].self_attn.attention_keys,
            "s": m.layers[layer].self_attn.attention_scores,
        },
    )
    assert attn.scale == pytest.approx(1 / attn.head_dim)
    plain = model.family.score_function().scores(attn.heads, model.config, got["q"], got["k"], layer)
    bias = got["s"] - plain
    distance = torch.arange(N)[:, None] - torch.arange(N)[None, :]
    extent = model.config.sliding_window_size if layer == 0 else model.config.rel_extent
    inside = (distance >= 0) & (distance < extent)
    assert (bias[..., ~inside] == 0).all() and (bias[..., inside].abs() > 1e-4).float().mean() > 0.9
    # by hand: per head, r_proj's weights mix the learned profiles, indexed by the distance back
    with torch.no_grad():
        weights = module.r_proj(got["x"]).view(1, N, attn.num_heads, -1)
        profiles = (weights @ module.rel_logits_proj.proj).transpose(1, 2)  # [batch, heads, query, extent]
    by_hand = profiles.gather(-1, distance.clamp(0, extent - 1).expand(1, attn.num_heads, N, N))
    assert torch.allclose(bias[..., inside], by_hand[..., inside], atol=1e-5)
    assert "relative-position bias" in model.support(layer).notes["self_attn.attention_scores"]


def test_inkling_keys_and_values_pass_their_short_convolutions():
    model = tiny("inkling_text")
    module = model.layers[1].self_attn._module
    got = trace(
        model,
        lambda m: {
            "x": m.layers[1].attention_norm_output,
            "k": m.layers[1].self_attn.attention_keys,
            "v": m.layers[1].self_attn.attention_values,
        },
    )
    heads, size = module.num_key_value_heads, module.head_dim
    with torch.no_grad():
        keys = module.k_norm(module.k_sconv(module.k_proj(got["x"])).view(1, N, heads, size)).transpose(1, 2)
        values = module.v_sconv(module.v_proj(got["x"])).view(1, N, heads, size).transpose(1, 2)
        unconvolved = module.v_proj(got["x"]).view(1, N, heads, size).transpose(1, 2)
    assert torch.allclose(keys, got["k"], atol=1e-6) and torch.allclose(values, got["v"], atol=1e-6)
    assert not torch.allclose(unconvolved, got["v"], atol=1e-3)


def test_inkling_log_scaling_multiplies_the_full_layers_queries():
    model = tiny("inkling_text:log_scaling")
    module = model.layers[1].self_attn._module
    got = trace(model, lambda m: {"x": m.layers[1].attention_norm_output, "q": m.layers[1].self_attn.attention_queries})
    floor, alpha = model.config.log_scaling_n_floor, model.config.log_scaling_alpha
    tau = 1 + alpha * torch.log(((torch.arange(N) + 1) / floor).clamp(min=1))
    with torch.no_grad():
        plain = module.q_norm(module.q_proj(got["x"]).view(1, N, -1, module.head_dim)).transpose(1, 2)
    assert torch.allclose(plain * tau[None, None, :, None], got["q"], atol=1e-6)
    assert tau[-1] > 1.5 and "tau" in model.support(1).notes["self_attn.attention_queries"]
    assert "tau" not in model.support(0).notes["self_attn.attention_queries"]  # sliding layers are not log-scaled


def test_inkling_dense_mlp_output_carries_its_global_scale():
    needs("inkling_text")
    module = tiny_model("inkling_text")
    with torch.no_grad():
        module.model.layers[0].mlp.global_scale.fill_(2.0)
    model = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer(), attn_implementation="eager")
    got = trace(model, lambda m: {"n": m.layers[0].mlp.mlp_neurons, "o": m.layers[0].mlp.mlp_output})
    with torch.no_grad():
        assert torch.allclose(module.model.layers[0].mlp.down_proj(got["n"]) * 2, got["o"], atol=1e-6)
    assert "global_scale" in model.support(0).notes["mlp.mlp_output"]
    assert "shared experts" in model.support(1)["mlp.mlp_activation"]


def test_inkling_patterns_are_not_rebuilt_or_summarised_from_queries_and_keys():
    needs("inkling_text")
    sdpa = attnlens.models.tiny("inkling_text", attn_implementation="sdpa", rebuild_patterns=True)
    reason = sdpa.support(0)["self_attn.attention_probabilities"]
    assert "rebuild_patterns cannot rebuild it here" in reason and "relative-position bias" in reason
    assert "score function is unavailable" in attnlens.heads.why_not(tiny("inkling_text"), 1)
