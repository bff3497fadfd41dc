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


def test_support_lists_the_analyses_as_eager_does_where_vllm_serves_them(llama):
    """The same names on both engines; vLLM refuses gradients and the grids it does not patch, with the reason the
    call then raises."""
    import attnlens
    from attnlens.analysis import ANALYSES, attribution_patching, logit_difference

    served, eager = llama.vllm.support(1).analyses, llama.eager.support(1).analyses
    assert list(served) == list(eager) == list(ANALYSES)
    assert set(eager.values()) == {None}
    assert {name for name, reason in served.items() if reason is None} == {
        "attribution",
        "lens",
        "patch:heads",
        "patch:head_positions",
        "knock_out",
    }
    with pytest.raises(attnlens.Unavailable) as raised:
        attribution_patching(llama.vllm, llama.prompt, llama.prompt, logit_difference(llama.vllm, "a"), over="heads")
    assert served["attribution_patching:heads"] in str(raised.value)


def test_the_output_projections_are_read_once_per_engine(llama):
    """The worker keeps each layer's output projection matrix (vLLM's packed kernel run on the identity once); a
    second map uses them and equals the first."""
    from attnlens.analysis.vllm import _MATRICES

    first = attribution(llama.vllm, llama.prompt, target="a", versus="b")
    kept = len(_MATRICES)  # the uni executor: the worker is this process
    assert kept >= llama.vllm.num_layers
    second = attribution(llama.vllm, llama.prompt, target="a", versus="b")
    assert len(_MATRICES) == kept
    for layer in first.heads:
        assert torch.equal(first.heads[layer], second.heads[layer])


@pytest.mark.parametrize("over", ["heads", "head_positions"])
def test_patching_head_outputs_across_requests_equals_eager(llama, over):
    """vLLM runs the clean prompt and the patched corrupted ones as requests of one batch, the clean request's head
    outputs written into the others in the same forward: the grid is eager's `patch` on the same weights."""
    from attnlens.analysis import logit_difference, patch

    corrupt, layers = "Jello world, agaim", (None if over == "heads" else [1])
    grids = [
        patch(m, llama.prompt, corrupt, logit_difference(m, "a", "b"), over=over, layers=layers, batch_size=24)
        for m in (llama.eager, llama.vllm)
    ]
    eager, served = grids
    scale = max(abs(eager.clean), abs(eager.corrupt))
    assert served.values.shape == eager.values.shape and served.layers == eager.layers
    assert abs(served.clean - eager.clean) <= RTOL * max(1.0, scale)
    assert abs(served.corrupt - eager.corrupt) <= RTOL * max(1.0, scale)
    assert float(eager.effect.abs().max()) > 1e-3  # the patches move the metric, so agreeing means something
    assert _close(served.values, eager.values, scale)
    assert served.forwards == -(-served.values.numel() // 24)


def test_a_vllm_run_patched_into_itself_changes_nothing(llama):
    from attnlens.analysis import logit_difference, patch

    grid = patch(llama.vllm, llama.prompt, llama.prompt, logit_difference(llama.vllm, "a", "b"), batch_size=16)
    assert torch.allclose(grid.values, torch.full_like(grid.values, grid.clean), atol=1e-5)


# --- tensor parallelism: two CPU ranks, one core each --------------------------------------------------------------


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    """The tiny Llama (4 query heads, 2 key/value heads: both divide over two ranks) on two ranks."""
    import os

    from conftest import engine_args, pair
    from vllm import envs

    import attnlens

    llama = pair("llama", tmp_path_factory)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank; vLLM refuses to guess on one NUMA node
    envs.disable_envs_cache()  # vLLM froze its environment when the first engine started
    try:
        args = {**engine_args(128, 16 * 2**20), "distributed_executor_backend": "mp"}
        model = attnlens.StandardizedVLLM(str(llama.path), tensor_parallel_size=2, **args)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return model, llama


def test_tensor_parallel_attribution_equals_eager_on_prefill_and_decode_steps(tp):
    """Each rank holds its heads' columns of the output projection and its share of the vocabulary; the ranks join
    them, so the map on two ranks is eager's, and adds up to the logits there."""
    model, llama = tp
    assert model.support(1).analyses["attribution"] is None
    eager = attribution(llama.eager, llama.prompt, rows=[-1, 3], target="a", versus="b")
    served = attribution(model, llama.prompt, rows=[-1, 3], target="a", versus="b")
    steps = zip(
        [served, *attribution(model, llama.prompt, target="a", versus="b", max_new_tokens=2)[1:]],
        [eager, *attribution(llama.eager, llama.prompt, target="a", versus="b", max_new_tokens=2)[1:]],
    )
    for mine, theirs in steps:
        scale = float(theirs.value.abs().max())
        assert mine.rows == theirs.rows and _close(mine.value, theirs.value, scale)
        assert sorted(mine.heads) == sorted(theirs.heads) == list(range(llama.eager.num_layers))
        for layer in theirs.heads:
            assert mine.heads[layer].shape == theirs.heads[layer].shape == (len(theirs.rows), 4, len(theirs.tokens))
            assert _close(mine.heads[layer], theirs.heads[layer], scale), layer
        assert _close(mine.total, mine.value, scale)
