"""NanoChat: one weightless RMSNorm module (`model.norm`) run on the embeddings before the first block as well as
after the last, QK RMSNorm after the rotary embedding, and a non-gated MLP (`fc2(act(fc1(x)))`).

Because `model.norm` runs twice per forward, its output is ambiguous; `final_norm_output` is read where the LM head
receives it (the second run: the same tensor, sliced to the positions whose logits are kept). `embeddings` is the
token embedding's output; `layers[0].layer_input` is its normalised form.

vLLM runs it through its Transformers backend (transformers' own modules, vLLM's kernel as the attention function).
"""

from dataclasses import replace

from ..family import Family, Tiny
from ..locations import ModuleInput, ModuleOutput
from ..parts.mirrored import transformers_backend

_BACKEND = transformers_backend(("nanochat",))  # its MLP is not gated: nothing fused


def _vllm_locations(family):
    # vLLM computes the logits from the base model's output (model.norm's second run): its lm_head never runs
    return {**_BACKEND.locations(family), "final_norm_output": ModuleOutput("model", 0)}


class NanoChat(Family):
    model_types = ("nanochat",)
    vllm = replace(_BACKEND, locations=_vllm_locations)  # vLLM's Transformers backend (tests_vllm)
    tiny = Tiny("NanoChatConfig", "NanoChatForCausalLM", {})
    activation = "activation_fn"
    down_projection = "fc2"

    def locations(self):
        return {**super().locations(), "final_norm_output": ModuleInput("lm_head")}

    kind_notes = {
        "*": {
            "attention_queries": "rotated, then RMS-normalised per head (q_norm)",
            "attention_keys": "rotated, then RMS-normalised per head (k_norm)",
            "embeddings": "the token embedding's output; layers[0].layer_input is model.norm of it",
            "final_norm_output": "what the LM head receives: model.norm's second run, on the last block's output "
            "(under generate, only the positions whose logits are kept)",
        }
    }
