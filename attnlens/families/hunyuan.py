"""HunYuan dense (v1): the Llama layout with a per-head RMSNorm on queries and keys after the rotary embedding
(`query_layernorm`, `key_layernorm`), inside the attention before the attention function: queries and keys are read
after both.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from ..parts.mirrored import transformers_backend
from .llama import Llama


class HunYuanDense(Llama):
    model_types = ("hunyuan_v1_dense",)
    tiny = ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16})
    # vLLM's Transformers backend (tests_vllm), the GLU's gate and up projections fused with the activation
    vllm = transformers_backend(("hunyuan_v1_dense",), fused_activation=True)

    def notes(self, config, layer, engine="transformers"):
        return {
            **super().notes(config, layer, engine),
            "attention_queries": "after the rotary embedding and query_layernorm (RMSNorm per head)",
            "attention_keys": "after the rotary embedding and key_layernorm (RMSNorm per head)",
        }
