"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE: the sigmoid output gate and the linear-attention layers of a hybrid.

What the shared identities can't see: that the gate is the sigmoid of q_proj's gate half (recomputed from the weights)
and that editing it moves the logits as the premix predicts; the queries' QK-norm and partial rotary embedding; what
the Gated DeltaNet layers serve and the precise reasons for what they don't; the order on both kinds of layer; that
the load-time check visits both kinds; sdpa; and loading a full Qwen3.5 checkpoint ("qwen3_5").
"""

import re
import sys

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for

import attnlens
from attnlens.families.qwen3_next import Qwen3Next
from attnlens.locations import Operation
from attnlens.models import char_tokenizer, tiny_model

#: case -> (its full-attention layer, a linear-attention layer, the label its reasons use)
CASES = {
    "qwen3_next": (1, 0, "Qwen3-Next"),
    "qwen3_5_text": (2, 1, "Qwen3.5"),
    "qwen3_5_moe_text": (1, 2, "Qwen3.5-MoE"),
}

def merged(heads):
    return heads.reshape(*heads.shape[:2], -1)


# --- the gate ----------------------------------------------------------------------------------------------------

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
    assert attn.scale == 16 ** -0.5
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


# --- the linear-attention layers ---------------------------------------------------------------------------------

@pytest.mark.parametrize("case", CASES)
def test_linear_layers_report_what_they_lack_and_why(case):
    model, (full, linear, label) = tiny(case), CASES[case]
    report = model.support(linear)
    kind = f"layer {linear} of {label} is a Gated DeltaNet linear-attention layer (linear_attn)"
    for name in ("attention_queries", "attention_keys", "attention_values", "attention_scores",
                 "attention_probabilities", "attention_sinks", "attention_head_outputs", "attention_gate"):
        assert report[f"self_attn.{name}"].startswith(kind), name
        assert "forms no query-key softmax pattern" in report[f"self_attn.{name}"]
    assert "silu(z)" in report["self_attn.attention_gate"]
    assert "no per-head mix of values" in report["self_attn.attention_head_outputs"]
    for key in ("self_attn.attention_premix", "self_attn.attention_output", "layer_input", "layer_mid",
                "layer_output", "mlp_input", "mlp.mlp_output"):
        assert report[key] is None, key
    assert model.support(full)["self_attn.attention_gate"] is None
    with pytest.raises(attnlens.Unavailable, match=re.escape(f"layers[{linear}].self_attn.attention_probabilities on "
                                                             f"{model.family.name}: {kind}")):
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


# --- order ---------------------------------------------------------------------------------------------------------

FULL_ORDER = ["layer_input", "attention_norm_output", "self_attn.attention_queries", "self_attn.attention_keys",
              "self_attn.attention_key_positions", "self_attn.attention_values", "self_attn.attention_scores",
              "self_attn.attention_probabilities", "self_attn.attention_head_outputs", "self_attn.attention_gate",
              "self_attn.attention_premix", "self_attn.attention_output", "layer_mid", "mlp_norm_output", "mlp_input",
              "mlp.mlp_activation", "mlp.mlp_neurons", "mlp.mlp_output", "layer_output"]
LINEAR_ORDER = ["layer_input", "attention_norm_output", "self_attn.attention_premix", "self_attn.attention_output",
                "layer_mid", "mlp_norm_output", "mlp_input", "mlp.mlp_activation", "mlp.mlp_neurons",
                "mlp.mlp_output", "layer_output"]


def test_order_on_both_kinds_of_layer():
    q35, nxt = tiny("qwen3_5_text"), tiny("qwen3_next")
    assert list(q35.order(2)) == FULL_ORDER
    assert q35.order(2)["self_attn.attention_queries"] == q35.order(2)["self_attn.attention_values"]
    assert q35.order(2)["self_attn.attention_head_outputs"] < q35.order(2)["self_attn.attention_gate"] \
        < q35.order(2)["self_attn.attention_premix"]
    assert list(q35.order(0)) == LINEAR_ORDER
    moe = ("mlp.mlp_activation", "mlp.mlp_neurons")
    assert list(nxt.order(1)) == [key for key in FULL_ORDER if key not in moe]
    assert list(nxt.order(0)) == LINEAR_ORDER
    assert list(nxt.order(2)) == [key for key in LINEAR_ORDER if key not in moe]


def test_out_of_order_reads_raise_on_both_kinds_of_layer():
    model = tiny("qwen3_next")
    with pytest.raises(attnlens.OrderError, match=r"layers\[1\].self_attn.attention_head_outputs was read after "
                                                  r"layers\[1\].self_attn.attention_gate"):
        with model.trace(PROMPT):
            model.layers[1].self_attn.attention_gate.save()
            model.layers[1].self_attn.attention_head_outputs.save()
    with pytest.raises(attnlens.OrderError, match=r"layers\[0\].self_attn.attention_premix was read after "
                                                  r"layers\[0\].self_attn.attention_output"):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_output.save()
            model.layers[0].self_attn.attention_premix.save()


# --- the load-time check visits both kinds of layer ----------------------------------------------------------------

class _DriftOn(Qwen3Next):
    """Qwen3-Next with one operation recorded wrongly, on linear layers or on full-attention layers only."""

    def __init__(self, linear: bool):
        self.drift_linear = linear

    def locations_for(self, config, layer, engine="transformers"):
        locations = super().locations_for(config, layer, engine)
        if layer is None or self.is_mixer_layer(config, layer) != self.drift_linear:
            return locations
        name = "attention_premix" if self.drift_linear else "attention_head_outputs"
        return {**locations, name: Operation(("attention_interface_1",), "output", 0, anchor="no such text")
                if not self.drift_linear else Operation(("no_such_operation_0",))}


@pytest.mark.parametrize("linear", [True, False], ids=["linear layers", "full layers"])
def test_location_drift_is_caught_on_either_kind_of_layer(linear):
    with pytest.raises(attnlens.LocationDrift) as error:
        attnlens.StandardizedTransformer(tiny_model("qwen3_next"), tokenizer=char_tokenizer(), family=_DriftOn(linear))
    message = str(error.value)
    if linear:
        assert "value attention_premix" in message and "Qwen3NextGatedDeltaNet.forward" in message
    else:
        assert "value attention_head_outputs" in message and "Qwen3NextAttention.forward" in message
        assert "'no such text'" in message


def test_the_gate_location_is_checked_at_load():
    family = Qwen3Next()
    family.gate_operation = ("torch_sigmoid_0", "torch.tanh(gate)")
    with pytest.raises(attnlens.LocationDrift, match=r"value attention_gate: expected operation 'torch_sigmoid_0' on a "
                                                     r"line containing 'torch.tanh\(gate\)'.*torch.sigmoid\(gate\)"):
        attnlens.StandardizedTransformer(tiny_model("qwen3_next"), tokenizer=char_tokenizer(), family=family)


# --- sdpa, and a full Qwen3.5 checkpoint ---------------------------------------------------------------------------

def test_sdpa_serves_the_same_values_except_the_pattern():
    eager, sdpa = tiny("qwen3_next"), tiny("qwen3_next", attn_implementation="sdpa")
    full, linear = 1, 0
    report = sdpa.support(full)
    assert "attn_implementation='eager'" in report["self_attn.attention_probabilities"]
    assert report["self_attn.attention_gate"] is None
    assert "linear-attention layer" in sdpa.support(linear)["self_attn.attention_probabilities"]
    got = {}
    for name, model in (("eager", eager), ("sdpa", sdpa)):
        with torch.no_grad(), model.trace(PROMPT):
            attn = model.layers[full].self_attn
            got[name] = [attn.attention_queries.save(), attn.attention_head_outputs.save(),
                         attn.attention_gate.save(), attn.attention_premix.save(),
                         model.layers[2].self_attn.attention_premix.save(), model.logits.save()]
    for a, b in zip(got["eager"], got["sdpa"]):
        assert close(a, b, atol=1e-4)  # sdpa's float error, grown through a later linear layer


def test_a_full_qwen3_5_checkpoint_loads_as_the_text_model(tmp_path):
    """A "qwen3_5" checkpoint (text and vision configs) loads through AutoModelForCausalLM as the text model."""
    from transformers import Qwen3_5Config

    text = tiny_model("qwen3_5_text")
    text.save_pretrained(tmp_path)
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64)
    Qwen3_5Config(text_config=text.config.to_dict(), vision_config=vision).save_pretrained(tmp_path)
    model = attnlens.StandardizedTransformer(str(tmp_path), tokenizer=char_tokenizer(), attn_implementation="eager")
    assert model.family.name == "Qwen3_5" and model.config.model_type == "qwen3_5_text"
    with torch.no_grad(), model.trace(PROMPT):
        gate = model.layers[2].self_attn.attention_gate.save()
        logits = model.logits.save()
    assert gate.shape == (1, len(PROMPT), 4, 16)
    assert close(logits, saved_for("qwen3_5_text")["logits"])


def test_generate_serves_both_kinds_of_layer_per_step():
    """Decode steps run the linear layers' recurrent step and the full layers against the cache."""
    model = tiny("qwen3_next")
    linear, full = model.layers[0].self_attn, model.layers[1].self_attn
    with torch.no_grad(), model.generate("Hello world", max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        shapes = list().save()
        for _ in tracer.iter[:3]:
            premix = linear.attention_premix
            shapes.append((tuple(premix.shape), tuple(full.attention_probabilities.shape),
                           tuple(full.attention_gate.shape)))
    assert shapes == [((1, 11, 64), (1, 4, 11, 11), (1, 11, 4, 16)),
                      ((1, 1, 64), (1, 4, 1, 12), (1, 1, 4, 16)),
                      ((1, 1, 64), (1, 4, 1, 13), (1, 1, 4, 16))]


def test_on_vllm_head_outputs_are_the_kernels_before_the_gate_and_gated_deltanet_serves_its_premix():
    model = tiny("qwen3_next")
    family = model.family
    assert "attention_head_outputs" not in family.unavailable(model.config, 1, "vllm")
    assert "attention_premix" not in family.unavailable(model.config, 0, "vllm")
    assert "mixture-of-experts" in family.unavailable(model.config, 2, "vllm")["mlp_activation"]  # the family's own
