"""What one activation patching grid costs on SmolLM2-135M, against a plain forward of the same prompt.

    python benchmarks/patching.py [--over residual] [--batch-size 64] [--rounds 1] [--engine eager|vllm|both]

The clean prompt is the IOI prompt, the corrupted one the same with the repeated name swapped (the same length in
tokens); the metric `logit(' Mary') - logit(' John')` at the last row. Times a plain forward of the clean prompt
(`model.trace` reading the logits; on vLLM a one-token request) and `attnlens.patch(..., over=...)` (over
"residual": 30 layers x 14 positions = 420 patches, `batch_size` per forward; on vLLM each patch a request of one
batch beside the clean request, only the metric's numbers leaving the worker), and reports the best round of each,
their ratio and the grid's forwards.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import attnlens
from attnlens.analysis import logit_difference

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPT = "When Mary and John went to the store, Mary gave a drink to"


def timed(function) -> tuple[float, object]:
    start = time.perf_counter()
    result = function()
    return time.perf_counter() - start, result


def measure(model, args, label: str) -> None:
    metric = logit_difference(model, " Mary", " John")

    def plain():
        with torch.no_grad(), model.trace(CLEAN, **({"max_tokens": 1} if label == "vllm" else {})):
            model.logits.save()

    def grid():
        return attnlens.patch(model, CLEAN, CORRUPT, metric, over=args.over, batch_size=args.batch_size)

    plain()  # warm-up
    forwards, grids = [], []
    for _ in range(args.rounds):
        forwards.append(min(timed(plain)[0] for _ in range(3)))
        grids.append(timed(grid))
    forward, (patched, result) = min(forwards), min(grids, key=lambda found: found[0])
    print(
        f"| {label} | {args.over} {tuple(result.values.shape)} | {result.forwards} | {forward * 1000:.0f} ms | "
        f"{patched:.2f} s | {patched / forward:.0f}x |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--over", default="residual", choices=("heads", "head_positions", "residual", "patterns"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--engine", choices=("eager", "vllm", "both"), default="both")
    args = parser.parse_args()
    print("| engine | grid | forwards | plain forward | grid | ratio |")
    print("|---|---|---|---|---|---|")
    if args.engine in ("eager", "both"):
        measure(attnlens.models.smollm2(), args, "eager")
    if args.engine in ("vllm", "both"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        model = attnlens.StandardizedVLLM(
            str(attnlens.models.smollm2_path()),
            dtype="float32",
            max_model_len=256,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=64 * 2**20,
        )
        measure(model, args, "vllm")


if __name__ == "__main__":
    main()
