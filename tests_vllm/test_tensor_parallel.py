"""Tensor parallelism on two CPU ranks (vLLM's `mp` executor, one core each): values, edits, static captures and
patterns, checked against the transformers engine on the same weights or recomputed by hand. Marked `ranks`: the suite
runs these after the rest, alone, so each rank has its core."""

import os

import pytest
import torch
from conftest import engine_args, pair
from test_equal_to_eager import close, compare, plan, read_steps
from vllm import envs

import attnlens
from attnlens.vllm import static

pytestmark = pytest.mark.ranks

STATIC = ["query.1", "attn_probs.1", "value.1", "z.1"]


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    llama = pair("llama", tmp_path_factory)  # 4 query heads, 2 key/value heads: both divide over two ranks
    return two_ranks(llama.path, STATIC), llama


def two_ranks(path, static_points: list[str]) -> attnlens.StandardizedVLLM:
    """An engine on two tensor-parallel CPU ranks (the `mp` executor) with `static_points`."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank; vLLM refuses to guess on one NUMA node
    envs.disable_envs_cache()  # vLLM froze its environment when the first engine started
    try:
        return attnlens.StandardizedVLLM(
            str(path),
            tensor_parallel_size=2,
            static_points=static_points,
            **{**engine_args(128, 16 * 2**20), "distributed_executor_backend": "mp"},
        )
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def assert_static_patterns_equal(model, eager, prompts: list[str], points: list[str]) -> None:
    """Every step's pattern at `points` (`attn_probs.L`) of each prompt's static capture on `model`, three greedy
    tokens, equals the transformers engine's on the same tokens."""
    for result in model.static_generate(prompts, max_new_tokens=3, do_sample=False):
        ids = torch.tensor(list(result.output.prompt_token_ids) + list(result.output.outputs[0].token_ids[:-1]))
        want = attnlens.run_with_cache(eager, ids, points)
        p = len(result.output.prompt_token_ids)
        for step, got in enumerate(result.steps):
            rows = slice(0, p) if step == 0 else slice(p + step - 1, p + step)
            for point in points:
                assert close(got[point], want[point][:, :, rows, : p + step]), (point, step)


def test_tensor_parallel_values_equal_eager_on_prefill_and_decode_steps(tp):
    model, llama = tp
    reads = plan(model, range(model.num_layers))
    on_tp, on_eager = read_steps(model, llama.prompt, reads), read_steps(llama.eager, llama.prompt, reads)
    compare(on_tp, on_eager, name="tensor parallel")
    assert model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}] * 2


@pytest.mark.parametrize(
    "edit",
    [
        lambda attn: attn.attention_head_outputs.__setitem__((slice(None), slice(None), 3), 0),  # a head of rank 1
        lambda attn: setattr(attn, "attention_queries", attn.attention_queries * 0),
        lambda attn: attn.attention_probabilities[:, 2].__setitem__(slice(None), 0),  # recomputed from kept values
    ],
    ids=["ablate head 3", "zero the queries", "zero head 2's pattern"],
)
def test_tensor_parallel_edits_land_on_the_right_rank(tp, edit):
    model, llama = tp

    def logits(engine, with_edit):
        attn = engine.layers[1].self_attn
        with torch.no_grad(), engine.trace(llama.prompt, max_new_tokens=1, do_sample=False):
            if with_edit:
                edit(attn)
            out = engine.logits[:, -1].clone().save()
        return out

    edited = logits(model, True)
    assert not close(edited, logits(model, False))
    assert close(edited, logits(llama.eager, True))


def _decoding_after_a_batched_read(model, prompt, at_the_decode_step):
    """Two requests decoding at layer 1: the first reads its pattern at both steps, so its read scores both requests'
    decode steps' patterns in one batch (`WorkerValues._score_ahead`); `at_the_decode_step(attn)` then runs in the
    second request's trace at its decode step, and what it returns comes back."""
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.generate(max_new_tokens=2, do_sample=False) as tracer:
        with tracer.invoke("Hi there"):
            for _ in tracer.iter[:2]:
                attn.attention_probabilities.sum()  # read first: both requests' decode steps scored ahead
        with tracer.invoke(prompt):
            saved = list().save()
            for step in tracer.iter[:2]:
                if step == 1:
                    saved.append(at_the_decode_step(attn))
    return saved[0]


def decode_row_pattern(queries, keys, heads):
    """One decode row's pattern recomputed by hand: it sees every key."""
    return (queries @ keys.repeat_interleave(heads.groups, 1).transpose(2, 3) * heads.scale).softmax(-1)


def test_tensor_parallel_key_edit_on_one_rank_after_a_batched_read_equals_recomputing(tp):
    """After a batched read, the second request changes this step's key of key/value head 1, which only rank 1 holds,
    and reads its pattern. The ranks must agree on rescoring it (that gathers the keys: a collective), and its pattern
    is the softmax of its queries against the edited keys, recomputed here by hand."""
    model, llama = tp
    heads = model.access.geometry(1)
    groups = heads.groups

    def edit_a_key(attn):
        keys = attn.attention_keys.clone()
        keys[:, 1, -1] += 1.0
        attn.attention_keys = keys
        return attn.attention_queries.clone(), keys, attn.attention_probabilities.clone()

    queries, keys, pattern = _decoding_after_a_batched_read(model, llama.prompt, edit_a_key)
    unedited = keys.clone()
    unedited[:, 1, -1] -= 1.0
    before = decode_row_pattern(queries, unedited, heads)
    assert close(pattern, decode_row_pattern(queries, keys, heads))
    assert close(pattern[:, :groups], before[:, :groups])  # rank 0's heads: as before the edit
    assert not close(pattern[:, groups:], before[:, groups:])  # rank 1's: moved by it


def test_tensor_parallel_in_place_query_edit_changing_one_ranks_numbers_equals_recomputing(tp):
    """After a batched read, the second request clips its queries in place at the kernel's own argument, at a
    threshold between the two ranks' largest query: the same write on both ranks, but only one rank's numbers change.
    Both ranks must still choose alike to rescore (the choice follows the write, not the numbers; rescoring gathers,
    a collective), and the pattern is the softmax of the clipped queries against the keys, recomputed here by hand."""
    model, llama = tp
    heads = model.access.geometry(1)
    half = heads.num_heads // 2

    def clip_the_queries(attn):
        before = attn.attention_queries.clone()  # every rank's heads
        threshold = (before[:, :half].max() + before[:, half:].max()) / 2
        attn.attn.inputs[0][0].clamp_(max=threshold)  # this rank's heads, in place
        return before, attn.attention_queries.clone(), attn.attention_keys.clone(), attn.attention_probabilities.clone()

    before, queries, keys, pattern = _decoding_after_a_batched_read(model, llama.prompt, clip_the_queries)
    moved = [
        not torch.equal(before[:, rank * half : (rank + 1) * half], queries[:, rank * half : (rank + 1) * half])
        for rank in (0, 1)
    ]
    assert sorted(moved) == [False, True]  # the write changed one rank's numbers only
    assert close(pattern, decode_row_pattern(queries, keys, heads))
    assert not close(pattern, decode_row_pattern(before, keys, heads))


def test_tensor_parallel_static_captures_equal_eager(tp):
    model, llama = tp
    result = model.static_generate(llama.prompt, max_new_tokens=3, do_sample=False)
    ids = torch.tensor(list(result.output.prompt_token_ids) + list(result.output.outputs[0].token_ids[:-1]))
    want = attnlens.run_with_cache(llama.eager, ids, STATIC)
    p = len(result.output.prompt_token_ids)
    for step, got in enumerate(result.steps):
        rows = slice(0, p) if step == 0 else slice(p + step - 1, p + step)
        end = p + step
        assert close(got["query.1"], want["query.1"][:, :, rows])
        assert close(got["value.1"], want["value.1"][:, :, :end])
        assert close(got["attn_probs.1"], want["attn_probs.1"][:, :, rows, :end])
        assert close(got["z.1"], want["z.1"][:, rows])


def test_tensor_parallel_ranks_hold_their_own_heads_of_a_pattern_until_taken(tp):
    """Each rank keeps the pattern of its own heads (no step waits on a collective for it); taking joins them in
    rank order (the test above checks the joined pattern against eager's)."""
    from vllm import SamplingParams

    model, llama = tp
    take = lambda: model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(None,))  # noqa: E731
    take()  # what earlier tests' traces left (the engine records every request)
    model.vllm_entrypoint.generate([llama.prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    per_rank = take()
    assert len(per_rank) == 2 and per_rank[0].keys() == per_rank[1].keys() and len(per_rank[0]) == 1
    held = {step["attn_probs.1"].shape[1] for rank in per_rank for found in rank.values() for step in found["steps"]}
    assert held == {2}  # four query heads, two a rank
    queries = {rank[tag]["steps"][0]["query.1"].shape[1] for rank in per_rank for tag in rank}
    assert queries == {4}  # captured queries are gathered: every rank holds them whole
    second = {tag: [step["attn_probs.1"] for step in found["steps"]] for tag, found in per_rank[1].items()}
    for tag, found in static.joined(per_rank).items():
        for step, theirs in zip(found["steps"], second[tag], strict=True):
            assert step["attn_probs.1"].shape[1] == 4 and torch.equal(step["attn_probs.1"][:, 2:], theirs)


def test_tensor_parallel_patterns_of_replicated_key_heads_batched_equal_eager(tmp_path):
    """One key/value head on two ranks (each holds it whole, so it is not gathered: `gather_heads`), four query heads
    split over them, decode steps of several requests scored in one batch from the cache's blocks (`_decoded`): every
    pattern equals the transformers engine's."""
    attnlens.models.tiny_model("llama", head_dim=32, num_key_value_heads=1).save_pretrained(tmp_path)
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    eager = attnlens.StandardizedTransformer(str(tmp_path), attn_implementation="eager")
    model = two_ranks(tmp_path, ["attn_probs.1"])
    prompts = ["Hello world, again and again", "Hi", "The cat sat on the mat"]
    assert_static_patterns_equal(model, eager, prompts, ["attn_probs.1"])


def test_tensor_parallel_batched_patterns_of_several_key_heads_per_rank_equal_eager(tmp_path):
    """Eight query and four key/value heads on two ranks, two of each key/value head's per rank; the keys captured
    too, so decode steps are scored from the gathered rows in one left-padded batch (`_patterns`), each rank on its
    own heads: every pattern equals the transformers engine's."""
    attnlens.models.tiny_model("llama", num_attention_heads=8, num_key_value_heads=4, head_dim=32).save_pretrained(
        tmp_path
    )
    attnlens.models.char_tokenizer().save_pretrained(tmp_path)
    eager = attnlens.StandardizedTransformer(str(tmp_path), attn_implementation="eager")
    model = two_ranks(tmp_path, ["attn_probs.1", "key.1"])
    prompts = ["Hello world, again and again", "Hi", "The cat sat on the mat"]
    assert_static_patterns_equal(model, eager, prompts, ["attn_probs.1"])


@pytest.mark.parametrize("name", ["mistral", "granite_swa"])
def test_tensor_parallel_patterns_of_windowed_layers_equal_eager(tmp_path_factory, name):
    """Sliding-window layers on two ranks (four query heads, two key/value heads): Mistral's, each rank scoring its own
    heads and gathering the patterns; Granite SWA's, whose kernel also holds a sink logit per head, scored on every
    head after the queries and keys are gathered. Every step's pattern of two requests on two layers (Granite's
    second a full one) equals the transformers engine's."""
    model_pair = pair(name, tmp_path_factory)
    points = ["attn_probs.0", "attn_probs.1"]
    model = two_ranks(model_pair.path, points)
    assert_static_patterns_equal(model, model_pair.eager, [model_pair.prompt, "Hi there"], points)


def test_a_trace_on_a_compiled_engine_over_two_ranks_equals_eager(tp):
    """On two ranks the compiled engine hands each rank's heads of the kernel's arguments to the trace
    (`worker.hand_off_at_kernel`), which joins them as on the eager engine: every layer's queries, keys, values and
    pattern on the prefill and two decode steps equal the two-rank eager engine's."""
    eager, llama = tp
    model = two_ranks(llama.path, ["query.1"])
    assert model.compiled and not eager.compiled
    names = ("attention_queries", "attention_keys", "attention_values", "attention_probabilities")

    def steps(engine):
        with torch.no_grad(), engine.trace(llama.prompt, max_tokens=3, temperature=0.0, ignore_eos=True) as tracer:
            saved = list().save()
            for _ in tracer.iter[:3]:
                saved.append([getattr(block.self_attn, name).clone() for block in engine.layers for name in names])
        return saved

    for step, (got, want) in enumerate(zip(steps(model), steps(eager), strict=True)):
        for index, (a, b) in enumerate(zip(got, want, strict=True)):
            assert close(a, b), (step, index)
