"""What one attribution map costs: all heads, all sources, one query row, on SmolLM2-135M, against a plain forward.

    python benchmarks/analysis.py [--rounds 5] [--engine eager|vllm|both]

Times, in alternation after a warm-up, a plain forward of the IOI prompt (`model.trace` reading the logits) and
`attnlens.attribution` of `logit(' Mary') - logit(' John')` at its last row (every layer split by head and source:
30 layers x 9 heads x 15 sources, the final norm frozen), and reports the best round of each and their ratio. On vLLM
(the `.venv-vllm` environment) the attribution runs in the worker and only the terms leave it (the output projections'
matrices read once per engine, in the warm-up); the plain forward is a one-token request read the same way.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import attnlens

PROMPT = "When Mary and John went to the store, John gave a drink to"


def best(function, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(model, rounds: int, label: str) -> None:
    def plain():
        with torch.no_grad(), model.trace(PROMPT, **({"max_tokens": 1} if label == "vllm" else {})):
            model.logits.save()

    def attribution():
        attnlens.attribution(model, PROMPT, target=" Mary", versus=" John")

    plain(), attribution()  # warm-up
    pairs = [(best(plain, 1), best(attribution, 1)) for _ in range(rounds)]
    forward, attributed = min(p for p, _ in pairs), min(a for _, a in pairs)
    print(f"| {label} | {forward * 1000:.0f} ms | {attributed * 1000:.0f} ms | {attributed / forward:.1f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--engine", choices=("eager", "vllm", "both"), default="both")
    args = parser.parse_args()
    print("| engine | plain forward | attribution map | ratio |")
    print("|---|---|---|---|")
    if args.engine in ("eager", "both"):
        measure(attnlens.models.smollm2(), args.rounds, "eager")
    if args.engine in ("vllm", "both"):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        model = attnlens.StandardizedVLLM(
            str(attnlens.models.smollm2_path()),
            dtype="float32",
            max_model_len=256,
            distributed_executor_backend="uni",
            kv_cache_memory_bytes=64 * 2**20,
        )
        measure(model, args.rounds, "vllm")


if __name__ == "__main__":
    main()
