"""The analyses on vLLM equal the eager engine's on the same weights: computed in the worker, only the terms leave."""

import pytest
import torch

import attnlens
from attnlens.analysis import attribution

#: Relative tolerance between the engines in float32 (vLLM's kernels sum in another order).
RTOL = 1e-4


def _close(a, b, scale):
    return float((a - b).abs().max()) <= RTOL * max(1.0, scale)


@pytest.mark.parametrize("name", ["llama", "smollm2"])
def test_attribution_equals_eager(name, tmp_path_factory):
    from conftest import pair

    models = pair(name, tmp_path_factory)
    if name == "smollm2":
        kwargs = dict(target=" Mary", versus=" John", rows=[-1, 4])
    else:
        kwargs = dict(target="a", versus="b", rows=[-1, 3])
    eager = attribution(models.eager, models.prompt, **kwargs)
    served = attribution(models.vllm, models.prompt, **kwargs)
    scale = float(eager.value.abs().max())
    assert _close(served.value, eager.value, scale)
    assert sorted(served.heads) == sorted(eager.heads) == list(range(models.eager.num_layers))
    for layer in eager.heads:
        assert served.heads[layer].shape == eager.heads[layer].shape
        assert _close(served.heads[layer], eager.heads[layer], scale), layer
        assert _close(served.rest[layer], eager.rest[layer], scale), layer
    assert _close(served.total, served.value, scale)  # the identity, on vLLM's own tensors
