"""Cohere 2 MoE (Command A): Cohere's parallel block with sliding and full layers, rotary embedding only where the
window slides, and mixture-of-experts MLPs after a dense prefix.

As in Cohere, attention and the MLP read one `input_layernorm` output and join the block input in one sum, so
`layer_mid` is unavailable; `logits` are the LM head's output times `logit_scale`. Sliding layers
(`config.layer_types`) mask to `sliding_window` keys and rotate queries and keys; full layers rotate nothing (no
positional encoding at all), except the dense prefix layers when `prefix_dense_sliding_window_pattern == 1`. Layers
whose `config.mlp_layer_types` entry is not `"dense"` route tokens to experts (each applying its gated activation to
its own tokens), plus shared experts averaged or summed in, so no activation or neuron tensor exists there.

vLLM's own Cohere2-MoE (cohere2_moe.py) has Cohere 2's layout on vLLM: the parallel block, the same rule for which
layers rotate, and a sliding layer's kernel sees `sliding_window + 1` keys (as Cohere 2's there; checked against each
kernel at load).
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .cohere import Cohere
from .cohere2 import vllm_window, vllm_window_note


class Cohere2Moe(SparseMoE, Cohere):
    model_types = ("cohere2_moe",)
    tiny = Tiny(
        "Cohere2MoeConfig",
        "Cohere2MoeForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "num_shared_experts": 1,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "mlp_layer_types": ["dense", "sparse", "sparse"],
            "prefix_dense_intermediate_size": 128,
        },
    )
    # The tiny checkpoint's window (64) is longer than the test's context: its sliding layers rotate and slide on
    # both engines, yet vLLM's wider window (sliding_window + 1, tests_vllm/test_windows.py on Cohere 2) never bites.
    vllm = replace(
        Cohere.vllm,
        model_types=("cohere2_moe",),  # tests_vllm
        tiny={"head_dim": 32, "sliding_window": 64},
        window=vllm_window,
    )
    absent = {
        **Cohere.absent,
        **moe_absent(
            "Cohere2MoeExperts",
            extra=", with the shared experts' output summed or averaged in (shared_expert_combination_strategy)",
        ),
    }

    def moe_layer(self, config, layer):
        return config.mlp_layer_types[layer] != "dense"

    @staticmethod
    def rotary(config, layer) -> bool:
        return config.layer_types[layer] == "sliding_attention" or (
            config.mlp_layer_types[layer] == "dense" and config.prefix_dense_sliding_window_pattern == 1
        )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.rotary(config, layer):
            notes["attention_queries"] = notes["attention_keys"] = "rotated (interleaved pairs)"
        else:
            notes["attention_queries"] = notes["attention_keys"] = (
                "not rotated: this full-attention layer has no positional encoding"
            )
        window = self.score_function(engine).window(config, layer)
        if engine == "vllm" and window is not None:
            notes["attention_probabilities"] = vllm_window_note(window)
        return notes
