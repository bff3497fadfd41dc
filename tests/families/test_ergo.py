"""Ergo (attnlens/families/ergo.py): what the shared identities cannot see.

The tiny model perturbs its residual gates slightly, as it does its norms (`attnlens.models.tiny_model`); the gate tests
perturb them far from zero (`gated`), so a gate read from the wrong sublayer, or a plain add, cannot match."""

import pytest
import torch
import torch.nn.functional as F
from conftest import PROMPT, needs, tiny
from identities import N, close, failures, failures_with, read_everything, saved_for, trace

import attnlens
from attnlens.family import Family

CASE = "ergo"
SLIDING, FULL = (0, 2), 1  # the tiny layout: sliding, full, sliding; dense, sparse, sparse


def rms(x, weight, eps):
    """An RMSNorm written from its definition, in float32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def gate(weight, update, stream):
    """ErgoResidualGate from its definition: per channel, sigmoid(w) of the update plus a decayed stream."""
    w = weight.float()
    kept = torch.sqrt(1 + torch.sigmoid(w)) * torch.exp(-0.5 * F.softplus(w))
    return torch.sigmoid(w) * update + kept * stream


def angles(x, theta):
    """cos and sin of position * theta^(-2i/d) for each channel pair i of [b, h, s, d]."""
    d = x.shape[-1]
    angle = torch.arange(x.shape[2], dtype=torch.float64)[:, None] / theta ** (torch.arange(0, d, 2) / d)
    return angle.cos().float(), angle.sin().float()


def interleaved_rope(x, theta):
    """Rotation of adjacent channel pairs (2i, 2i+1): Ergo's."""
    cos, sin = angles(x, theta)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


def halves_rope(x, theta):
    """Rotation of channel i with channel i + d/2 (Llama's rotate_half): not Ergo's."""
    cos, sin = angles(x, theta)
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


@pytest.fixture(scope="module")
def gated():
    """A fresh tiny Ergo whose residual gates differ per block, sublayer and channel."""
    needs(CASE)
    model = attnlens.models.tiny(CASE)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model._module.model.layers:
            for module in (block.attention_residual_gate, block.feedforward_residual_gate):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 2)
    return model


def test_ergo_layout_notes_and_reasons():
    model = tiny(CASE)
    config = model.config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.mlp_layer_types == ["dense", "sparse", "sparse"]
    assert model.layers[FULL].self_attn._module.qk_scale is not None  # the tiny exercises the full layers' scale
    dense, sparse = model.support(0), model.support(FULL)
    assert dense["mlp.mlp_activation"] is None and dense["mlp.mlp_neurons"] is None
    assert dense.notes["mlp.mlp_activation"].startswith("relu2(up_proj(mlp_input))")
    for name in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        assert sparse[name].startswith("a sparse mixture of experts") and "relu2(x @ up_proj[e])" in sparse[name]
    assert "moe_routed_scaling_factor (2.82843)" in sparse.notes["mlp.mlp_output"]
    with pytest.raises(attnlens.Unavailable, match="ErgoExperts"):
        with model.trace(PROMPT):
            model.layers[FULL].mlp.mlp_neurons.save()
    for layer in SLIDING:
        notes = model.support(layer).notes
        assert notes["self_attn.attention_queries"].endswith("then rotated (interleaved pairs)")
        assert notes["self_attn.attention_probabilities"].startswith("sliding window: each query sees its last 4")
    full = model.support(FULL).notes
    assert full["self_attn.attention_queries"].endswith("times sqrt(global_attention_scale) = sqrt(2)")
    assert "not rotated" in full["self_attn.attention_keys"]
    assert "self_attn.attention_probabilities" not in full
    assert full["layer_mid"].startswith("attention_residual_gate(post_attention_layernorm(attention_output)")
    assert full["layer_output"].startswith("feedforward_residual_gate(post_feedforward_layernorm(mlp_output)")
    assert sparse["self_attn.attention_sinks"] == Family.absent["attention_sinks"]
    assert sparse["self_attn.attention_gate"] == Family.absent["attention_gate"]


def test_ergo_is_refused_on_vllm_in_the_words_of_what_vllm_lacks():
    family = attnlens.registered()[CASE]()
    refusal = family.vllm.refused(family, CASE)
    assert refusal.startswith("vLLM 0.32 has no Ergo") and "ErgoConfig" in refusal
    vllm_registry = pytest.importorskip("vllm.model_executor.models.registry")  # where vLLM is installed: still true
    import transformers

    assert "ErgoForCausalLM" not in vllm_registry._VLLM_MODELS and not hasattr(transformers, "ErgoConfig")


def queries_keys_values_by_hand(model, layer, x, rope=interleaved_rope):
    """The attention's queries, keys and values from its input, written from the model's source: one fused
    projection viewed per head and split [q | k | v] along the heads, per-head RMSNorm, then rotation on sliding layers
    and sqrt(global_attention_scale) on full ones."""
    module = model.layers[layer].self_attn._module
    config = model.config
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, module.head_dim
    fused = module.qkv_proj(x).view(*x.shape[:2], -1, d)
    q, k, v = fused.split((heads, kv, kv), dim=2)
    eps = config.rms_norm_eps
    q, k = (rms(t, norm.weight, eps).transpose(1, 2) for t, norm in ((q, module.q_norm), (k, module.k_norm)))
    if config.layer_types[layer] == "sliding_attention":
        theta = config.rope_parameters["sliding_attention"]["rope_theta"]
        q, k = rope(q, theta), rope(k, theta)
    elif config.global_attention_scale is not None:
        q, k = q * config.global_attention_scale**0.5, k * config.global_attention_scale**0.5
    return q, k, v.transpose(1, 2)


@pytest.mark.parametrize("layer", [0, FULL])
def test_ergo_queries_keys_and_values_come_from_the_fused_projection_as_the_source_says(layer):
    model, saved = tiny(CASE), saved_for(CASE)
    with torch.no_grad():
        q, k, v = queries_keys_values_by_hand(model, layer, saved[(layer, "attention_norm_output")])
    served = [saved[(layer, f"attention_{name}")] for name in ("queries", "keys", "values")]
    assert all(close(mine, theirs) for mine, theirs in zip((q, k, v), served))
    if layer == FULL:  # the scale reaches the scores: q.k * d^-0.5 * global_attention_scale where the key is seen
        scale = model.config.global_attention_scale
        q0, k0 = q / scale**0.5, k / scale**0.5
        groups = model.config.num_attention_heads // model.config.num_key_value_heads
        expected = q0 @ k0.repeat_interleave(groups, dim=1).transpose(2, 3) * q.shape[-1] ** -0.5 * scale
        seen = torch.ones(N, N, dtype=torch.bool).tril()
        assert close(expected[..., seen], saved[(layer, "attention_scores")][..., seen])
        assert not close(q0, served[0])
    else:  # rotated in adjacent pairs, not in halves
        with torch.no_grad():
            q_halves, _, _ = queries_keys_values_by_hand(
                model, layer, saved[(layer, "attention_norm_output")], halves_rope
            )
        assert not close(q_halves, served[0])


def test_ergo_full_layers_without_a_global_scale_serve_the_normalised_queries():
    model = tiny(CASE, global_attention_scale=None)
    assert model.config.global_attention_scale is None and model.layers[FULL].self_attn._module.qk_scale is None
    notes = model.support(FULL).notes
    assert notes["self_attn.attention_queries"].endswith("(full-attention layers have no positional encoding)")
    got = trace(
        model,
        lambda m: {
            "x": m.layers[FULL].attention_norm_output,
            "q": m.layers[FULL].self_attn.attention_queries,
            "k": m.layers[FULL].self_attn.attention_keys,
        },
    )
    with torch.no_grad():
        q, k, _ = queries_keys_values_by_hand(model, FULL, got["x"])
    assert close(q, got["q"]) and close(k, got["k"])
    assert not close(q * 2**0.5, got["q"])


def test_ergo_sliding_layers_see_only_their_window():
    saved = saved_for(CASE)
    for layer in SLIDING:
        last = saved[(layer, "attention_probabilities")][0, :, -1]
        assert (last[:, :-4] == 0).all() and (last[:, -4:] > 0).all()
    assert (saved[(FULL, "attention_probabilities")][0, :, -1] > 0).all()


def test_ergo_dense_mlp_is_relu_squared_of_up_with_no_gate():
    model, saved = tiny(CASE), saved_for(CASE)
    mlp = model.layers[0].mlp._module
    x = saved[(0, "mlp_input")]
    with torch.no_grad():
        activation = torch.relu(x @ mlp.up_proj.weight.T) ** 2
        output = activation @ mlp.down_proj.weight.T
    assert close(activation, saved[(0, "mlp_activation")]) and close(activation, saved[(0, "mlp_neurons")])
    assert close(output, saved[(0, "mlp_output")])


@pytest.mark.parametrize("layer", [1, 2])
def test_ergo_moe_output_is_the_normalised_routed_experts_plus_the_shared_expert(layer):
    model, saved = tiny(CASE), saved_for(CASE)
    config = model.config
    moe = model.layers[layer].mlp._module
    x = saved[(layer, "mlp_input")].reshape(N, -1)
    with torch.no_grad():
        scores = torch.sigmoid(x @ moe.gate.linear.weight.T)
        chosen = (scores + moe.gate.e_score_correction_bias).topk(config.num_experts_per_tok).indices
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * config.moe_routed_scaling_factor
        routed = torch.zeros_like(x)
        for token in range(N):
            for slot, expert in enumerate(chosen[token].tolist()):
                out = (torch.relu(x[token] @ moe.experts.up_proj[expert]) ** 2) @ moe.experts.down_proj[expert]
                out = rms(out, moe.experts.post_expert_norm.weight[expert], config.rms_norm_eps)
                routed[token] += weights[token, slot] * out
        shared = moe.shared_experts
        common = rms(shared.down_proj(torch.relu(shared.up_proj(x)) ** 2), shared.norm.weight, config.rms_norm_eps)
    assert close((routed + common).view(1, N, -1), saved[(layer, "mlp_output")])
    assert not close((routed / config.moe_routed_scaling_factor + common).view(1, N, -1), saved[(layer, "mlp_output")])


def test_ergo_residual_adds_are_the_gates_recomputed_by_hand(gated):
    saved = read_everything(gated, PROMPT)
    eps = gated.config.rms_norm_eps
    for layer, block in enumerate(gated._module.model.layers):
        v = {name: saved[(layer, name)] for name in ("layer_input", "attention_output", "layer_mid", "mlp_output")}
        with torch.no_grad():
            update = rms(v["attention_output"], block.post_attention_layernorm.weight, eps)
            mid = gate(block.attention_residual_gate.weight, update, v["layer_input"])
            wrong_gate = gate(block.feedforward_residual_gate.weight, update, v["layer_input"])
            after = rms(v["mlp_output"], block.post_feedforward_layernorm.weight, eps)
            out = gate(block.feedforward_residual_gate.weight, after, v["layer_mid"])
        assert close(mid, v["layer_mid"]) and close(out, saved[(layer, "layer_output")])
        assert not close(wrong_gate, v["layer_mid"]) and not close(v["layer_input"] + update, v["layer_mid"])
        assert failures(gated, saved, layer) == []
    plain = failures_with(gated, {"residual_add": lambda block, sublayer, stream, update, **_: stream + update}, 1)
    assert {"layer input + attention output == layer mid", "layer mid + mlp output == layer output"} <= set(plain)


def test_ergo_attention_output_edit_moves_the_logits_as_recomputed_by_hand(gated):
    last = gated.num_layers - 1
    layer = gated.layers[last]
    delta = torch.randn(1, N, gated.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), gated.trace(PROMPT):
        layer_input = layer.layer_input.save()
        original = layer.self_attn.attention_output.save()
        layer.self_attn.attention_output = original + delta
        logits = gated.logits.save()
    with torch.no_grad(), gated.trace(PROMPT):
        unedited = gated.logits.save()
    inner, block, eps = gated._module, layer._module, gated.config.rms_norm_eps
    with torch.no_grad():
        update = rms(original + delta, block.post_attention_layernorm.weight, eps)
        mid = gate(block.attention_residual_gate.weight, update, layer_input)
        mlp = block.mlp(rms(mid, block.pre_feedforward_layernorm.weight, eps))
        out = gate(block.feedforward_residual_gate.weight, rms(mlp, block.post_feedforward_layernorm.weight, eps), mid)
        by_hand = rms(out, inner.model.norm.weight, eps) @ inner.lm_head.weight.T
    assert close(logits, by_hand) and not close(logits, unedited)


def test_ergo_half_precision_keeps_the_residual_stream_in_float32(tmp_path):
    needs(CASE)
    import transformers

    attnlens.models.tiny_model(CASE).save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    model = attnlens.StandardizedTransformer(loaded, tokenizer=attnlens.models.char_tokenizer())
    names = ("layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "mlp_input", "layer_output")
    got = trace(
        model,
        lambda m: {
            **{name: getattr(m.layers[FULL], name) for name in names[:2]},
            "attention_queries": m.layers[FULL].self_attn.attention_queries,
            "attention_scores": m.layers[FULL].self_attn.attention_scores,
            "attention_probabilities": m.layers[FULL].self_attn.attention_probabilities,
            "attention_output": m.layers[FULL].self_attn.attention_output,
            **{name: getattr(m.layers[FULL], name) for name in names[2:]},
        },
    )
    in_float32 = {"layer_input", "attention_norm_output", "layer_mid", "mlp_norm_output", "layer_output"}
    in_float32.add("attention_scores")
    assert {name for name, value in got.items() if value.dtype == torch.float32} == in_float32
    assert {value.dtype for value in got.values()} == {torch.float32, torch.bfloat16}
    assert "float32 even in a model loaded in half precision" in model.support(FULL).notes["layer_input"]
    # the identities hold in bfloat16 too: the block norms each sublayer's output in float32 (Identities.post_norm)
    saved = read_everything(model, PROMPT)
    assert [failures(model, saved, layer) for layer in range(model.num_layers)] == [[]] * model.num_layers
