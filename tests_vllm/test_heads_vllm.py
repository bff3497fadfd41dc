"""Head summaries on vLLM are computed inside the worker at the attention op (`attnlens.vllm.reducer`), from the
kernel's queries and keys, and equal the transformers engine's on the same weights: on every family vLLM serves, on
an engine at vLLM's defaults (compiled), and on two tensor-parallel ranks."""

from itertools import pairwise

import pytest
import torch
from conftest import DIFFERS, engine_args, tolerance

import attnlens
from attnlens.heads import _tapped

SUMMARIES = dict(length=12, sequences=3, top_k=2, progress=False)


def assert_summaries_equal(got, want, rtol: float) -> None:
    assert got.layers == want.layers and got.skipped.keys() == want.skipped.keys()
    assert got.metrics == want.metrics
    for metric in want.metrics:
        for layer in want.layers:
            a, b = got.get(metric, layer), want.get(metric, layer)
            assert torch.allclose(a, b, atol=rtol * max(1.0, float(b.abs().max())), equal_nan=True), (metric, layer)
    for layer in want.layers:  # the same top keys of each prompt's last row, head by head, where weights differ
        for got_row, want_row in zip(got.top[layer], want.top[layer]):
            for got_head, want_head in zip(got_row["keys"], want_row["keys"]):
                weights = [key[2] for key in want_head]
                if (
                    len(set(weights)) == len(weights)
                    and min((abs(x - y) for x, y in pairwise(weights)), default=1) > 10 * rtol
                ):
                    assert [key[0] for key in got_head] == [key[0] for key in want_head], (layer, want_row["row"])


def test_head_summaries_on_vllm_equal_eager(llama):
    prompts = [llama.prompt, "Short prompt"]
    on = {
        engine: attnlens.head_summaries(model, prompts, **SUMMARIES)
        for engine, model in (("vllm", llama.vllm), ("eager", llama.eager))
    }
    assert on["vllm"].layers == on["eager"].layers == [0, 1, 2]
    assert_summaries_equal(on["vllm"], on["eager"], 1e-4)


def test_every_family_summarises_on_vllm_as_on_eager(models):
    """Every family vLLM serves: the same layers summarised (or skipped) and the same sums at the family's tolerance,
    whether vLLM's kernel receives the queries and keys as attnlens serves them (reduced there) or not (traced)."""
    if models.name in DIFFERS:
        pytest.skip(f"plain vLLM computes otherwise: {DIFFERS[models.name][1]}")
    try:
        want = attnlens.head_summaries(models.eager, [models.prompt], **SUMMARIES)
    except attnlens.Unavailable as error:
        with pytest.raises(attnlens.Unavailable):
            attnlens.head_summaries(models.vllm, [models.prompt], **SUMMARIES)
        pytest.skip(str(error))
    got = attnlens.head_summaries(models.vllm, [models.prompt], **SUMMARIES)
    assert_summaries_equal(got, want, tolerance(models))


def test_head_summaries_on_an_engine_at_vllms_defaults(llama):
    """An engine for static capture runs vLLM's compiled model, where no trace runs: the summaries are reduced at the
    attention op there, equal to eager's."""
    compiled = attnlens.StandardizedVLLM(
        str(llama.path), static_points=["attn_probs.0"], **engine_args(128, 16 * 2**20)
    )
    assert compiled.compiled and _tapped(compiled, [0, 1, 2])
    prompts = [llama.prompt, "Short prompt", "x"]
    assert_summaries_equal(
        attnlens.head_summaries(compiled, prompts, **SUMMARIES),
        attnlens.head_summaries(llama.eager, prompts, **SUMMARIES),
        1e-4,
    )
    # the static points' own captures are unchanged by the summaries' requests beside them
    (result,) = compiled.static_generate([llama.prompt], max_new_tokens=1, do_sample=False)
    assert result.steps[0]["attn_probs.0"].shape[-1] == len(llama.eager.tokenizer(llama.prompt)["input_ids"])
    assert compiled.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(None,))[0] == {}


def test_prompts_held_whole_and_split_over_steps_summarise_alike(llama, monkeypatch):
    """With 32-token steps, some prompts arrive whole in one step (reduced straight from the step's rows, prompts of
    one length together) and others in chunks over several steps (copied into a run, reduced after the last chunk):
    both ways give the eager engine's summaries, and each way is taken."""
    from attnlens.vllm import reducer

    taken = {"whole": 0, "run": 0}
    for method, way in (("_reduce_group", "whole"), ("_reduce", "run")):
        original = getattr(reducer.Reducer, method)

        def counted(self, *args, _original=original, _way=way):
            taken[_way] += 1
            return _original(self, *args)

        monkeypatch.setattr(reducer.Reducer, method, counted)
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        static_points=["attn_probs.0"],
        block_size=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **engine_args(128, 16 * 2**20),
    )
    prompts = [llama.prompt * 3, "Short prompt", "Short words", "x"]  # the first spans steps; two of one length
    assert len(model.tokenizer(prompts[0])["input_ids"]) > 32
    assert_summaries_equal(
        attnlens.head_summaries(model, prompts, **SUMMARIES),
        attnlens.head_summaries(llama.eager, prompts, **SUMMARIES),
        1e-4,
    )
    assert taken["whole"] and taken["run"]
