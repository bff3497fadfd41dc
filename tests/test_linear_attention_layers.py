"""Hybrids' linear-attention layers and the sigmoid output gate (Qwen3-Next, Qwen3.5, Qwen3.5-MoE; Kimi Linear and
Bailing's reasons).

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import re
import sys

import pytest
import torch
from conftest import PROMPT, needs, tiny
from identities import close, merged, saved_for

import attnlens


@pytest.mark.parametrize(("case", "linear"), [("kimi_linear", 0), ("bailing_hybrid", 2)])
def test_hybrid_linear_layers_say_why(case, linear):
    needs(case)
    model = tiny(case)
    report = model.support(linear)
    for name in ("attention_queries", "attention_probabilities", "attention_head_outputs"):
        assert "Kimi Delta Attention" in report[f"self_attn.{name}"]
    assert report["self_attn.attention_premix"] is None and report["self_attn.attention_output"] is None
    assert model.support(1)["self_attn.attention_probabilities"] is None


#: case -> (its full-attention layer, a linear-attention layer, the label its reasons use)
CASES = {
    "qwen3_next": (1, 0, "Qwen3-Next"),
    "qwen3_5_text": (2, 1, "Qwen3.5"),
    "qwen3_5_moe_text": (1, 2, "Qwen3.5-MoE"),
}


@pytest.mark.parametrize("case", CASES)
def test_gate_is_the_sigmoid_of_the_gate_half_of_q_proj(case):
    model, (full, _, _) = tiny(case), CASES[case]
    saved = saved_for(case)
    attn = model.layers[full].self_attn
    module = attn._module
    h, d = attn.num_heads, attn.head_dim
    with torch.no_grad():
        projected = module.q_proj(saved[(full, "attention_norm_output")])
        gate_half = projected.view(*projected.shape[:2], h, 2 * d)[..., d:]
        gate = saved[(full, "attention_gate")]
        assert gate.shape == (1, len(PROMPT), h, d)
        assert close(gate, torch.sigmoid(gate_half))
        heads, premix = saved[(full, "attention_head_outputs")], saved[(full, "attention_premix")]
        # The head outputs are the mix before the gate: the gate binds, and times the gate they are the premix.
        assert not close(merged(heads), premix, atol=1e-2)
        assert close(merged(heads * gate), premix)


@pytest.mark.parametrize("case", CASES)
def test_queries_and_keys_are_qk_normed_then_partially_rotated(case):
    model, (full, _, _) = tiny(case), CASES[case]
    saved = saved_for(case)
    attn = model.layers[full].self_attn
    module = attn._module
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.qk_head_dim) == (4, 2, 16, 16)
    assert attn.scale == 16**-0.5
    with torch.no_grad():
        x = saved[(full, "attention_norm_output")]
        b, s = x.shape[:2]
        normed = module.q_norm(module.q_proj(x).view(b, s, 4, 32)[..., :16]).transpose(1, 2)
        k = module.k_norm(module.k_proj(x).view(b, s, 2, 16)).transpose(1, 2)
        positions = torch.arange(s)[None]
        if case != "qwen3_next":  # Qwen3.5's rotary embedding takes (temporal, height, width) positions
            positions = positions[None].expand(3, b, s)
        cos, sin = model._module.model.rotary_emb(x, positions)
        q, k = sys.modules[type(module).__module__].apply_rotary_pos_emb(normed, k, cos, sin)
    queries, keys = saved[(full, "attention_queries")], saved[(full, "attention_keys")]
    assert close(queries, q) and close(keys, k)
    # Partial: the rotary embedding turns the first quarter of each head; the rest is q_norm's output untouched.
    assert cos.shape[-1] == 4
    assert torch.equal(queries[..., 4:], normed[..., 4:]) and not close(queries[..., :4], normed[..., :4])
    assert "first 4 of 16 dims" in model.support(full).notes["self_attn.attention_queries"]


@pytest.mark.parametrize("case", CASES)
def test_editing_the_gate_moves_the_logits_as_the_premix_predicts(case):
    """Zeroing head 2's gate in place must act exactly like zeroing head 2's slice of the premix; assigning a gate of
    ones must act like a premix of the ungated head outputs."""
    model, (full, _, _) = tiny(case), CASES[case]
    attn = model.layers[full].self_attn
    with torch.no_grad():
        with model.trace(PROMPT):
            clean = model.logits.save()
        with model.trace(PROMPT):
            heads = attn.attention_head_outputs.save()
            gate = attn.attention_gate
            gate[:, :, 2] = 0  # in place, on the per-head view of the forward's own sigmoid output
            edited_gate = attn.attention_gate.save()
            premix = attn.attention_premix.save()
            by_gate = model.logits.save()
        with model.trace(PROMPT):
            p = attn.attention_premix
            p[:, :, 32:48] = 0
            by_premix = model.logits.save()
        with model.trace(PROMPT):
            ungated = attn.attention_head_outputs.save()
            attn.attention_gate = torch.ones_like(attn.attention_gate)
            ones_premix = attn.attention_premix.save()
            by_ones = model.logits.save()
        with model.trace(PROMPT):
            attn.attention_premix = merged(attn.attention_head_outputs)
            by_merged = model.logits.save()
    assert (edited_gate[:, :, 2] == 0).all() and (premix[:, :, 32:48] == 0).all()
    assert close(premix, merged(heads * edited_gate))
    assert not close(by_gate, clean, atol=1e-3)
    assert close(by_gate, by_premix)
    assert close(ones_premix, merged(ungated))
    assert not close(by_ones, clean, atol=1e-3)
    assert close(by_ones, by_merged)


@pytest.mark.parametrize("case", CASES)
def test_linear_layers_report_what_they_lack_and_why(case):
    model, (full, linear, label) = tiny(case), CASES[case]
    report = model.support(linear)
    kind = f"layer {linear} of {label} is a Gated DeltaNet linear-attention layer (linear_attn)"
    for name in (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_scores",
        "attention_probabilities",
        "attention_sinks",
        "attention_head_outputs",
        "attention_gate",
    ):
        assert report[f"self_attn.{name}"].startswith(kind), name
        assert "forms no query-key softmax pattern" in report[f"self_attn.{name}"]
    assert "silu(z)" in report["self_attn.attention_gate"]
    assert "no per-head mix of values" in report["self_attn.attention_head_outputs"]
    for key in (
        "self_attn.attention_premix",
        "self_attn.attention_output",
        "layer_input",
        "layer_mid",
        "layer_output",
        "mlp_input",
        "mlp.mlp_output",
    ):
        assert report[key] is None, key
    assert model.support(full)["self_attn.attention_gate"] is None
    with pytest.raises(
        attnlens.Unavailable,
        match=re.escape(f"layers[{linear}].self_attn.attention_probabilities on {model.family.name}: {kind}"),
    ):
        with model.trace(PROMPT):
            model.layers[linear].self_attn.attention_probabilities.save()


@pytest.mark.parametrize("case", CASES)
def test_linear_layers_serve_their_output_and_premix(case):
    model, (_, linear, _) = tiny(case), CASES[case]
    saved = saved_for(case)
    attn = model.layers[linear].self_attn
    module = attn._module
    assert type(module).__name__.endswith("GatedDeltaNet")  # linear_attn, reached as self_attn
    assert (attn.num_heads, attn.head_dim) == (4, 16)  # the linear value heads the premix merges
    with torch.no_grad():
        out = module(saved[(linear, "attention_norm_output")])
    assert close(saved[(linear, "attention_output")], out)
    assert close(module.out_proj(saved[(linear, "attention_premix")]), out)
    assert saved[(linear, "attention_premix")].shape == (1, len(PROMPT), attn.num_heads * attn.head_dim)


def test_mixture_of_experts_layers_have_no_single_activation():
    reason = "sparse mixture-of-experts MLP"
    nxt, q35, q35moe = tiny("qwen3_next"), tiny("qwen3_5_text"), tiny("qwen3_5_moe_text")
    assert nxt.support(0)["mlp.mlp_activation"] is None  # mlp_only_layers=[0]: a dense MLP
    for layer in (1, 2):
        assert reason in nxt.support(layer)["mlp.mlp_activation"]
        assert reason in nxt.support(layer)["mlp.mlp_neurons"]
    assert all(q35.support(layer)["mlp.mlp_neurons"] is None for layer in range(3))
    assert all(reason in q35moe.support(layer)["mlp.mlp_neurons"] for layer in range(3))
    assert f"layer 1 of Qwen3.5-MoE has a {reason}" in q35moe.support(1)["mlp.mlp_activation"]


FULL_ORDER = [
    "layer_input",
    "attention_norm_output",
    "self_attn.attention_cache_keys",
    "self_attn.attention_cache_values",
    "self_attn.attention_cache_visible",
    "self_attn.attention_queries",
    "self_attn.attention_keys",
    "self_attn.attention_key_positions",
    "self_attn.attention_values",
    "self_attn.attention_scores",
    "self_attn.attention_probabilities",
    "self_attn.attention_head_outputs",
    "self_attn.attention_gate",
    "self_attn.attention_premix",
    "self_attn.attention_output",
    "layer_mid",
    "mlp_norm_output",
    "mlp_input",
    "mlp.mlp_activation",
    "mlp.mlp_neurons",
    "mlp.mlp_output",
    "layer_output",
]


LINEAR_ORDER = [
    "layer_input",
    "attention_norm_output",
    "self_attn.attention_premix",
    "self_attn.attention_output",
    "layer_mid",
    "mlp_norm_output",
    "mlp_input",
    "mlp.mlp_activation",
    "mlp.mlp_neurons",
    "mlp.mlp_output",
    "layer_output",
]


def test_order_on_both_kinds_of_layer():
    q35, nxt = tiny("qwen3_5_text"), tiny("qwen3_next")
    assert list(q35.order(2)) == FULL_ORDER
    assert q35.order(2)["self_attn.attention_queries"] == q35.order(2)["self_attn.attention_values"]
    assert (
        q35.order(2)["self_attn.attention_head_outputs"]
        < q35.order(2)["self_attn.attention_gate"]
        < q35.order(2)["self_attn.attention_premix"]
    )
    assert list(q35.order(0)) == LINEAR_ORDER
    moe = ("mlp.mlp_activation", "mlp.mlp_neurons")
    assert list(nxt.order(1)) == [key for key in FULL_ORDER if key not in moe]
    assert list(nxt.order(0)) == LINEAR_ORDER
    assert list(nxt.order(2)) == [key for key in LINEAR_ORDER if key not in moe]
