"""HunYuan MoE (v1): HunYuan dense's attention (a per-head RMSNorm on queries and keys after the rotary embedding) with
a sparse mixture of experts plus a dense shared MLP (`mlp.shared_mlp`) as every MLP, so no activation or neuron tensor
exists.

vLLM runs it through its Transformers backend (`TransformersMoEForCausalLM`: transformers' own modules, vLLM's
kernel as the attention function and its fused MoE as the experts).
"""

from ..family import Tiny
from ..parts.mirrored import transformers_backend
from ..parts.moe import SparseMoE, moe_absent
from .hunyuan import HunYuanDense


class HunYuanMoE(SparseMoE, HunYuanDense):
    model_types = ("hunyuan_v1_moe",)
    tiny = Tiny("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM", {"head_dim": 16, "num_experts": 4, "moe_topk": 2})
    absent = moe_absent(
        "HunYuanMoEV1Experts", extra=", plus the shared MLP (mlp.shared_mlp, a dense MLP reading the same input)"
    )
    # vLLM's Transformers backend (tests_vllm); every layer is a MoE layer, so no activation is served there
    vllm = transformers_backend(("hunyuan_v1_moe",), fused_activation=True)
