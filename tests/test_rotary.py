"""Partial and interleaved rotary embeddings (GPT-J, GPT-NeoX, Phi, StableLM, Cohere): which dimensions rotate.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from identities import LAYER, at, attention_module, close, heads


def projected_queries(case, layer=LAYER):
    """The per-head query projection of the attention norm output, QK-norm applied where the family has one."""
    module = attention_module(case, layer)
    x = at(case, "attention_norm_output", layer)
    if hasattr(module, "query_key_value"):  # GPT-NeoX: per head [q|k|v]
        d = module.head_size
        return module.query_key_value(x).view(*x.shape[:2], -1, 3 * d).transpose(1, 2)[..., :d]
    q = heads(module.q_proj(x), module.head_dim)
    norm = getattr(module, "q_layernorm", None) or getattr(module, "q_norm", None)
    if norm is not None:
        q = norm(q) if not hasattr(module, "use_qk_norm") else norm(q.transpose(1, 2)).transpose(1, 2)
    return q


ROTARY = {"gptj": 8, "gpt_neox": 4, "phi": 8, "phi:qk_layernorm": 8, "stablelm": 4, "stablelm:qk_layernorm": 4}


@pytest.mark.parametrize("case", list(ROTARY))
def test_partial_rotary_leaves_the_tail_of_each_head_unrotated(case):
    module = attention_module(case)
    rotary = getattr(module, "rotary_dim", None) or module.rotary_ndims
    assert rotary == ROTARY[case]
    with torch.no_grad():
        q = projected_queries(case)
    queries = at(case, "attention_queries")
    assert close(queries[..., rotary:], q[..., rotary:])
    assert not close(queries[..., 1:, :rotary], q[..., 1:, :rotary])  # position 0 is not rotated


@pytest.mark.parametrize("case", ["gptj", "cohere", "cohere:qk_norm"])
def test_interleaved_rotary_rotates_adjacent_pairs(case):
    """Rotating pairs (0, 1), (2, 3), ... keeps each adjacent pair's length; rotate-half would not."""
    module = attention_module(case)
    rotary = getattr(module, "rotary_dim", None) or module.head_dim
    with torch.no_grad():
        q = projected_queries(case)[..., :rotary]
    queries = at(case, "attention_queries")[..., :rotary]

    def pair_lengths(x):
        return x.unflatten(-1, (-1, 2)).norm(dim=-1)

    assert close(pair_lengths(queries), pair_lengths(q), atol=1e-4)
    assert not close(queries, q)
