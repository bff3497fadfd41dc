"""FlexOlmo: OLMo 2's block (norms after each sublayer, QK-norm over the whole projection) with a mixture of experts
as every MLP, so no activation or neuron tensor exists.

vLLM runs it through its Transformers backend (`TransformersMoEForCausalLM`: transformers' own modules, vLLM's
kernel as the attention function and its fused MoE as the experts), so OLMo 2's vLLM locations hold.
"""

from ..family import Tiny
from ..parts.mirrored import transformers_backend
from ..parts.moe import SparseMoE, moe_absent
from .olmo2 import Olmo2


class FlexOlmo(SparseMoE, Olmo2):
    model_types = ("flex_olmo",)
    tiny = Tiny("FlexOlmoConfig", "FlexOlmoForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2})
    absent = {**Olmo2.absent, **moe_absent("FlexOlmoExperts")}
    vllm = transformers_backend(("flex_olmo",), fused_activation=True)  # tests_vllm
