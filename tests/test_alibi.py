"""ALiBi (Bloom, MPT, Falcon's ALiBi layout): the slopes against transformers' own builders, and the bias inside the
scores.

Generic over the mechanism; a family's own tests are in tests/families/test_<family>.py."""

import pytest
import torch
from conftest import tiny
from identities import N, close, saved_for

from attnlens import family_for
from attnlens.families.falcon import own_arithmetic

ALIBI = ("bloom", "mpt", "falcon:alibi")


@pytest.mark.parametrize("heads", [*range(1, 41), 64, 71, 112])
def test_alibi_slopes_match_transformers(heads):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1]])
    expected = bloom_alibi(mask, heads, torch.float32).view(2, heads, 1, 7)
    assert torch.equal(family_for("bloom").alibi(heads, 7, mask), expected)
    assert torch.equal(family_for("bloom").alibi(heads, 7), expected[:1])
    expected = falcon_alibi(mask, heads, torch.float32).view(2, heads, 1, 7)
    assert torch.equal(family_for("falcon").alibi(heads, 7, mask), expected)
    assert torch.equal(family_for("mpt").alibi(heads, 7), build_mpt_alibi_tensor(heads, 32)[:, :, -7:])


def _visible(length):
    return torch.ones(length, length, dtype=torch.bool).tril()


@pytest.mark.parametrize("case", ALIBI)
def test_alibi_is_part_of_the_scores(case):
    """Scores minus the scaled q·k is the ALiBi bias, built here with transformers' own functions."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor as bloom_alibi
    from transformers.models.falcon.modeling_falcon import build_alibi_tensor as falcon_alibi
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    model = tiny(case)
    layer = 1
    attn = model.layers[layer].self_attn
    saved = saved_for(case)
    q, k, s = (saved[(layer, name)] for name in ("attention_queries", "attention_keys", "attention_scores"))
    bias = (s - q @ k.transpose(-1, -2) * attn.scale)[..., _visible(N)]
    ones = torch.ones(1, N, dtype=torch.long)
    if case == "bloom":
        expected = bloom_alibi(ones, 4, torch.float32).view(4, 1, N)
    elif case == "mpt":
        expected = build_mpt_alibi_tensor(4, model.config.max_seq_len)[:, :, -N:]
    else:  # FalconModel folds alibi / sqrt(d) into the mask; transformers 5.24's attention adds alibi / sqrt(d) again
        expected = (2 if own_arithmetic() else 1) * falcon_alibi(ones, 4, torch.float32).view(4, 1, N) * attn.scale
    expected = expected.expand(4, N, N)[None][..., _visible(N)]
    assert close(bias, expected, atol=1e-4)
    assert expected.abs().max() > 1  # the bias binds on these lengths
