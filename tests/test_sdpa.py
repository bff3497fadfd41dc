"""Under sdpa every value but the scores and the pattern is served, equal to eager's (fused, parallel and Llama-like
families).

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import PROMPT, tiny
from identities import LAYER, at

FAMILIES = ("gpt_bigcode", "gptj", "gpt_neox", "phi", "phi3", "opt", "cohere", "stablelm")


@pytest.mark.parametrize("case", FAMILIES)
def test_sdpa_serves_all_but_scores_and_pattern(case):
    try:
        sdpa = tiny(case, attn_implementation="sdpa")
    except ValueError as error:  # "does not support an attention implementation through ... sdpa"
        pytest.skip(f"{case} has no sdpa path on this transformers (GPT-J before 5.20 runs its own _attn): {error}")
    report = sdpa.support(LAYER)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert "attn_implementation='eager'" in report[key]
    names = (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_head_outputs",
        "attention_premix",
        "attention_output",
    )
    got = []
    with torch.no_grad(), sdpa.trace(PROMPT):
        attn = sdpa.layers[LAYER].self_attn
        got += [getattr(attn, name).save() for name in names] + [sdpa.layers[LAYER].mlp.mlp_output.save()]
    for name, b in zip((*names, "mlp_output"), got):  # sdpa rounds differently: tolerance relative to the magnitudes
        a = at(case, name)
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max()), name


LLAMA_LIKES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmo", "olmo:noclip", "olmo2", "starcoder2", "granite", "glm4")


@pytest.mark.parametrize("case", LLAMA_LIKES)
def test_sdpa_serves_all_but_scores_and_pattern_on_llama_likes(case):
    eager, sdpa = tiny(case), tiny(case, attn_implementation="sdpa")
    report = sdpa.support(1)
    for key in ("self_attn.attention_scores", "self_attn.attention_probabilities"):
        assert "attn_implementation='eager'" in report[key]
    names = (
        "attention_queries",
        "attention_keys",
        "attention_values",
        "attention_head_outputs",
        "attention_premix",
        "attention_output",
    )
    got = {}
    for label, model in (("eager", eager), ("sdpa", sdpa)):
        with torch.no_grad(), model.trace(PROMPT):
            attn = model.layers[1].self_attn
            got[label] = [getattr(attn, name).save() for name in names] + [model.layers[1].mlp.mlp_output.save()]
    for a, b in zip(got["eager"], got["sdpa"]):  # sdpa rounds differently: tolerance relative to the magnitudes
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * b.abs().max())
