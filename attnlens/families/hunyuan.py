"""HunYuan dense (v1): the Llama layout with a per-head RMSNorm on queries and keys after the rotary embedding
(`query_layernorm`, `key_layernorm`), inside the attention before the attention function: queries and keys are read
after both.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from .llama import Llama
from .vllm_transformers import VLLMTransformersBackend


class HunYuanDense(VLLMTransformersBackend, Llama):
    model_types = ("hunyuan_v1_dense",)
    tiny = ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", {"head_dim": 16})
    vllm_model_types = ("hunyuan_v1_dense",)  # vLLM's Transformers backend (tests_vllm)
    vllm_fused_activation = True  # the GLU's gate and up projections fused with the activation (gate_up_proj)

    def notes(self, config, layer, engine="eager"):
        return {**super().notes(config, layer, engine),
                "attention_queries": "after the rotary embedding and query_layernorm (RMSNorm per head)",
                "attention_keys": "after the rotary embedding and key_layernorm (RMSNorm per head)"}
