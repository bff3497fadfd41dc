"""Do the head summaries find something real? Induction heads on SmolLM2-135M, ablated.

    python benchmarks/heads.py [--counts 5 10] [--draws 5]

Ranks SmolLM2's 270 heads by their induction score (`attnlens.head_summaries`: 8 sequences BOS + R + R, R of 50
random tokens, seed 0), then measures the loss on the repeated half of 8 held-out sequences (seed 1; every token of
the second copy after its first) with the top-ranked heads' outputs set to zero (`attention_head_outputs[:, :, h]`),
next to ablating as many heads drawn at random (seeded draws 0, 1, ...). For reference: the loss on the first copy,
which nothing in the context can predict. Also times the summaries of every layer.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import attnlens
from attnlens import heads

LENGTH, SEQUENCES = 50, 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", type=int, nargs="+", default=[5, 10])
    parser.add_argument("--draws", type=int, default=5)
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = attnlens.models.smollm2()
    start = time.perf_counter()
    found = heads.head_summaries(model, length=LENGTH, sequences=SEQUENCES, progress=False)
    seconds = time.perf_counter() - start
    top = found.ranked("induction")
    print(
        f"summaries of {len(found.layers)} layers x 9 heads on {SEQUENCES} x {1 + 2 * LENGTH} tokens: {seconds:.1f} s"
    )
    print(
        "top induction heads (layer, head, score): "
        + ", ".join(
            f"L{layer}H{head} {float(found.get('induction', layer)[head]):.2f}"
            for layer, head in top[: max(args.counts)]
        )
    )

    held_out = heads.repeated_tokens(model, LENGTH, SEQUENCES, seed=1)
    first = heads.repeat_loss(model, held_out, LENGTH, copy=1)
    base = heads.repeat_loss(model, held_out, LENGTH)
    print(f"\nloss on the first copy (nothing to copy from): {first:.2f}; on the repeated half: {base:.2f}\n")
    print("| heads ablated | top induction heads: loss (rise) | random heads, each draw: loss | random: mean rise |")
    print("|---|---|---|---|")
    for count in args.counts:
        ablated = heads.repeat_loss(model, held_out, LENGTH, top[:count])
        draws = [
            heads.repeat_loss(model, held_out, LENGTH, heads.random_heads(found, count, seed))
            for seed in range(args.draws)
        ]
        rises = [loss - base for loss in draws]
        print(
            f"| {count} | {ablated:.2f} (+{ablated - base:.2f}) | {', '.join(f'{d:.2f}' for d in draws)} | "
            f"+{statistics.mean(rises):.2f} |"
        )


if __name__ == "__main__":
    main()
