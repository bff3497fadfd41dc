"""The same collection on Ray: one engine per Ray worker (an actor), windows handed out by the driver, which alone
writes the store.

nnsight runs a trace's body inside vLLM's worker, and attnlens's integration needs that worker in the process that
submits the trace (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so each Ray actor holds one whole
in-process engine: data parallelism, one model copy per worker. vLLM's own Ray executor would spread one engine's
ranks over Ray workers for model parallelism; a trace body would then have to be shipped to each remote rank, which
is outside what nnsight's worker model does, and tensor parallelism inside one node already works with the `mp`
executor (pass `engine_args`). The commit protocol (store.py) stays with the driver: workers return a window's
columns, the driver commits them as one shard, so a killed driver restarts exactly once as in one process, and a
lost worker only loses windows that were never committed.
"""

from __future__ import annotations

import os
from collections import deque

#: Environment each worker's engine needs before vLLM is imported.
WORKER_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
#: Windows in flight per worker: one computing, one queued, so a worker never waits for the driver.
IN_FLIGHT = 2


class _Worker:
    """One Ray actor: loads the checkpoint itself (each worker its own engine) and computes windows."""

    def __init__(self, folder: str, engine: str, engine_args: dict | None, options: dict):
        os.environ.update(WORKER_ENV)
        from .collector import Collector, load

        self.collector = Collector(load(folder, engine, engine_args, options["features"], options["layers"]), **options)

    def describe(self) -> dict:
        c = self.collector
        return {"identity": c.identity(), "columns": c.columns, "layers": c.layers, "skipped": c.skipped}

    def window(self, records):
        return self.collector.window(records)


class RayPool:
    """`workers` actors, each with `cpus` CPUs (and `gpus` GPUs), on the Ray cluster `ray.init` finds (a running
    local or remote one, `RAY_ADDRESS`; or a new local one)."""

    def __init__(
        self,
        folder: str,
        engine: str,
        engine_args: dict | None,
        options: dict,
        workers: int,
        *,
        cpus: float = 1,
        gpus: float = 0,
    ):
        try:
            import ray
        except ModuleNotFoundError:
            raise ModuleNotFoundError("collect(workers=...) needs Ray: pip install 'ray[data]'") from None
        if workers < 1:
            raise ValueError(f"workers must be at least 1; got {workers}")
        self.ray = ray
        if not ray.is_initialized():
            ray.init(runtime_env={"env_vars": WORKER_ENV})
        actor = ray.remote(num_cpus=cpus, num_gpus=gpus)(_Worker)
        env = {
            "env_vars": {
                **WORKER_ENV,
                **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {}),
            }
        }
        self.actors = [
            actor.options(runtime_env=env).remote(folder, engine, engine_args, options) for _ in range(workers)
        ]
        described = ray.get([a.describe.remote() for a in self.actors])
        first = described[0]
        for other in described[1:]:
            if other["identity"] != first["identity"]:
                raise RuntimeError(
                    "collect on Ray: the workers loaded different models or settings: "
                    f"{first['identity']} and {other['identity']}"
                )
        self.identity, self.columns = first["identity"], first["columns"]
        self.layers, self.skipped = first["layers"], first["skipped"]

    def map(self, windows):
        """(window, its result) in completion order; at most `IN_FLIGHT` windows queued per worker."""
        pending: dict = {}
        idle = deque(self.actors * IN_FLIGHT)
        for window in windows:
            if not idle:
                yield self._one(pending, idle)
            actor = idle.popleft()
            pending[actor.window.remote(window)] = (window, actor)
        while pending:
            yield self._one(pending, idle)

    def _one(self, pending: dict, idle: deque):
        ready, _ = self.ray.wait(list(pending), num_returns=1)
        window, actor = pending.pop(ready[0])
        idle.append(actor)
        return window, self.ray.get(ready[0])

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor)
