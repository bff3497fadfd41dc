"""Qwen3Next (attnlens/families/qwen3_next.py): what the shared identities cannot see."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close

import attnlens
from attnlens.families.qwen3_next import Qwen3Next
from attnlens.locations import Operation
from attnlens.models import char_tokenizer, tiny_model


def test_out_of_order_reads_raise_on_both_kinds_of_layer():
    model = tiny("qwen3_next")
    with pytest.raises(
        attnlens.OrderError,
        match=r"layers\[1\].self_attn.attention_head_outputs was read after "
        r"layers\[1\].self_attn.attention_gate",
    ):
        with model.trace(PROMPT):
            model.layers[1].self_attn.attention_gate.save()
            model.layers[1].self_attn.attention_head_outputs.save()
    with pytest.raises(
        attnlens.OrderError,
        match=r"layers\[0\].self_attn.attention_premix was read after "
        r"layers\[0\].self_attn.attention_output",
    ):
        with model.trace(PROMPT):
            model.layers[0].self_attn.attention_output.save()
            model.layers[0].self_attn.attention_premix.save()


class _DriftOn(Qwen3Next):
    """Qwen3-Next with one operation recorded wrongly, on linear layers or on full-attention layers only."""

    def __init__(self, linear: bool):
        self.drift_linear = linear

    def locations_for(self, config, layer, engine="transformers"):
        locations = super().locations_for(config, layer, engine)
        if layer is None or self.is_mixer_layer(config, layer) != self.drift_linear:
            return locations
        name = "attention_premix" if self.drift_linear else "attention_head_outputs"
        return {
            **locations,
            name: Operation(("attention_interface_1",), "output", 0, anchor="no such text")
            if not self.drift_linear
            else Operation(("no_such_operation_0",)),
        }


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
    with pytest.raises(
        attnlens.LocationDrift,
        match=r"value attention_gate: expected operation 'torch_sigmoid_0' on a "
        r"line containing 'torch.tanh\(gate\)'.*torch.sigmoid\(gate\)",
    ):
        attnlens.StandardizedTransformer(tiny_model("qwen3_next"), tokenizer=char_tokenizer(), family=family)


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
            got[name] = [
                attn.attention_queries.save(),
                attn.attention_head_outputs.save(),
                attn.attention_gate.save(),
                attn.attention_premix.save(),
                model.layers[2].self_attn.attention_premix.save(),
                model.logits.save(),
            ]
    for a, b in zip(got["eager"], got["sdpa"]):
        assert close(a, b, atol=1e-4)  # sdpa's float error, grown through a later linear layer


def test_generate_serves_both_kinds_of_layer_per_step():
    """Decode steps run the linear layers' recurrent step and the full layers against the cache."""
    model = tiny("qwen3_next")
    linear, full = model.layers[0].self_attn, model.layers[1].self_attn
    with torch.no_grad(), model.generate("Hello world", max_new_tokens=3, do_sample=False, pad_token_id=0) as tracer:
        shapes = list().save()
        for _ in tracer.iter[:3]:
            premix = linear.attention_premix
            shapes.append(
                (tuple(premix.shape), tuple(full.attention_probabilities.shape), tuple(full.attention_gate.shape))
            )
    assert shapes == [
        ((1, 11, 64), (1, 4, 11, 11), (1, 11, 4, 16)),
        ((1, 1, 64), (1, 4, 1, 12), (1, 1, 4, 16)),
        ((1, 1, 64), (1, 4, 1, 13), (1, 1, 4, 16)),
    ]


def test_on_vllm_head_outputs_are_the_kernels_before_the_gate_and_gated_deltanet_serves_its_premix():
    model = tiny("qwen3_next")
    family = model.family
    assert "attention_head_outputs" not in family.unavailable(model.config, 1, "vllm")
    assert "attention_premix" not in family.unavailable(model.config, 0, "vllm")
    assert "mixture-of-experts" in family.unavailable(model.config, 2, "vllm")["mlp_activation"]  # the family's own
