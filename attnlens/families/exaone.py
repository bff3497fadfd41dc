"""EXAONE 3 (`exaone`): the Llama layout. transformers builds it as LlamaForCausalLM, renaming the released
checkpoints' weights when it loads them (`transformer.h.N.attn.attention.q_proj` -> `model.layers.N.self_attn.q_proj`,
`ln_1` -> `input_layernorm`, `mlp.c_fc_0` -> `mlp.gate_proj`, ...) and back when it saves, so every value is read at
Llama's places.

vLLM 0.32 registers ExaoneForCausalLM (exaone.py), but reads the checkpoint's config through the transformers it pins
(5.19), which has no ExaoneConfig: it refuses an `exaone` config before building anything (measured on the tiny
checkpoint transformers 5.24 saves, and on the released format with `trust_remote_code`, which without the
authors' configuration file changes nothing).
"""

from ..family import Tiny, VLLMLayout
from .llama import Llama


class Exaone(Llama):
    model_types = ("exaone",)
    tiny = Tiny("ExaoneConfig", "LlamaForCausalLM", {})  # what AutoModelForCausalLM builds from an ExaoneConfig
    vllm = VLLMLayout(
        refusal="vLLM 0.32 cannot read an EXAONE 3 config: the transformers it pins (<5.20; 5.19 here) has no "
        'ExaoneConfig, and vLLM ships none of its own ("The checkpoint you are trying to load has model type '
        '`exaone` but Transformers does not recognize this architecture"); the transformers engine serves the family',
    )
