"""What patterns cost without eager and over long contexts, on SmolLM2-135M (fp32, CPU).

    python benchmarks/capture_patterns.py rebuild [--tokens 1024] [--repeats 3]
    python benchmarks/capture_patterns.py memory [--lengths 4096 8192]

`rebuild`: one layer's probabilities at 1024 tokens, rebuilt on an sdpa model (`rebuild_patterns=True`), against a
plain sdpa forward (target: within 1.10x) and against reloading the model with eager attention to read them.
Times are medians of `--repeats` runs in one process, after a warm-up, as wall time and as the process's CPU time.

`memory`: peak resident memory and time of a plain sdpa forward, of the last row of every layer's pattern, and of
one layer's full pattern, at each length (target: the last rows at 8k within 1.2x of the plain forward's peak). Each
measurement runs in a fresh subprocess, so one run's allocations cannot hide another's peak: the model is loaded, a
short warm-up forward runs, then a sampling thread records the resident set every millisecond during the run. Peaks
are reported as the whole process's and as the rise above the loaded model's level; `ru_maxrss` (the kernel's
lifetime peak, which also covers loading) is printed beside them as a check.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from peak_memory import PeakMemory

import attnlens
from attnlens import models

LAYER = 10


def ids_of(length: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))


RUNS = {
    "plain sdpa forward": lambda model, ids: model._module(ids),
    "last row, every layer": lambda model, ids: attnlens.capture_attention(
        model, ids, range(model.num_layers), keep="probs", rows=-1
    ),
    f"layer {LAYER} full pattern": lambda model, ids: attnlens.capture_attention(model, ids, LAYER, keep="probs"),
}


def one(run: str, length: int) -> dict:
    """One measurement, in this (fresh) process."""
    torch.set_grad_enabled(False)
    model = models.smollm2(attn_implementation="sdpa", rebuild_patterns=True)
    RUNS[run](model, ids_of(16, model.config.vocab_size))  # warm-up: instrumentation, allocator
    ids = ids_of(length, model.config.vocab_size)
    with PeakMemory() as memory:
        start = time.perf_counter()
        result = RUNS[run](model, ids)
        seconds = time.perf_counter() - start
    del result
    return {
        "run": run,
        "tokens": length,
        "seconds": seconds,
        "peak_mib": memory.high / 2**20,
        "rise_mib": (memory.high - memory.start) / 2**20,
        "loaded_mib": memory.start / 2**20,
        "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10,
    }


def memory(lengths: list[int]) -> None:
    print(f"SmolLM2-135M fp32, torch {torch.__version__}, {torch.get_num_threads()} threads; one fresh process per row")
    print(
        f"{'tokens':>6}  {'run':<26}{'s':>8}{'peak MiB':>10}{'x plain':>9}{'rise MiB':>10}{'x plain':>9}{'maxrss':>8}"
    )
    for length in lengths:
        rows = {}
        for run in RUNS:
            out = subprocess.run(
                [sys.executable, __file__, "one", run, str(length)],
                capture_output=True,
                text=True,
                env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
            )
            if out.returncode:
                print(out.stderr[-2000:])
                raise SystemExit(out.returncode)
            rows[run] = json.loads(out.stdout.strip().splitlines()[-1])
        plain = rows["plain sdpa forward"]
        for run, row in rows.items():
            print(
                f"{length:>6}  {run:<26}{row['seconds']:>8.1f}{row['peak_mib']:>10.0f}"
                f"{row['peak_mib'] / plain['peak_mib']:>9.2f}{row['rise_mib']:>10.0f}"
                f"{row['rise_mib'] / plain['rise_mib']:>9.2f}{row['ru_maxrss_mib']:>8.0f}",
                flush=True,
            )


def timed(fn, repeats: int) -> tuple[float, float]:
    """Median wall and CPU seconds after a warm-up; CPU time is the steadier of the two on a shared machine."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def rebuild(tokens: int, repeats: int) -> None:
    torch.set_grad_enabled(False)
    model = models.smollm2(attn_implementation="sdpa", rebuild_patterns=True)
    ids = ids_of(tokens, model.config.vocab_size)
    attn = model.layers[LAYER].self_attn

    def traced():
        with model.trace(ids):
            probs = attn.attention_probabilities.save()
        return probs

    def reload_eager():
        eager = models.smollm2(attn_implementation="eager")
        return attnlens.capture_attention(eager, ids, LAYER, keep="probs")

    eager = models.smollm2(attn_implementation="eager")
    rows = {
        "plain sdpa forward": timed(lambda: model._module(ids), repeats),
        f"rebuilt: capture_attention, layer {LAYER}": timed(
            lambda: attnlens.capture_attention(model, ids, LAYER, keep="probs"), repeats
        ),
        f"rebuilt: trace reading layer {LAYER}": timed(traced, repeats),
        "eager, already loaded: capture": timed(
            lambda: attnlens.capture_attention(eager, ids, LAYER, keep="probs"), repeats
        ),
        "reload eager, then capture": timed(reload_eager, repeats),
    }
    plain_wall, plain_cpu = rows["plain sdpa forward"]
    print(
        f"SmolLM2-135M fp32, {tokens} tokens, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {repeats}"
    )
    print(f"{'run':<44}{'wall ms':>9}{'x plain':>9}{'cpu ms':>9}{'x plain':>9}")
    for name, (wall, cpu) in rows.items():
        print(f"{name:<44}{wall * 1000:>9.0f}{wall / plain_wall:>9.2f}{cpu * 1000:>9.0f}{cpu / plain_cpu:>9.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="part", required=True)
    r = sub.add_parser("rebuild")
    r.add_argument("--tokens", type=int, default=1024)
    r.add_argument("--repeats", type=int, default=3)
    m = sub.add_parser("memory")
    m.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    o = sub.add_parser("one")  # internal: one memory measurement, printed as JSON
    o.add_argument("run")
    o.add_argument("tokens", type=int)
    args = parser.parse_args()
    if args.part == "rebuild":
        rebuild(args.tokens, args.repeats)
    elif args.part == "memory":
        memory(args.lengths)
    else:
        print(json.dumps(one(args.run, args.tokens)))


if __name__ == "__main__":
    main()
