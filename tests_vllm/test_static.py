"""The static backend: taps declared at load, captured on plain vLLM requests, equal to the transformers engine's
values."""

import pytest
import torch
from conftest import engine_args, pair

import attnlens

PROMPTS = ["Hello world, again", "Hi there", "The cat sat on"]
POINTS = ["query.1", "attn_scores.1", "attn_probs.1", "value.1", "key.2", "attn_probs.2", "z.2"]
STEPS = 4


@pytest.fixture(scope="module")
def static(tmp_path_factory):
    llama = pair("llama", tmp_path_factory)  # the session's transformers engine and checkpoint
    # at most two requests at once, so a later request's prefill can share a step with another's decode
    model = attnlens.StandardizedVLLM(
        str(llama.path), static_points=POINTS, max_num_seqs=2, **engine_args(128, 16 * 2**20)
    )
    results = model.static_generate(PROMPTS, max_new_tokens=STEPS, do_sample=False)
    return model, llama.eager, results


def close(a, b):
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-4 * max(1.0, b.abs().max().item()))


def check(eager, output, steps, points=POINTS):
    """Every step's captures equal the transformers engine's values on the whole sequence, sliced to that step."""
    prompt_ids = list(output.prompt_token_ids)
    ids = torch.tensor(prompt_ids + list(output.outputs[0].token_ids[:-1]))
    want = attnlens.run_with_cache(eager, ids, points)
    p = len(prompt_ids)
    assert len(steps) == len(output.outputs[0].token_ids)
    for step, got in enumerate(steps):
        rows = slice(0, p) if step == 0 else slice(p + step - 1, p + step)
        end = p + step
        assert set(got.keys()) == set(points)
        for key in points:
            short = key.rpartition(".")[0]
            full = want[key]
            if short == "query":
                expected = full[:, :, rows]
            elif short in ("key", "value"):
                expected = full[:, :, :end]
            elif short == "z":
                expected = full[:, rows]
            else:
                expected = full[:, :, rows, :end]
            if short == "attn_scores":
                visible = ~attnlens.masked(expected)
                assert got[key].shape == expected.shape and close(got[key][visible], expected[visible]), (step, key)
            else:
                assert close(got[key], expected), (step, key)


def test_static_captures_equal_eager_prefill_and_decode(static):
    _model, eager, results = static
    assert [len(r.steps) for r in results] == [STEPS] * len(PROMPTS)
    for result in results:
        check(eager, result.output, result.steps)


def test_plain_vllm_requests_in_mixed_steps(static):
    """Requests sent to vLLM directly, of different lengths: one's prefill shares a step with another's decode."""
    from vllm import SamplingParams

    model, eager, _ = static
    lengths = [2, 6, 4]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = model.vllm_entrypoint.generate(PROMPTS, params, use_tqdm=False)
    (taken,) = model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(None,))
    assert len(taken) == 3  # keyed by vLLM's request ids
    for output in outputs:
        steps = [
            v
            for k, v in taken.items()
            if k == output.request_id or output.request_id.startswith(k) or k.startswith(output.request_id)
        ]
        assert len(steps) == 1, (output.request_id, list(taken))
        check(eager, output, [attnlens.Cache(step) for step in steps[0]["steps"]])


def test_static_attention_joins_steps_like_capture_attention(static):
    _model, eager, results = static
    result = results[0]
    ids = torch.tensor(list(result.output.prompt_token_ids) + list(result.output.outputs[0].token_ids[:-1]))
    want = attnlens.capture_attention(eager, ids, [1])[1]
    got = result.attention(1)
    assert close(got["probs"], want["probs"]) and close(got["value"], want["value"])


def test_static_generation_matches_plain_vllm_and_frees_state(static, tmp_path_factory):
    model, _, results = static
    from vllm import SamplingParams

    plain = pair("llama", tmp_path_factory).vllm  # the same weights, no static points
    outputs = plain.vllm_entrypoint.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [list(r.output.outputs[0].token_ids) for r in results]
    stats = model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(None,))
    assert stats == [{}]  # everything static_generate ran was taken and freed


@pytest.mark.parametrize(
    ("points", "error", "words"),
    [
        (["attn_gate.1"], attnlens.Unavailable, "no output gate"),
        (["resid_post.1"], attnlens.Unavailable, "not a static tap"),
        (["attn_probs.9"], IndexError, "layer 9 is out of range"),
        (["probs.1"], KeyError, "not a cache name"),
    ],
)
def test_unavailable_or_unknown_taps_fail_at_load(tmp_path_factory, points, error, words):
    llama = pair("llama", tmp_path_factory)
    with pytest.raises(error, match=words):
        attnlens.StandardizedVLLM(str(llama.path), static_points=points, **engine_args(128, 16 * 2**20))


def test_static_generate_needs_declared_points(tmp_path_factory):
    with pytest.raises(RuntimeError, match="static_points"):
        pair("llama", tmp_path_factory).vllm.static_generate("Hi", max_new_tokens=1)


@pytest.mark.parametrize("name", ["gpt_neox", "gpt2"])
def test_static_captures_on_vllms_other_model_code(name, tmp_path_factory):
    """The Transformers backend (GPT-NeoX: its kernel's forward is called directly, skipping pre-hooks, and tokens
    keep a batch axis of one) and one of vLLM's own ports (GPT-2) capture what the transformers engine computes."""
    models = pair(name, tmp_path_factory)
    model = attnlens.StandardizedVLLM(str(models.path), static_points=POINTS, **engine_args(128, 16 * 2**20))
    result = model.static_generate(PROMPTS[:1], max_new_tokens=2, do_sample=False)[0]
    check(models.eager, result.output, result.steps)


@pytest.mark.parametrize(
    "points",
    [
        ["attn_scores.1", "attn_probs.1", "key.1", "query.1"],  # keys captured too: `_patterns` batches them
        ["attn_scores.1", "attn_probs.1"],  # the pattern alone: `_decoded` copies the keys from the cache's blocks
    ],
)
def test_decode_steps_of_many_requests_scored_in_one_batch_equal_eager(tmp_path_factory, points):
    """Decode steps of several requests of different lengths are scored together (their keys left-padded and masked),
    on a family with a sliding window (Mistral's tiny window of 4, so the padding, the window and the causal mask all
    meet): every request's scores, pattern and keys equal the transformers engine's."""
    mistral = pair("mistral", tmp_path_factory)
    model = attnlens.StandardizedVLLM(str(mistral.path), static_points=points, **engine_args(128, 16 * 2**20))
    prompts = ["Hello world, again and again", "Hi", "The cat sat on the mat", "x y"]
    results = model.static_generate(prompts, max_new_tokens=5, do_sample=False)
    for result in results:
        check(mistral.eager, result.output, result.steps, points)
