"""What a served row reduces to (`attnlens.row_features`, `attnlens serve`'s features): each feature against its
definition on a random causal pattern, and a left-padded batch of rows of different requests (as vLLM's worker scores
decode steps together) against the same rows one request at a time."""

import pytest
import torch

from attnlens import row_features

pytestmark = pytest.mark.any_transformers

NAMES = list(row_features.FEATURES)


def _pattern(heads: int, keys: int, seed: int) -> torch.Tensor:
    """A causal pattern `[heads, keys, keys]`: each row a softmax over the keys up to it, zeros after."""
    scores = torch.randn(heads, keys, keys, generator=torch.Generator().manual_seed(seed))
    return scores.masked_fill(torch.ones(keys, keys).triu(1).bool(), float("-inf")).softmax(-1)


def test_each_feature_is_its_definition():
    p = _pattern(3, 12, 0)
    prompt, rows = 7, [2, 6, 9, 11]
    found = row_features.of_pattern(NAMES, p, rows, prompt, spans=((0, 3), (5, 9)), top_k=4)
    chosen = p[:, rows, :12]
    assert torch.allclose(found["entropy"], -(chosen * chosen.clamp(min=1e-30).log()).sum(-1), atol=1e-6)
    assert torch.equal(found["sink"], chosen[..., 0])
    assert torch.equal(found["previous"], torch.stack([p[:, r, r - 1] for r in rows], 1))
    assert torch.equal(found["pattern"], chosen)
    assert torch.allclose(found["span_mass"][..., 1], chosen[..., 5:9].sum(-1))
    weights, keys = chosen.topk(4, -1)
    assert torch.equal(found["top_keys"][:, 1:], keys[:, 1:].int()) and torch.equal(
        found["top_weights"][:, 1:], weights[:, 1:]
    )
    assert (found["top_keys"][:, 0, 3] == -1).all()  # row 2 sees three keys: the fourth is none
    on_prompt = chosen[..., :prompt].sum(-1) / prompt
    seen = torch.tensor(rows) + 1 - prompt
    on_generated = chosen[..., prompt:].sum(-1) / seen.clamp(min=1)
    want = torch.where(seen > 0, on_prompt / (on_prompt + on_generated), torch.nan)
    assert torch.allclose(found["lookback"], want, equal_nan=True)
    assert found["lookback"][:, :2].isnan().all() and not found["lookback"][:, 2:].isnan().any()


def test_a_padded_batch_of_requests_equals_each_request_alone():
    """Three requests' decode rows at positions 4, 9 and 6, left-padded to 10 keys in one batch (padding zero, as
    the worker's masked softmax leaves it), give each request's numbers as computed on its own row."""
    positions, prompts = torch.tensor([4, 9, 6]), torch.tensor([3, 8, 2])
    patterns = [_pattern(2, int(n) + 1, seed)[:, -1:] for seed, n in enumerate(positions)]  # [heads, 1, keys]
    longest = int(positions.max()) + 1
    batch = torch.zeros(2, 3, longest)
    for row, p in enumerate(patterns):
        batch[:, row, longest - p.shape[-1] :] = p[:, 0]
    spans = ((0, 2), (1, 5))
    together = row_features.compute(
        NAMES, batch, row_features.Rows(positions, prompts, spans, top_k=3, offsets=longest - positions - 1)
    )
    for row, p in enumerate(patterns):
        alone = row_features.compute(
            NAMES, p, row_features.Rows(positions[row : row + 1], int(prompts[row]), spans, top_k=3)
        )
        for name, array in alone.items():
            mine = together[name][:, row : row + 1]
            if name == "pattern":
                mine = mine[..., : array.shape[-1]]
                assert not together[name][:, row, array.shape[-1] :].any()
            assert torch.allclose(mine.float(), array.float(), atol=1e-7, equal_nan=True), name
