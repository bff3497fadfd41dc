"""`attnlens.collect` on vLLM: features reduced inside vLLM's worker (in a trace, or at the attention op from static
taps on an engine at vLLM's defaults: compiled, prefix caching, chunked prefill) equal the eager engine's on the same
weights, and the same collection on a local Ray cluster of two CPU workers (one engine each) gives the one-process
table."""

import json
import os

import pytest
import torch
from conftest import engine_args

import attnlens
from attnlens.collect import FEATURES, read_table
from attnlens.collect.collector import Collector
from attnlens.collect.inworker import points_for, servable

PROMPTS = [
    "Hello world, again",
    "Hi",
    "The cat sat on the mat",
    "x",
    "A longer prompt, past the windows of four",
    "",
    "y" * 200,
    "Short prompt",
]
ERRORS = {5: "empty", 6: "too_long"}  # 200 tokens: past both engines' contexts (127 + 1 sampled; 128 positions)
ROWS = [-1, 0, 2]
#: span_mass's token ranges and lookback's context (every token but the last two), as tests/test_collect.py
SPANS, CONTEXT = [[0, 1], [1, -1], [-3, None]], -2
TOLERANCE = dict(atol=1e-4, rtol=1e-4)  # float32, as the rest of tests_vllm
SORT = [("prompt", "ascending"), ("layer", "ascending"), ("head", "ascending")]
#: The features reduced at the attention op, without a trace (all but head_output_norm and head_attribution)
REDUCED = [name for name, feature in FEATURES.items() if servable([feature])]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return path


@pytest.fixture(scope="module")
def on_vllm(llama, corpus, tmp_path_factory):
    """The one-process collection on vLLM (shared by the Ray test)."""
    out = tmp_path_factory.mktemp("vllm") / "out"
    result = attnlens.collect(
        llama.vllm, corpus, "all", out, rows=ROWS, top_k=3, shard_size=3, batch_size=2, progress=False,
        spans=SPANS, context=CONTEXT,
    )  # fmt: skip
    return result


@pytest.fixture(scope="module")
def reduced_on_vllm(llama, corpus, tmp_path_factory):
    """The attention-op features collected in one process, reduced in the worker of an engine built for traces (no
    static points: the reducer taps the kernels when it is installed)."""
    out = tmp_path_factory.mktemp("reduced") / "out"
    assert Collector(llama.vllm, REDUCED).reduced and not llama.vllm.static_points
    options = dict(rows=ROWS, top_k=3, shard_size=3, progress=False, spans=SPANS, context=CONTEXT)
    return attnlens.collect(llama.vllm, corpus, REDUCED, out, **options)


def assert_tables_close(got, want):
    got, want = got.sort_by(SORT).to_pylist(), want.sort_by(SORT).to_pylist()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        for column, value in b.items():
            if isinstance(value, float):
                assert torch.allclose(torch.tensor(a[column]), torch.tensor(value), equal_nan=True, **TOLERANCE), (
                    column,
                    b["prompt"],
                    b["layer"],
                    b["head"],
                )
            elif column in ("pattern", "top_weights", "span_mass"):  # a list of floats per chosen row
                assert len(a[column]) == len(value), column
                for x, y in zip(a[column], value):
                    assert torch.allclose(torch.tensor(x), torch.tensor(y), **TOLERANCE), column
            elif column in ("attribution", "lookback"):  # a float per chosen row (lookback: nan where no later key)
                found, expected = torch.tensor(a[column]), torch.tensor(value)
                assert torch.allclose(found, expected, equal_nan=True, **TOLERANCE), column
            else:
                assert a[column] == value, (column, b["prompt"], b["layer"], b["head"])


def test_features_reduced_in_vllms_worker_equal_eager(llama, corpus, on_vllm, tmp_path):
    """Every feature, computed per request inside vLLM's worker (several requests per trace), equals the eager
    engine's collection on the same weights; the same prompts fail for the same reasons; nothing is kept after."""
    on_eager = attnlens.collect(
        llama.eager, corpus, "all", tmp_path / "eager", rows=ROWS, top_k=3, shard_size=3, progress=False,
        spans=SPANS, context=CONTEXT,
    )  # fmt: skip
    assert on_vllm.layers == on_eager.layers == [0, 1, 2]
    assert on_vllm.rows == on_eager.rows == (len(PROMPTS) - len(ERRORS)) * 3 * 4
    assert_tables_close(read_table(on_vllm.out), read_table(on_eager.out))
    for result in (on_vllm, on_eager):
        errors = read_table(result.out, "errors").to_pylist()
        assert {e["prompt"]: e["reason"] for e in errors} == ERRORS
    meta = json.loads((on_vllm.out / "collect.json").read_text())
    assert meta["engine"] == "vllm" and meta["dtype"] == "float32" and meta["context_limit"] == 127
    assert llama.vllm.kept() == [{"requests": 0, "bytes": 0, "traces": 0}]


@pytest.mark.ranks
def test_the_same_collection_on_a_local_ray_cluster_equals_one_process(llama, corpus, reduced_on_vllm, tmp_path):
    """A local Ray cluster of two CPU workers, one vLLM engine each (built by collect with static taps: reduced at the
    attention op), started and stopped here: the table equals the one-process traced table, and the folder's
    identity is the same run (so either can continue the other)."""
    on_vllm = reduced_on_vllm
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, object_store_memory=100 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        assert ray.cluster_resources()["CPU"] == 2
        result = attnlens.collect(
            str(llama.path),
            corpus,
            REDUCED,
            tmp_path / "ray",
            rows=ROWS,
            top_k=3,
            spans=SPANS,
            context=CONTEXT,
            shard_size=3,
            batch_size=2,
            engine="vllm",
            engine_args={**engine_args(128, 16 * 2**20), "enforce_eager": True},  # eager: no compile per worker
            workers=2,
            progress=False,
        )
    finally:
        ray.shutdown()
    assert result.prompts == len(PROMPTS) and result.errors == len(ERRORS) and result.shards == 3
    assert_tables_close(read_table(result.out), read_table(on_vllm.out))
    assert (
        read_table(result.out, "errors").sort_by("prompt").to_pylist()
        == read_table(on_vllm.out, "errors").sort_by("prompt").to_pylist()
    )
    identity = dict(json.loads((result.out / "collect.json").read_text()).items())
    assert identity == json.loads((on_vllm.out / "collect.json").read_text())


PREFIX = "Once upon a time, in a land far away, there lived a small dragon who loved to read. "  # 85 tokens


def test_features_reduced_at_the_attention_op_under_vllms_defaults_equal_eager(llama, tmp_path):
    """Static taps at the attention op, reduced there: plain requests, a batch per `generate`, on the compiled engine
    with prefix caching and 32-token chunks. A prompt split in chunks and one whose prefix an earlier batch cached
    give the eager engine's features (the prefix is cached: a static request afterwards starts past it)."""
    assert "head_output_norm" not in REDUCED and {"entropy", "top_keys", "pattern", "value_norm"} <= set(REDUCED)
    model = attnlens.StandardizedVLLM(
        str(llama.path),
        static_points=points_for([FEATURES[name] for name in REDUCED]),
        block_size=32,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        **engine_args(128, 16 * 2**20),
    )
    config = model.vllm_entrypoint.llm_engine.vllm_config
    assert model.compiled and config.cache_config.enable_prefix_caching
    assert config.scheduler_config.enable_chunked_prefill
    assert Collector(model, REDUCED).reduced
    path = tmp_path / "corpus.jsonl"
    texts = [*PROMPTS[:4], PREFIX + "sang.", *PROMPTS[4:], PREFIX + "slept all day."]  # one in each window
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    options = dict(rows=ROWS, top_k=3, shard_size=5, progress=False, spans=SPANS, context=CONTEXT)
    reduced = attnlens.collect(model, path, REDUCED, tmp_path / "reduced", batch_size=4, **options)
    eager = attnlens.collect(llama.eager, path, REDUCED, tmp_path / "eager", **options)
    assert reduced.rows == eager.rows == (len(texts) - len(ERRORS)) * 3 * 4
    assert_tables_close(read_table(reduced.out), read_table(eager.out))
    errors = read_table(reduced.out, "errors").to_pylist()
    assert {e["prompt"]: e["reason"] for e in errors} == {prompt + 1: reason for prompt, reason in ERRORS.items()}
    (again,) = model.static_generate([PREFIX + "ran."], max_new_tokens=1, do_sample=False)
    assert again.positions[0] == 64  # vLLM cached the prefix; collect's requests read every row regardless
    taken = model.vllm_entrypoint.collective_rpc("attnlens_static_take", args=(None,))[0]
    assert taken == {}  # nothing of collect's requests is left in the worker
    with pytest.raises(attnlens.Unavailable, match="head_output_norm"):
        Collector(model, ["entropy", "head_output_norm"])


@pytest.mark.ranks
@pytest.mark.parametrize(("name", "local"), [("llama", True), ("gptj", False)])
def test_reduced_on_two_tensor_parallel_ranks_equals_eager(name, local, corpus, tmp_path_factory, tmp_path):
    """Two CPU ranks (the `mp` executor). Llama scores the common layout's way: each rank reduces its own heads and
    the client joins them. GPT-J's family scores its own way (float32 products, the mask in the model's dtype): every
    rank gathers the heads and rank 0 reduces. Either table equals the eager engine's, and so do head summaries."""
    from conftest import pair
    from vllm import envs

    from attnlens.collect.collector import load

    models = pair(name, tmp_path_factory)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank; vLLM refuses to guess on one NUMA node
    envs.disable_envs_cache()
    args = {**engine_args(128, 16 * 2**20), "distributed_executor_backend": "mp", "tensor_parallel_size": 2}
    try:
        model = load(str(models.path), "vllm", {**args, "enforce_eager": True}, REDUCED)  # eager: no compile per rank
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    try:
        assert Collector(model, REDUCED).reduced
        options = dict(rows=ROWS, top_k=3, progress=False, spans=SPANS, context=CONTEXT)
        result = attnlens.collect(model, corpus, REDUCED, tmp_path / "tp", **options)
        assert model.vllm_entrypoint.collective_rpc(_reduces_own_heads) == [local, local]
        errors = read_table(result.out, "errors").to_pylist()
        assert {e["prompt"]: e["reason"] for e in errors} == ERRORS, errors
        eager = attnlens.collect(models.eager, corpus, REDUCED, tmp_path / "eager", **options)
        assert_tables_close(read_table(result.out), read_table(eager.out))
        # head summaries take the same reducer: per-head sums and row counts, joined across the ranks the same way
        summaries = dict(length=12, sequences=3, top_k=2, progress=False)
        got, want = (attnlens.head_summaries(m, [models.prompt], **summaries) for m in (model, models.eager))
        assert got.metrics == want.metrics
        for metric in want.metrics:
            for layer in want.layers:
                assert torch.allclose(got.get(metric, layer), want.get(metric, layer), **TOLERANCE), (metric, layer)
    finally:
        model.vllm_entrypoint.llm_engine.engine_core.shutdown()


def _reduces_own_heads(worker) -> bool:
    return worker.model_runner.attnlens_static.reduce.local
