"""What reading attention costs, on SmolLM2 in one process: ms and peak memory, as ratios to a plain sdpa forward;
and attnlens's own Python cost per read, against nnsight by hand.

    python benchmarks/attention_overhead.py [--lengths 128 1024] [--repeats 5] [--floor-rounds 30] [--only-floor]

Rows: a plain forward with sdpa, a plain forward with eager, and a trace that saves all eight attention values of
every layer (eager). Peak memory is the process's resident-set peak during the run above what it held before.

The floor rows: a tiny 32-layer Llama (hidden 64, eager) on 16 tokens, where the forward costs little and Python is
most of a trace, as on an accelerator: a plain forward; nnsight by hand, reading the eight attention values of every
layer at the operations attnlens reads them from (`gpu.BY_HAND`), as a user writes it (`attn.source.
attention_interface_1...` on each read, which nnsight builds anew each time); the same by hand with each layer's call of
the attention interface made once, as attnlens keeps it; attnlens reading the same eight by name. The four
run in turn (`--floor-rounds` rounds after a warm-up) and each row is its best round, in wall time and in the CPU
time of the calling thread (torch runs on that one thread here, so the CPU time is the work done, whatever else
loads the machine). The ratio that matters is attnlens / by hand; the last line also gives attnlens / by hand with the
calls kept, attnlens's own cost beyond nnsight's handoffs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from gpu import BY_HAND, interface_call, read_by_hand
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


def floor(rounds: int, layers: int = 32, tokens: int = 16) -> None:
    """attnlens's per-read Python cost: the same reads by name and by hand, interleaved, best of `rounds`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = models.tiny("llama", num_hidden_layers=layers, hidden_size=64)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    names = list(BY_HAND)
    with model.trace(ids):  # the two read the same tensors: otherwise the comparison says nothing
        pairs = list().save()
        for block in model.layers:
            for name in names:
                by_hand = BY_HAND[name](block.self_attn, interface_call)
                pairs.append((getattr(block.self_attn, name).clone(), by_hand.clone()))
    assert all(a.shape == b.shape and torch.equal(a, b) for a, b in pairs), "by hand reads other tensors than attnlens"

    def plain():
        model._module(ids)

    def by_hand():
        read_by_hand(model, ids)

    calls = {block.self_attn.path: interface_call(block.self_attn) for block in model.layers}

    def kept_call(attn):  # each layer's call of the attention interface made once, as attnlens keeps it
        return calls[attn.path]

    def by_hand_kept():
        read_by_hand(model, ids, kept_call)

    def by_name():
        with model.trace(ids):
            for block in model.layers:
                attn = block.self_attn
                for name in names:
                    getattr(attn, name)

    runs = {
        "plain forward": plain,
        "nnsight by hand": by_hand,
        "by hand, calls kept": by_hand_kept,
        "attnlens": by_name,
    }
    for fn in runs.values():
        fn(), fn()  # warm-up: instrumentation, plans
    wall = {name: [] for name in runs}
    cpu = {name: [] for name in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    torch.set_num_threads(threads)
    reads = len(names) * layers
    print(
        f"\nfloor: tiny Llama, {layers} layers, hidden 64, {tokens} tokens, {reads} reads, 1 thread, best of {rounds}"
    )
    print(f"  {'run':<20}{'wall ms':>9}{'cpu ms':>9}{'x hand':>8}")
    hand = min(cpu["nnsight by hand"])
    for name in runs:
        print(f"  {name:<20}{min(wall[name]) * 1000:>9.2f}{min(cpu[name]) * 1000:>9.2f}{min(cpu[name]) / hand:>8.3f}")
    extra = (min(cpu["attnlens"]) - hand) / reads * 1e6
    kept = min(cpu["attnlens"]) / min(cpu["by hand, calls kept"])
    print(f"  attnlens beyond nnsight by hand: {extra:.1f} us of CPU per read; {kept:.3f}x by hand with calls kept")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--floor-rounds", type=int, default=30)
    parser.add_argument("--only-floor", action="store_true", help="only the tiny model's per-read cost")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    floor(args.floor_rounds)
    if args.only_floor:
        return
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
