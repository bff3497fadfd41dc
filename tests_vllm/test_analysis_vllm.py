"""The analyses on vLLM equal the eager engine's on the same weights: computed in the worker, only the terms leave."""

import pytest
import torch

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


def test_lens_equals_eager(llama):
    from attnlens.analysis import logit_lens

    eager = logit_lens(llama.eager, llama.prompt, rows=[-1, 2], tokens=["a"])
    served = logit_lens(llama.vllm, llama.prompt, rows=[-1, 2], tokens=["a"])
    assert served.sites == eager.sites
    assert _close(served.token_logits, eager.token_logits, float(eager.last.abs().max()))
    assert _close(served.last, eager.last, float(eager.last.abs().max()))


def _knocked_steps(model, prompt, steps=3):
    from attnlens.analysis import knock_out

    with torch.no_grad(), model.generate(prompt, max_new_tokens=steps, do_sample=False) as tracer:
        logits = list().save()
        for _ in tracer.iter[:steps]:
            knock_out(model, 1, list(range(5, 40)), [0, 1, 2], heads=[0, 3])
            logits.append(model.logits[0, -1].clone())
    return torch.stack(list(logits))


def test_knockout_on_every_step_equals_eager(llama):
    """The same knockout on the prefill and every decode step moves vLLM's logits as it moves eager's."""
    served = _knocked_steps(llama.vllm, llama.prompt)
    eager = _knocked_steps(llama.eager, llama.prompt)
    assert served.shape == eager.shape == (3, eager.shape[-1])
    assert _close(served, eager, float(eager.abs().max()))
    with torch.no_grad(), llama.eager.trace(llama.prompt):
        plain = llama.eager.logits[0, -1].save()
    assert not torch.allclose(plain, eager[0], atol=1e-3)


def test_attribution_on_every_decode_step_equals_eager(llama):
    eager = attribution(llama.eager, llama.prompt, target="a", versus="b", max_new_tokens=3)
    served = attribution(llama.vllm, llama.prompt, target="a", versus="b", max_new_tokens=3)
    assert len(served) == len(eager) == 3
    for mine, theirs in zip(served, eager):
        scale = float(theirs.value.abs().max())
        assert mine.rows == theirs.rows and _close(mine.value, theirs.value, scale)
        for layer in theirs.heads:
            assert mine.heads[layer].shape == theirs.heads[layer].shape
            assert _close(mine.heads[layer], theirs.heads[layer], scale)
        assert _close(mine.total, mine.value, scale)
