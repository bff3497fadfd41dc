"""Mixtral, Qwen2-MoE, Qwen3-MoE, OLMo, OLMo 2, Starcoder2, Granite and GLM-4: what the shared identities can't see.

Each test recomputes a value from the model's own weights (never from the location under test) or pins a reason, an
order or a note the family states.
"""

import sys

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, failures, saved_for

import attnlens

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmo", "olmo:noclip", "olmo2", "starcoder2", "granite", "glm4")
#: MoE family -> (a sparse MoE layer, a dense layer or None).
MOE = {"mixtral": (1, None), "qwen2_moe": (0, 1), "qwen3_moe": (1, 0)}

def ids(model):
    return model.tokenizer(PROMPT, return_tensors="pt").input_ids


def rope(model, layer, q, k):
    """The family's own rotary embedding (transformers' function and cos/sin), applied to [b, h, s, d] q and k."""
    module = model.layers[layer].self_attn._module
    positions = torch.arange(q.shape[2])[None]
    cos, sin = model._module.model.rotary_emb(q, positions)
    return sys.modules[type(module).__module__].apply_rotary_pos_emb(q, k, cos, sin)


def heads(x, head_dim):
    """[b, s, n * d] -> [b, n, s, d]."""
    return x.view(*x.shape[:2], -1, head_dim).transpose(1, 2)


# --- sparse mixtures of experts ------------------------------------------------------------------------------------

def moe_by_hand(block, x):
    """The MoE block's output from its weights: top-k routing over every expert, plus any gated shared expert."""
    flat = x.reshape(-1, x.shape[-1])
    probs = torch.softmax((flat @ block.gate.weight.T).float(), dim=-1)
    top, chosen = probs.topk(block.gate.top_k, dim=-1)
    if getattr(block.gate, "norm_topk_prob", True):  # Mixtral always renormalises
        top = top / top.sum(-1, keepdim=True)
    experts = block.experts
    gate, up = torch.einsum("th,eih->eti", flat, experts.gate_up_proj).chunk(2, dim=-1)
    every = torch.einsum("eti,ehi->eth", experts.act_fn(gate) * up, experts.down_proj)  # [experts, tokens, hidden]
    tokens = torch.arange(flat.shape[0])[:, None]
    out = (every[chosen, tokens] * top[..., None]).sum(1)
    if hasattr(block, "shared_expert"):
        out = out + torch.sigmoid(block.shared_expert_gate(flat)) * block.shared_expert(flat)
    return out.view_as(x)


@pytest.mark.parametrize("case", list(MOE))
def test_moe_output_is_the_routed_experts_combined(case):
    model = tiny(case)
    layer, _ = MOE[case]
    saved = saved_for(case)
    block = model.layers[layer]._module.mlp
    out = saved[(layer, "mlp_output")]
    assert out.shape == saved[(layer, "mlp_input")].shape  # a tensor: no router logits ride along
    with torch.no_grad():
        assert close(moe_by_hand(block, saved[(layer, "mlp_input")]), out)


@pytest.mark.parametrize("case", list(MOE))
def test_moe_activations_are_unavailable_with_where_they_live(case):
    model = tiny(case)
    layer, dense = MOE[case]
    experts_class = type(model.layers[layer]._module.mlp.experts).__name__
    for key in ("mlp.mlp_activation", "mlp.mlp_neurons"):
        reason = model.support(layer)[key]
        assert "sparse mixture of experts" in reason and f"mlp.experts ({experts_class}.forward" in reason
    assert "mlp.mlp_activation" not in model.order(layer)
    with pytest.raises(attnlens.Unavailable, match="sparse mixture of experts"):
        with model.trace(PROMPT):
            model.layers[layer].mlp.mlp_neurons.save()
    if dense is not None:  # a dense layer of the same model serves its activation
        assert model.support(dense)["mlp.mlp_activation"] is None
        assert (dense, "mlp_activation") in saved_for(case)
    if case == "qwen2_moe":
        assert "shared expert" in model.support(layer)["mlp.mlp_activation"]


@pytest.mark.parametrize("case", list(MOE))
def test_ablating_the_moe_output_leaves_the_residual(case):
    model = tiny(case)
    layer, _ = MOE[case]
    with torch.no_grad(), model.trace(PROMPT):
        mid = model.layers[layer].layer_mid.save()
        model.layers[layer].mlp.mlp_output[:] = 0
        out = model.layers[layer].layer_output.save()
    assert torch.equal(mid, out)


def test_moe_out_of_order_read_raises():
    model = tiny("mixtral")
    with pytest.raises(attnlens.OrderError, match="mlp_input"):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].mlp_input.save()


# --- OLMo: clip_qkv --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["olmo", "olmo:noclip"])
def test_olmo_reads_queries_keys_values_after_the_clamp(case):
    model = tiny(case)
    clip = model.config.clip_qkv
    saved = saved_for(case)
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        raw = [heads(proj(x), d) for proj in (module.q_proj, module.k_proj, module.v_proj)]
    clipped = [t.clamp(-clip, clip) for t in raw] if clip is not None else raw
    q, k = rope(model, 1, clipped[0], clipped[1])
    assert close(q, saved[(1, "attention_queries")]) and close(k, saved[(1, "attention_keys")])
    assert torch.equal(clipped[2], saved[(1, "attention_values")])
    unclipped = max(t.abs().max() for t in raw)
    assert unclipped > 1.5  # the projections reach past the tiny clip of 1, so the clip binds when set
    if clip is not None:
        values = saved[(1, "attention_values")]
        assert values.abs().max() == clip and (values.abs() == clip).float().mean() > 0.1
        assert not close(rope(model, 1, raw[0], raw[1])[0], saved[(1, "attention_queries")])
        assert "clamped in place" in model.support(1).notes["self_attn.attention_values"]


def test_olmo_value_edits_land_after_the_clamp():
    model = tiny("olmo")
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(PROMPT):
        attn.attention_values = attn.attention_values * 10
        values = attn.attention_values.save()
        probs = attn.attention_probabilities.save()
        out = attn.attention_head_outputs.save()
    assert values.abs().max() == 10 * model.config.clip_qkv  # not clamped again
    assert close((probs @ values.repeat_interleave(2, dim=1)).transpose(1, 2), out)


# --- OLMo 2: no pre-norms, QK-norm over the whole projection -----------------------------------------------------

def test_olmo2_order_and_missing_norms():
    model = tiny("olmo2")
    assert model.order(1) == {
        "layer_input": 0, "self_attn.attention_queries": 1, "self_attn.attention_keys": 1,
        "self_attn.attention_values": 1, "self_attn.attention_key_positions": 1, "self_attn.attention_scores": 2,
        "self_attn.attention_probabilities": 3, "self_attn.attention_head_outputs": 4, "self_attn.attention_premix": 5,
        "self_attn.attention_output": 6, "layer_mid": 7, "mlp_input": 7, "mlp.mlp_activation": 8,
        "mlp.mlp_neurons": 9, "mlp.mlp_output": 10, "layer_output": 11}
    report = model.support(1)
    assert report["attention_norm_output"].startswith("no norm in front of attention")
    assert report["mlp_norm_output"].startswith("no norm in front of the MLP")
    with pytest.raises(attnlens.Unavailable, match="no norm in front of the MLP"):
        with model.trace(PROMPT):
            model.layers[1].mlp_norm_output.save()
    with pytest.raises(attnlens.OrderError):
        with torch.no_grad(), model.trace(PROMPT):
            model.layers[1].mlp.mlp_output.save()
            model.layers[1].layer_mid.save()


def test_olmo2_layer_mid_is_the_mlp_input_after_the_post_norm():
    model = tiny("olmo2")
    saved = saved_for("olmo2")
    block = model.layers[1]._module
    mid = saved[(1, "layer_mid")]
    assert torch.equal(mid, saved[(1, "mlp_input")])
    with torch.no_grad():
        assert close(saved[(1, "layer_input")] + block.post_attention_layernorm(saved[(1, "attention_output")]), mid)
        assert not close(saved[(1, "layer_input")] + saved[(1, "attention_output")], mid)


def test_olmo2_qk_norm_spans_all_heads():
    model = tiny("olmo2")
    saved = saved_for("olmo2")
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "layer_input")]  # attention reads the residual stream itself
    with torch.no_grad():
        q, k = rope(model, 1, heads(module.q_norm(module.q_proj(x)), d), heads(module.k_norm(module.k_proj(x)), d))
        raw = heads(module.q_proj(x), d)  # a per-head RMSNorm, for contrast
        per_head = raw * torch.rsqrt(raw.pow(2).mean(-1, keepdim=True) + module.q_norm.variance_epsilon)
        per_head = per_head * module.q_norm.weight.view(-1, d)[None, :, None]
        per_head, _ = rope(model, 1, per_head, k)
    assert close(q, saved[(1, "attention_queries")]) and close(k, saved[(1, "attention_keys")])
    assert not close(per_head, saved[(1, "attention_queries")])


# --- Starcoder2: plain MLP, residual dropout ---------------------------------------------------------------------

def test_starcoder2_plain_mlp():
    model = tiny("starcoder2")
    saved = saved_for("starcoder2")
    mlp = model.layers[1]._module.mlp
    with torch.no_grad():
        assert close(mlp.act(mlp.c_fc(saved[(1, "mlp_input")])), saved[(1, "mlp_activation")])


def test_starcoder2_outputs_are_after_the_residual_dropout():
    model = tiny("starcoder2", residual_dropout=0.5)  # its own model: this test trains it
    p = model.config.residual_dropout
    model._module.train()
    try:
        with torch.no_grad(), model.trace(PROMPT):
            premix = model.layers[1].self_attn.attention_premix.save()
            out = model.layers[1].self_attn.attention_output.save()
    finally:
        model._module.eval()
    projected = model.layers[1]._module.self_attn.o_proj(premix).detach()
    dropped = out == 0
    assert 0.2 < dropped.float().mean() < 0.8  # dropout acted on the read value
    assert close(out[~dropped], projected[~dropped] / (1 - p))
    assert "residual dropout" in model.support(1).notes["self_attn.attention_output"]


# --- Granite: multipliers ----------------------------------------------------------------------------------------

def test_granite_scores_use_the_attention_multiplier():
    model = tiny("granite")
    saved = saved_for("granite")
    attn = model.layers[1].self_attn
    assert attn.scale == model.config.attention_multiplier != attn.head_dim ** -0.5
    q, k = saved[(1, "attention_queries")], saved[(1, "attention_keys")]
    by_hand = q @ k.repeat_interleave(2, dim=1).transpose(2, 3) * model.config.attention_multiplier
    length = q.shape[2]
    future = torch.ones(length, length, dtype=torch.bool).triu(1)
    by_hand = by_hand.masked_fill(future, torch.finfo(q.dtype).min)
    assert close(by_hand, saved[(1, "attention_scores")])


def test_granite_residual_embedding_and_logit_multipliers():
    model = tiny("granite")
    config = model.config
    saved = saved_for("granite")
    r = config.residual_multiplier
    for i in range(model.num_layers):
        assert close(saved[(i, "layer_input")] + r * saved[(i, "attention_output")], saved[(i, "layer_mid")])
        assert close(saved[(i, "layer_mid")] + r * saved[(i, "mlp_output")], saved[(i, "layer_output")])
        assert not close(saved[(i, "layer_input")] + saved[(i, "attention_output")], saved[(i, "layer_mid")])
    assert close(saved[(0, "layer_input")], saved["embeddings"] * config.embedding_multiplier)
    with torch.no_grad():
        head = model._module.lm_head(saved["final_norm_output"])
    assert close(saved["logits"], head / config.logits_scaling)
    notes = model.support(0).notes
    assert "residual_multiplier (0.5)" in notes["layer_mid"] and "logits_scaling (4)" in notes["logits"]
    assert "embedding_multiplier" in notes["embeddings"]


def test_granite_identities_need_the_residual_hook():
    """The shared identities use `Family.residual_add`; without Granite's multiplier they must fail."""
    model = tiny("granite")
    family = model.family
    family.residual_add = lambda block, sublayer, stream, update: stream + update
    try:
        bad = failures(model, saved_for("granite"), 1)
    finally:
        del family.residual_add
    assert "layer input + attention output == layer mid" in bad and "layer mid + mlp output == layer output" in bad
    assert failures(model, saved_for("granite"), 1) == []


# --- GLM-4: partial interleaved rotary, fused gate/up ------------------------------------------------------------

def test_glm4_partial_rotary_leaves_the_tail_unrotated():
    model = tiny("glm4")
    saved = saved_for("glm4")
    module = model.layers[1].self_attn._module
    d = module.head_dim
    x = saved[(1, "attention_norm_output")]
    with torch.no_grad():
        raw_q, raw_k = heads(module.q_proj(x), d), heads(module.k_proj(x), d)
    q = saved[(1, "attention_queries")]
    rotary = int(d * model.config.rope_parameters["partial_rotary_factor"])
    assert 0 < rotary < d
    assert torch.equal(q[..., rotary:], raw_q[..., rotary:])
    assert not close(q[..., :rotary], raw_q[..., :rotary])
    assert close(rope(model, 1, raw_q, raw_k)[0], q)


def test_glm4_fused_mlp_activation_and_neurons():
    model = tiny("glm4")
    saved = saved_for("glm4")
    mlp = model.layers[1]._module.mlp
    with torch.no_grad():
        gate, up = mlp.gate_up_proj(saved[(1, "mlp_input")]).chunk(2, dim=-1)
        assert close(mlp.activation_fn(gate), saved[(1, "mlp_activation")])
    assert close(up * saved[(1, "mlp_activation")], saved[(1, "mlp_neurons")])


# --- every family: sdpa ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", FAMILIES)
def test_sdpa_serves_all_but_scores_and_pattern(case):
    eager, sdpa = tiny(case), tiny(case, attn_implementation="sdpa")
    report = sdpa.support(1)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert "attn_implementation='eager'" in report[key]
    names = ("attention_queries", "attention_keys", "attention_values", "attention_head_outputs", "attention_premix",
             "attention_output")
    got = {}
    for label, model in (("eager", eager), ("sdpa", sdpa)):
        with torch.no_grad(), model.trace(PROMPT):
            attn = model.layers[1].self_attn
            got[label] = [getattr(attn, name).save() for name in names] + [model.layers[1].mlp.mlp_output.save()]
    for a, b in zip(got["eager"], got["sdpa"]):  # sdpa rounds differently: tolerance relative to the magnitudes
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max())
