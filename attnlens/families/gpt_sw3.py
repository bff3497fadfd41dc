"""GPT-SW3: GPT-2's classes under another name. Its checkpoints load as `GPT2Config` (model type "gpt2") into
`GPT2LMHeadModel`, so the GPT-2 family serves them; this entry names the type for `family_for("gpt-sw3")`.

On vLLM the same holds: its checkpoints say `GPT2LMHeadModel`, which vLLM runs on its own GPT-2 port (gpt2.py), and
their config loads with model type "gpt2", so `StandardizedVLLM` serves them with GPT-2's vLLM locations (tested on
GPT-2's tiny checkpoint in tests_vllm)."""

from dataclasses import replace

from .gpt2 import GPT2


class GPTSw3(GPT2):
    model_types = ("gpt-sw3",)
    tiny = None  # the same classes as GPT-2, whose recipe tests them
    vllm = replace(GPT2.vllm, model_types=("gpt-sw3", "gpt2"))
