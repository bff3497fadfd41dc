"""The analyses on vLLM equal the eager engine's on the same weights: computed in the worker, only the terms leave."""

import pytest
import torch
from conftest import DIFFERS, TOLERANCE, tolerance

from attnlens.analysis import attribution

#: Relative tolerance between the engines in float32 (vLLM's kernels sum in another order).
RTOL = TOLERANCE


def _close(a, b, scale, rtol=RTOL):
    return float((a.float() - b.float()).abs().max()) <= rtol * max(1.0, scale)


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


def test_every_family_attributes_on_vllm_as_on_eager(models):
    """Every family vLLM serves (computing what transformers does: not `DIFFERS`): where eager splits a layer's
    attention by head and source, vLLM's map (computed in its worker) equals eager's at the family's tolerance and adds
    up to vLLM's own logit difference; where a layer is not split, or the map is refused, both engines say so for the
    same layers."""
    import attnlens
    from attnlens.analysis.reasons import ATTRIBUTION

    if models.name in DIFFERS:
        pytest.skip(f"plain vLLM computes otherwise: {DIFFERS[models.name][1]}")
    eager_reasons = [models.eager.support(layer).analyses[ATTRIBUTION] for layer in range(models.eager.num_layers)]
    vllm_reasons = [models.vllm.support(layer).analyses[ATTRIBUTION] for layer in range(models.vllm.num_layers)]
    assert [r is None for r in vllm_reasons] == [r is None for r in eager_reasons], (vllm_reasons, eager_reasons)
    kwargs = (
        dict(target=" Mary", versus=" John", rows=[-1, 4])
        if models.name == "smollm2"
        else dict(target="a", versus="b", rows=[-1, 3])
    )
    try:
        eager = attribution(models.eager, models.prompt, **kwargs)
    except attnlens.Unavailable as refused:
        with pytest.raises(attnlens.Unavailable) as also:
            attribution(models.vllm, models.prompt, **kwargs)
        print(models.name, "refused on both:", refused, "|", also.value)
        return
    served = attribution(models.vllm, models.prompt, **kwargs)
    rtol = tolerance(models)
    scale = float(eager.value.abs().max())
    assert _close(served.value, eager.value, scale, rtol), (served.value, eager.value)
    assert sorted(served.heads) == sorted(eager.heads)
    assert sorted(eager.heads) == [layer for layer, reason in enumerate(eager_reasons) if reason is None]
    for layer in eager.rest:
        if layer in eager.heads:
            assert served.heads[layer].shape == eager.heads[layer].shape
            assert _close(served.heads[layer], eager.heads[layer], scale, rtol), layer
        assert _close(served.attention[layer], eager.attention[layer], scale, rtol), layer
        assert _close(served.rest[layer], eager.rest[layer], scale, rtol), layer
    assert _close(served.embeddings, eager.embeddings, scale, rtol)
    assert _close(served.total, served.value, scale, rtol)  # the identity, on vLLM's own tensors


def test_every_family_lenses_on_vllm_as_on_eager(models):
    """Every family vLLM serves (not `DIFFERS`): the logit lens on vLLM equals eager's at the family's tolerance, or
    both refuse."""
    if models.name in DIFFERS:
        pytest.skip(f"plain vLLM computes otherwise: {DIFFERS[models.name][1]}")
    import attnlens
    from attnlens.analysis import logit_lens
    from attnlens.analysis.reasons import LENS

    reasons = [model.support(0).analyses[LENS] for model in (models.eager, models.vllm)]
    assert (reasons[0] is None) == (reasons[1] is None), reasons
    kwargs = dict(rows=[-1, 2], tokens=[" Mary"] if models.name == "smollm2" else ["a"])
    if reasons[0] is not None:
        for model in (models.eager, models.vllm):
            with pytest.raises(attnlens.Unavailable):
                logit_lens(model, models.prompt, **kwargs)
        return
    eager = logit_lens(models.eager, models.prompt, **kwargs)
    served = logit_lens(models.vllm, models.prompt, **kwargs)
    rtol = tolerance(models)
    scale = float(eager.last.abs().max())
    assert served.sites == eager.sites
    assert _close(served.token_logits, eager.token_logits, scale, rtol)
    assert _close(served.last, eager.last, scale, rtol)


def test_lens_equals_eager(llama):
    from attnlens.analysis import logit_lens

    eager = logit_lens(llama.eager, llama.prompt, rows=[-1, 2], tokens=["a"])
    served = logit_lens(llama.vllm, llama.prompt, rows=[-1, 2], tokens=["a"])
    assert served.sites == eager.sites
    assert _close(served.token_logits, eager.token_logits, float(eager.last.abs().max()))
    assert _close(served.last, eager.last, float(eager.last.abs().max()))


def _knocked_steps(model, prompt, steps=3, layer=1, queries=range(5, 40), keys=(0, 1, 2), heads=(0, 3)):
    from attnlens.analysis import knock_out

    with torch.no_grad(), model.generate(prompt, max_new_tokens=steps, do_sample=False) as tracer:
        logits = list().save()
        for _ in tracer.iter[:steps]:
            knock_out(model, layer, list(queries), list(keys), heads=None if heads is None else list(heads))
            logits.append(model.logits[0, -1].clone())
    return torch.stack(list(logits))


def test_every_family_knocks_out_on_vllm_as_on_eager(models):
    """Every family vLLM serves (not `DIFFERS`): a knockout on the last layer eager knocks out on moves vLLM's logits
    as it moves eager's (and moves them), and vLLM refuses only what eager refuses, or more (a read-only pattern). The
    edges are the last query's to every key before it, on every head: its row keeps only itself (the tiny models'
    patterns are peaked, so a few keys may hold no weight)."""
    import attnlens
    from attnlens.analysis.reasons import KNOCK_OUT

    if models.name in DIFFERS:
        pytest.skip(f"plain vLLM computes otherwise: {DIFFERS[models.name][1]}")
    layers = range(models.eager.num_layers)
    served = [layer for layer in layers if models.eager.support(layer).analyses[KNOCK_OUT] is None]
    refused = [layer for layer in layers if models.vllm.support(layer).analyses[KNOCK_OUT] is not None]
    assert not set(layers) - set(served) - set(refused), "vLLM knocks out where eager refuses"
    if not served:
        pytest.skip(f"no layer of {models.name} serves knockouts on eager")
    n = len(models.eager.tokenizer(models.prompt).input_ids)
    edges = dict(layer=served[-1], queries=[n - 1], keys=range(n - 1), heads=None)
    if served[-1] in refused:
        with pytest.raises(attnlens.Unavailable, match="knock_out"):
            _knocked_steps(models.vllm, models.prompt, steps=1, **edges)
        return
    on_vllm = _knocked_steps(models.vllm, models.prompt, steps=1, **edges)
    on_eager = _knocked_steps(models.eager, models.prompt, steps=1, **edges)
    rtol = tolerance(models)
    scale = max(1.0, float(on_eager.abs().max()))
    assert _close(on_vllm, on_eager, scale, rtol)
    with torch.no_grad(), models.eager.trace(models.prompt):
        plain = models.eager.logits[0, -1].save()
    moved = float((plain.float() - on_eager[0].float()).abs().max())
    assert moved > 10 * rtol * scale, moved  # far beyond the engines' agreement


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
        "patch:residual",
        "patch:patterns",
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


CORRUPT = "Jello world, agaim"
#: The layers each grid is taken over in these tests (head_positions and a residual at one position of every layer
#: are many requests: one layer for the first; every layer, embeddings' included, for the residual).
PATCHED_LAYERS = {"heads": None, "head_positions": [1], "residual": None, "patterns": None}
_grids: dict = {}


def _grid(model, llama, over, clean, batch_size, layers="default"):
    """`patch` of `clean` into the corrupted prompt over `over`, kept for the module's tests."""
    from attnlens.analysis import logit_difference, patch

    layers = PATCHED_LAYERS[over] if layers == "default" else layers
    key = (model.access.engine, over, clean, batch_size, str(layers))
    if key not in _grids:
        metric = logit_difference(model, "a", "b")
        _grids[key] = patch(model, clean, CORRUPT, metric, over=over, layers=layers, batch_size=batch_size)
    return _grids[key]


@pytest.mark.parametrize("over", ["heads", "head_positions", "residual", "patterns"])
def test_patching_across_requests_equals_eager(llama, over):
    """vLLM runs the clean prompt and the patched corrupted ones as requests of one batch, the clean request's values
    (head outputs, block inputs, patterns) written into the others in the same forward (a patched pattern has the
    head outputs recomputed from it): the grid is eager's `patch` on the same weights, 1e-4 relative."""
    eager, served = (_grid(m, llama, over, llama.prompt, 24) for m in (llama.eager, llama.vllm))
    scale = max(abs(eager.clean), abs(eager.corrupt))
    assert served.values.shape == eager.values.shape and served.layers == eager.layers
    assert abs(served.clean - eager.clean) <= RTOL * max(1.0, scale)
    assert abs(served.corrupt - eager.corrupt) <= RTOL * max(1.0, scale)
    assert float(eager.effect.abs().max()) > 1e-3  # the patches move the metric, so agreeing means something
    assert _close(served.values, eager.values, scale)
    assert served.forwards == -(-served.values.numel() // 24)


@pytest.mark.parametrize("over", ["heads", "residual", "patterns"])
def test_a_vllm_run_patched_into_itself_changes_nothing(llama, over):
    from attnlens.analysis import logit_difference, patch

    metric = logit_difference(llama.vllm, "a", "b")
    grid = patch(llama.vllm, llama.prompt, llama.prompt, metric, over=over, layers=PATCHED_LAYERS[over], batch_size=24)
    assert torch.allclose(grid.values, torch.full_like(grid.values, grid.clean), atol=1e-5)


def test_the_patched_residual_of_the_first_block_at_every_position_is_the_clean_run(llama):
    """Layer 0's input is the embeddings: the clean run's at one position restores that position's token, so
    patching it at every position at once (one request) gives the clean metric."""
    from attnlens.analysis.patching import _ids, _run_requests

    ids, corrupt = _ids(llama.vllm, llama.prompt), _ids(llama.vllm, CORRUPT)
    every = [(0, position) for position in range(len(ids))]
    logits = _run_requests(llama.vllm, ids, corrupt, "layer_input", [[], every], [0])
    clean, unpatched, patched = logits[:, -1]
    assert not torch.allclose(clean, unpatched, atol=1e-3)
    assert torch.allclose(patched, clean, atol=1e-5)


@pytest.mark.parametrize("over", ["residual", "patterns"])
def test_the_batch_size_does_not_change_the_vllm_grid(llama, over):
    """One patched request per batch or many: vLLM's batch puts the requests side by side, never mixes them."""
    layers = [1] if over == "residual" else None
    one, many = (_grid(llama.vllm, llama, over, llama.prompt, size, layers) for size in (1, 24))
    assert one.forwards == one.values.numel() and many.forwards < one.forwards
    scale = max(abs(many.clean), abs(many.corrupt))
    assert _close(one.values, many.values, scale)
    assert float((many.values - many.corrupt).abs().max()) > 1e-3


def _gated(monkeypatch, access, layer):
    """`access` serving layer `layer`'s pattern as vLLM serves a gated layer's: read-only. The location returned."""
    from attnlens.locations.vllm import GatedPattern

    gated, located = GatedPattern(kernel="self_attn.attn", kind="probabilities"), access.location

    def location(name, at):
        return gated if (name, at) == ("attention_probabilities", layer) else located(name, at)

    monkeypatch.setattr(access, "location", location)
    return gated


def test_a_read_only_pattern_is_neither_patched_nor_knocked_out(llama, monkeypatch):
    """Where vLLM's pattern is read-only (a layer whose output gate comes after the kernel: attnlens could not
    recompute the head outputs from an edited pattern), support says so for the pattern grid and knockouts, and
    `patch` and `knock_out` raise it."""
    import attnlens
    from attnlens.analysis import knock_out, logit_difference, patch

    gated = _gated(monkeypatch, llama.vllm.access, 1)
    served, other = llama.vllm.support(1).analyses, llama.vllm.support(0).analyses
    for name in ("patch:patterns", "knock_out"):
        assert "read-only" in served[name] and gated.why_not in served[name]
        assert other[name] is None
    assert served["patch:heads"] is None and served["patch:residual"] is None
    with pytest.raises(attnlens.Unavailable, match="read-only"):
        patch(llama.vllm, llama.prompt, CORRUPT, logit_difference(llama.vllm, "a", "b"), over="patterns", layers=[1])
    # knock_out asks the access it finds in the trace (vLLM's worker has its own copy: asked on eager's here)
    _gated(monkeypatch, llama.eager.access, 1)
    with pytest.raises(attnlens.Unavailable, match="read-only"), torch.no_grad(), llama.eager.trace(llama.prompt):
        knock_out(llama.eager, 1, queries=[5], keys=[0])


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


@pytest.mark.ranks
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
