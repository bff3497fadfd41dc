"""What collecting head features over a corpus costs against plain vLLM prefilling the same corpus, in one run.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/collect.py [--prompts 1000] [--features entropy,sink,...]
        [--repeats 1] [--tensor-parallel-size 2]

On SmolLM2-135M float32 and a JSONL corpus of `--prompts` prompts of mixed lengths (8 to 400 words, seeded, a long
tail): plain vLLM (`vllm.LLM` at its default settings: compiled, prefix caching, chunked prefill), one token per
prompt, every prompt in one `generate` call, its prefix cache emptied before each round (a round must not be
served the blocks of the same corpus the round before cached); and `attnlens.collect` from the checkpoint folder with
the default features (entropy, sink, previous-token weight, top-5 keys of the last row on every layer and head),
which builds its engine at the same defaults with static taps at the attention op and reduces there, Parquet
included. The two
alternate, `--repeats` times each, best of each reported. The resident memory of the process (and of its engine's
worker processes, under tensor parallelism) is sampled every 0.1 s during each collection, with the number of shards
committed, so a growth per prompt would show as memory rising with the shards.

`--tensor-parallel-size 2` runs both engines on two ranks (the `mp` executor, one core each). SmolLM2's 9 query heads
do not divide by 2, so that run uses a checkpoint of SmolLM2's shape with 8 query and 2 key/value heads of 64
(random weights, SmolLM2's tokenizer): what is measured is the cost, not the model.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

import psutil

import attnlens
from attnlens.collect import DEFAULT_FEATURES

ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=512 * 2**20, seed=0)
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "his",
    "her",
    "it",
    "an",
    "were",
    "which",
    "are",
    "this",
    "be",
    "has",
    "had",
    "attention",
    "head",
    "model",
    "layer",
    "token",
    "corpus",
    "river",
    "mountain",
    "city",
    "music",
    "history",
    "language",
    "science",
    "garden",
    "winter",
    "market",
    "story",
    "letter",
    "window",
    "morning",
]


def corpus(path: Path, count: int, seed: int = 0) -> list[str]:
    """`count` prompts of 8 to 400 words, mostly short (a long tail, as real corpora have)."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        length = min(400, max(8, int(rng.lognormvariate(4.0, 0.8))))
        texts.append(" ".join(rng.choice(WORDS) for _ in range(length)))
    with open(path, "w") as file:
        for i, text in enumerate(texts):
            file.write(json.dumps({"id": i, "text": text}) + "\n")
    return texts


def tensor_parallel_checkpoint(folder: Path) -> str:
    """SmolLM2's shape (30 layers, hidden 576) with 8 query and 2 key/value heads of 64, random weights."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    path = str(attnlens.models.smollm2_path())
    config = AutoConfig.from_pretrained(path)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 2, 64
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(path).save_pretrained(folder)
    return str(folder)


class Memory:
    """Resident memory of this process and its children (the engine's ranks), sampled every 0.1 s, with the number of
    shards in `folder` at each sample."""

    def __init__(self, folder: Path):
        self.folder, self.samples, self._stop = folder, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        process = psutil.Process()
        while not self._stop.wait(0.1):
            shards = len(list((self.folder / "data").glob("part-*.parquet"))) if (self.folder / "data").exists() else 0
            rss = process.memory_info().rss
            for child in process.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # a rank that just exited
                    rss += child.memory_info().rss
            self.samples.append((shards, rss))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def report(self) -> str:
        by_shard: dict[int, int] = {}
        for shards, rss in self.samples:
            by_shard[shards] = max(by_shard.get(shards, 0), rss)
        first = [rss for shards, rss in self.samples if shards >= 1] or [0]
        peak = max(rss for _, rss in self.samples)
        return (
            f"peak RSS {peak / 2**20:.0f} MiB; after the first shard {min(first) / 2**20:.0f}-"
            f"{max(first) / 2**20:.0f} MiB; per shard committed (MiB): "
            + " ".join(f"{by_shard[k] / 2**20:.0f}" for k in sorted(by_shard))
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--features", default=",".join(DEFAULT_FEATURES))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--shard-size", type=int, default=100)
    parser.add_argument("--tensor-parallel-size", type=int, default=1, choices=(1, 2))
    args = parser.parse_args()

    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="attnlens-bench-"))
    engine = dict(ENGINE, distributed_executor_backend="uni")
    if args.tensor_parallel_size == 2:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        path = tensor_parallel_checkpoint(work / "checkpoint")
        engine = dict(ENGINE, tensor_parallel_size=2, distributed_executor_backend="mp")
        model_name = "SmolLM2-135M's shape with 8/2 heads (random weights)"
    else:
        path = str(attnlens.models.smollm2_path())
        model_name = "SmolLM2-135M"
    texts = corpus(work / "corpus.jsonl", args.prompts)
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = [tokenizer(text)["input_ids"] for text in texts]
    tokens = sum(len(i) for i in ids)
    print(f"{len(ids)} prompts, {tokens} tokens ({min(map(len, ids))}-{max(map(len, ids))} per prompt)", flush=True)
    print(f"load average at the start: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)

    from attnlens.collect.collector import load

    llm = LLM(path, **engine)
    features = args.features.split(",")
    model = load(path, "vllm", engine, features)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [{"prompt_token_ids": i} for i in ids]
    memory: list[Memory] = []

    def plain():
        # every round prefills the whole corpus: what an earlier round left in the prefix cache is dropped first
        # (collect's requests never read it)
        llm.reset_prefix_cache()
        llm.generate(prompts, one, use_tqdm=False)

    def collected():
        out = work / "out"
        shutil.rmtree(out, ignore_errors=True)
        with Memory(out) as sampled:
            result = attnlens.collect(
                model, work / "corpus.jsonl", features, out, shard_size=args.shard_size, progress=False
            )
        memory.append(sampled)
        assert result.prompts == len(ids) and result.errors == 0, result

    collect_name = f"attnlens.collect ({args.features})"
    runs = {"plain vLLM, defaults": plain, collect_name: collected}
    llm.generate(prompts[:16], one, use_tqdm=False)  # warm-up: compilation, first requests
    warm = work / "warm.jsonl"
    warm.write_text("".join((work / "corpus.jsonl").read_text().splitlines(keepends=True)[:16]))
    attnlens.collect(model, warm, features, work / "warm", progress=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            print(f"  {name}: {times[name][-1]:.2f} s", flush=True)
    base = min(times["plain vLLM, defaults"])
    ranks = "one process" if args.tensor_parallel_size == 1 else "two tensor-parallel ranks"
    print(f"\n{model_name} float32, {len(ids)} prompts, {tokens} tokens, {ranks}, best of {args.repeats}:")
    for name, t in times.items():
        best = min(t)
        print(f"  {name:<60} {best:7.2f} s  {tokens / best:7.0f} tokens/s  {base / best:.2f}x of plain vLLM")
    print("  memory during the last collection: " + memory[-1].report())
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
