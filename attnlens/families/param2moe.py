"""Param2 MoE (`param2moe`): GLM-4-MoE as transformers builds it (`Glm4MoeForCausalLM` from a `Param2MoeConfig`), with
per-head QK-norm on and the rotary embedding over the whole head (`partial_rotary_factor=1.0`, where GLM-4-MoE turns
half of it); every value is read at GLM-4-MoE's places.
"""

from ..family import Tiny, VLLMLayout
from .glm4_moe import Glm4Moe


class Param2Moe(Glm4Moe):
    model_types = ("param2moe",)
    tiny = Tiny("Param2MoeConfig", "Glm4MoeForCausalLM", Glm4Moe.tiny.kwargs)
    vllm = VLLMLayout(
        refusal="vLLM 0.32 cannot read a Param2 MoE config: the transformers it pins (<5.20; 5.19 here) has no "
        "Param2MoeConfig and vLLM ships none of its own (it registers Param2MoEForCausalLM for checkpoints that bring "
        "their configuration's code); the transformers engine serves the family"
    )
