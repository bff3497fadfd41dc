"""Layers whose mixer is not softmax attention (Mamba, convolutions, recurrences: Bamba, Jamba, LFM2, RecurrentGemma):
what they serve and why not the rest.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import close, saved_for

#: case -> (a layer without softmax attention, the mixer's module name, words its reason says)
MIXERS = {
    "jamba": (0, "mamba", "a Mamba layer"),
    "bamba": (0, "mamba", "a Mamba-2 layer"),
    "lfm2": (0, "conv", "a short gated convolution"),
    "lfm2_moe": (2, "conv", "a short gated convolution"),
    "recurrent_gemma": (0, "temporal_block", "an RG-LRU recurrent block"),
}


@pytest.mark.parametrize("case", MIXERS)
def test_mixer_layers_serve_the_mixer_output_and_say_why_not_the_rest(case):
    model, (layer, mixer, words) = tiny(case), MIXERS[case]
    report = model.support(layer)
    for value in ("queries", "keys", "scores", "probabilities", "head_outputs", "premix"):
        reason = report[f"self_attn.attention_{value}"]
        assert f"layer {layer} of {model.family.name} is {words}" in reason and "not softmax attention" in reason
    assert report["self_attn.attention_output"] is None
    saved = saved_for(case)
    with torch.no_grad():
        out = getattr(model._module.get_submodule(model.family.layers)[layer], mixer)(
            saved[(layer, "attention_norm_output")],
            **(
                {"position_ids": torch.arange(len(PROMPT))[None], "attention_mask": None}
                if case == "recurrent_gemma"
                else {}
            ),
        )
    out = out[0] if isinstance(out, tuple) else out
    assert close(out, saved[(layer, "attention_output")])
