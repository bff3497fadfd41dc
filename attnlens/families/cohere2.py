"""Cohere 2 (Command R7B, Command A): Cohere's parallel block without QK-norm, sliding-window layers from
`layer_types`, and no rotary embedding on the full-attention layers.

On vLLM a sliding-window layer sees one key more than in transformers: vLLM's `CohereAttention` passes
`sliding_window + 1` to its kernel (Cohere's training convention: a query sees positions `[p - sliding_window, p]`),
while transformers' mask keeps the last `sliding_window` keys. attnlens serves what each engine computes: the vLLM
window is `sliding_window + 1`, and `support()` on vLLM says so. On a tiny model (window 4 on two of three layers),
vLLM's first-step log-probabilities are within 1e-6 of transformers' with a window of 5 and up to 0.098 apart from
transformers' with 4 (1.6 with `logit_scale` 1).
"""

from dataclasses import replace

from ..family import Tiny
from .cohere import Cohere


def vllm_window(family, config, layer):
    """The window vLLM's Cohere attention gives `layer`'s kernel: transformers' plus one key (None: full attention).
    Cohere 2 MoE shares it."""
    window = family.score_function().sliding_window(config, layer)
    return None if window is None else window + 1


def vllm_window_note(window: int) -> str:
    """The pattern's note on a sliding layer on vLLM, whose kernel sees `window` = sliding_window + 1 keys."""
    return (
        f"sliding window: each query sees its last {window} keys, one more than transformers' "
        f"config.sliding_window ({window - 1}): vLLM's attention passes sliding_window + 1 to its "
        f"kernel; rebuilt over the whole context (zeros outside the window)"
    )


class Cohere2(Cohere):
    model_types = ("cohere2",)
    tiny = Tiny(
        "Cohere2Config",
        "Cohere2ForCausalLM",
        {"sliding_window": 4, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    )
    # The tiny checkpoint is full attention only: with a sliding layer vLLM's values are transformers' with a wider
    # window, not the same checkpoint's (tests_vllm/test_windows.py tests those against transformers with
    # sliding_window + 1).
    vllm = replace(
        Cohere.vllm,
        model_types=("cohere2",),
        tiny={"head_dim": 32, "layer_types": ["full_attention"] * 3},
        window=vllm_window,
    )

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        window = self.score_function(engine).window(config, layer)
        if window is None:
            rotary = "not rotated: a full-attention layer has no rotary embedding"
            notes.update(attention_queries=rotary, attention_keys=rotary)
        elif engine == "vllm":
            notes["attention_probabilities"] = vllm_window_note(window)
        return notes
