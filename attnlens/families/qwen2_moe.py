"""Qwen2-MoE: Qwen2's attention (biased q/k/v, sliding windows where `layer_types` says) with a sparse MoE MLP that
adds a sigmoid-gated shared expert.

On MoE layers `mlp_activation` and `mlp_neurons` are unavailable (the routed experts form them per expert, inside
`mlp.experts`; the shared expert is a dense MLP of its own, `mlp.shared_expert`), and `mlp_output` is the block's
combined output: the routed experts' weighted sum plus `sigmoid(shared_expert_gate(x)) * shared_expert(x)`. Layers in
`config.mlp_only_layers`, or off the `decoder_sparse_step`, keep a dense gated MLP and serve every MLP value.

vLLM's Qwen2-MoE passes no per-layer window to its kernels, and vLLM sets a model-wide one only when every layer
slides: where `layer_types` mixes sliding and full layers (what `use_sliding_window` gives), every layer attends to
the whole context on vLLM. attnlens serves what vLLM computes there, and `support()` on vLLM says so. On a tiny
model that mixes them, vLLM's first-step log-probabilities are up to 10.3 apart from transformers' (its greedy tokens
differ from the first), and within 1.1e-5 of transformers' run without the window.
"""

from dataclasses import replace

from ..family import Tiny
from ..parts.moe import SparseMoE, moe_absent
from .qwen2 import Qwen2


def _qwen2moe_vllm_window(family, config, layer):
    return None if family.mixed_windows(config) else family.score_function().sliding_window(config, layer)


class Qwen2Moe(SparseMoE, Qwen2):
    model_types = ("qwen2_moe",)
    # Layer 1 keeps a dense MLP, so both kinds of layer are tested; layer 0 slides over 4 keys.
    tiny = Tiny(
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [1],
            "use_sliding_window": True,
            "sliding_window": 4,
            "max_window_layers": 1,
        },
    )
    absent = moe_absent(
        "Qwen2MoeExperts",
        ", plus the sigmoid-gated shared expert (mlp.shared_expert, a dense MLP reading the same input)",
    )
    vllm = replace(
        Qwen2.vllm,
        model_types=("qwen2_moe",),
        window=_qwen2moe_vllm_window,
        tiny={**Qwen2.vllm.tiny, "layer_types": ["sliding_attention"] * 3},  # every layer slides on both engines
    )

    def moe_layer(self, config, layer):
        # Qwen2MoeDecoderLayer's own rule for building a sparse block.
        return (
            layer not in config.mlp_only_layers
            and config.num_experts > 0
            and (layer + 1) % config.decoder_sparse_step == 0
        )

    @staticmethod
    def mixed_windows(config):
        return len(set(getattr(config, "layer_types", None) or ())) > 1

    kind_notes = {
        "vllm": {
            "attention_probabilities": lambda family, config, layer: (
                f"full attention on vLLM, where transformers slides over the last {window} keys: vLLM's Qwen2-MoE "
                f"passes no per-layer window and slides only when every layer does"
                if (window := family.score_function().sliding_window(config, layer)) is not None
                and family.mixed_windows(config)
                else None
            ),
        }
    }
