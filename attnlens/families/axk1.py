"""A.X-K1: DeepSeek-V3 with a norm on the MoE block's output (`mlp.post_mlp_layernorm`), inside the MLP module, so
`mlp_output` on MoE layers is that norm's output: the routed experts plus the shared expert, normalised.

vLLM's A.X-K1 (model_executor/models/AXK1.py) runs DeepSeek-V2's latent attention (the kernel at
`self_attn.mla_attn.mla_attn`, `attnlens/vllm/mla.py`) but applies that norm in the block, after the MLP module
returns: on vLLM a MoE layer's `mlp_output` is unavailable (`POST_MLP_NORM`).
"""

from dataclasses import replace

from .deepseek_v3 import DeepseekV3

#: Why a MoE layer's mlp_output is not served on vLLM.
POST_MLP_NORM = (
    "vLLM's A.X-K1 applies post_mlp_layernorm in the block, after the MLP module returns (on eager it is "
    "inside the MLP), so no output of the MLP module is the normalised sum; layer_output - layer_mid "
    "is it"
)


class AXK1(DeepseekV3):
    model_types = ("axk1",)
    tiny = ("AXK1Config", "AXK1ForCausalLM", DeepseekV3.tiny[2])
    tiny_layouts = {}  # the score scale under yarn is DeepSeek-V3's, tested there
    vllm = replace(
        DeepseekV3.vllm,
        model_types=("axk1",),
        tiny={**DeepseekV3.vllm.tiny, "first_k_dense_replace": 0},
        unavailable={**DeepseekV3.vllm.unavailable, "mlp_output": POST_MLP_NORM},
    )
    # vLLM builds post_mlp_layernorm on every block, as the released checkpoints store it, and transformers only in MoE
    # blocks: a tiny checkpoint of MoE blocks alone has every norm vLLM loads

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "moe" in kind and engine == "vllm":
            locations.pop("mlp_output")
        return locations

    kind_notes = {
        "moe": {"mlp_output": "mlp.post_mlp_layernorm(routed experts + shared expert): the MoE block's own norm"},
    }
