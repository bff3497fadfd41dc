"""capture_attention, run_with_cache and per_head_value on StandardizedVLLM equal the transformers engine on the same
weights."""

import pytest
import torch
from conftest import pair

import attnlens

PROMPTS = ["Hello world, again", "Hi there"]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    llama = pair("llama", tmp_path_factory)  # the session's engines: vLLM's CPU kernel wants head sizes >= 32
    return llama.vllm, llama.eager


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()))


def test_capture_attention_equals_eager(engines):
    vllm, eager = engines
    got = attnlens.capture_attention(vllm, PROMPTS, [0, 2], rows=[-1, 0], heads=[1, 2])
    want = attnlens.capture_attention(eager, PROMPTS, [0, 2], rows=[-1, 0], heads=[1, 2])
    for one, other in zip(got, want):
        for layer in (0, 2):
            for kind in ("probs", "value"):
                assert close(one[layer][kind], other[layer][kind]), (layer, kind)
            visible = ~attnlens.masked(other[layer]["scores"])
            assert close(one[layer]["scores"][visible], other[layer]["scores"][visible])


def test_run_with_cache_and_per_head_value_equal_eager(engines):
    vllm, eager = engines
    names = ["value.1", "attn_probs.1", "z.1", "resid_post.1"]
    for on_vllm, on_eager in zip(
        attnlens.run_with_cache(vllm, PROMPTS, names), attnlens.run_with_cache(eager, PROMPTS, names)
    ):
        for key in on_eager:
            assert close(on_vllm[key], on_eager[key]), key
        z = torch.einsum("bhqk,bkhd->bqhd", on_vllm.get("attn_probs", 1), attnlens.per_head_value(vllm, on_vllm, 1))
        assert close(z, on_eager.get("z", 1))
