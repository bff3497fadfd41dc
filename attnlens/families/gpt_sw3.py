"""GPT-SW3: GPT-2's classes under another name. Its checkpoints load as `GPT2Config` (model type "gpt2") into
`GPT2LMHeadModel`, so the GPT-2 family serves them; this entry names the type for `family_for("gpt-sw3")`."""

from .gpt2 import GPT2


class GPTSw3(GPT2):
    model_types = ("gpt-sw3",)
    tiny = None  # the same classes as GPT-2, whose recipe tests them
