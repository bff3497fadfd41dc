"""What reading attention costs, on SmolLM2 in one process: ms and peak memory, as ratios to a plain sdpa forward.

    python benchmarks/attention_overhead.py [--lengths 128 1024] [--repeats 5]

Rows: a plain forward with sdpa, a plain forward with eager, and a trace that saves all eight attention values of
every layer (eager). Peak memory is the process's resident-set peak during the run above what it held before.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from peak_memory import PeakMemory

from attnlens import models


def attention_values(model) -> list[str]:
    """Every attention value the model serves (eight on SmolLM2, the KV cache's aside), in forward order."""
    keys = [key for key in model.order(0) if key.startswith("self_attn.") and "attention_cache_" not in key]
    return [key.split(".", 1)[1] for key in keys]


def plain(model, ids):
    model._module(ids)


def trace_all(model, ids):
    names = attention_values(model)
    with model.trace(ids):
        saved = list().save()
        for layer in model.layers:
            for name in names:
                saved.append(getattr(layer.self_attn, name))
    return saved


def measure(fn, repeats, *args):
    fn(*args)  # warm-up (instrumentation, allocator)
    times, peaks = [], []
    for _ in range(repeats):
        with PeakMemory() as memory:
            start = time.perf_counter()
            result = fn(*args)
            times.append(time.perf_counter() - start)
        del result
        peaks.append(memory.peak)
    return statistics.median(times) * 1000, max(peaks) / 2**20


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = models.smollm2(attn_implementation="eager")
    vocab = model.config.vocab_size
    print(f"SmolLM2-135M fp32, torch {torch.__version__}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'tokens':>6}  {'run':<34}{'ms':>9}{'x sdpa':>8}{'x eager':>9}{'peak MiB':>10}")
    for length in args.lengths:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
        rows = {}
        model._module.set_attn_implementation("sdpa")
        rows["plain forward, sdpa"] = measure(plain, args.repeats, model, ids)
        model._module.set_attn_implementation("eager")
        rows["plain forward, eager"] = measure(plain, args.repeats, model, ids)
        read = f"trace saving {len(attention_values(model))} values x {model.num_layers} layers"
        rows[read] = measure(trace_all, args.repeats, model, ids)
        sdpa, eager = rows["plain forward, sdpa"][0], rows["plain forward, eager"][0]
        for name, (ms, peak) in rows.items():
            print(f"{length:>6}  {name:<34}{ms:>9.1f}{ms / sdpa:>8.2f}{ms / eager:>9.2f}{peak:>10.0f}")


if __name__ == "__main__":
    main()
