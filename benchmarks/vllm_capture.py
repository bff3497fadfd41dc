"""What capturing a pattern on every step costs on vLLM: greedy generation of many prompts, plain and captured.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_capture.py [--prompts 32] [--tokens 64] [--layer 10]
        [--repeats 3] [--tp]

Rows, in one process, on SmolLM2-135M float32: plain vLLM (`vllm.LLM`, configured as nnsight configures its engine:
eager, no prefix cache, no chunked prefill); the attnlens engine running the same requests without a trace; static
capture (`StandardizedVLLM(static_points=[attn_probs.L])` with `static_generate`, the patterns rebuilt when taken,
included in the time); traced capture (`trace` + `tracer.iter` saving layer L's `attention_probabilities` on every
step of every prompt). The engines are built side by side and timed in alternation after a warm-up, so load from
other processes falls on all alike; the best of `--repeats` rounds is reported with its ratio to plain vLLM. Every
prompt generates exactly `--tokens` tokens. `--tp` adds the same rows on two tensor-parallel CPU ranks, on
Gemma-3-270M (4 query heads, 1 key/value head: its heads divide over two ranks; SmolLM2's 9 do not).
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

import torch

import attnlens

SUBJECTS = ["France", "the sea", "the Moon", "a new language", "colours", "Python", "the weather", "music"]
STARTS = ["Tell me about {}.", "Three facts about {}:", "A short poem about {}:", "Why does {} matter?"]
#: Prompts of different lengths, as a serving engine would see them.
PROMPTS = [start.format(subject) for start in STARTS for subject in SUBJECTS]
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 * 2**20, seed=0)


def interleaved(runs: dict, repeats: int) -> dict:
    """Each run once as a warm-up, then `repeats` rounds taking every run in turn. Returns each run's best time."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print("  round: " + ", ".join(f"{t[-1]:.2f}" for t in times.values()) + " s", flush=True)
    return {name: min(t) for name, t in times.items()}


def rows_for(path: str, prompts: list, tokens: int, layer: int, repeats: int, **engine) -> dict:
    from vllm import LLM, SamplingParams

    sampling = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm = LLM(path, enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False, **engine)
    static = attnlens.StandardizedVLLM(path, static_points=[f"attn_probs.{layer}"], **engine)
    model = attnlens.StandardizedVLLM(path, **engine)
    attn = model.layers[layer].self_attn

    def plain():
        llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)

    def untraced():
        model.generate(prompts, **sampling)

    def captured_statically():
        results = static.static_generate(prompts, **sampling)
        assert len(results) == len(prompts) and len(results[0].steps) == tokens

    def traced():
        with torch.no_grad(), model.trace(**sampling) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    saved = list().save()
                    for _ in tracer.iter[:tokens]:
                        saved.append(attn.attention_probabilities)
        assert len(saved) == len(prompts) and len(saved[0]) == tokens

    return interleaved({"plain vLLM": plain, "attnlens engine, no trace": untraced,
                        f"static capture, layer {layer} pattern": captured_statically,
                        f"traced capture, layer {layer} pattern": traced}, repeats)


def report(title: str, rows: dict) -> None:
    base = rows["plain vLLM"]
    width = max(map(len, rows))
    print(title)
    for name, seconds in rows.items():
        print(f"  {name:<{width}}  {seconds:7.2f} s  {seconds / base:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", action="store_true", help="also two tensor-parallel ranks, on Gemma-3-270M")
    args = parser.parse_args()
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[:args.prompts]

    import nnsight
    import vllm

    print(f"vllm {vllm.__version__}, nnsight {nnsight.__version__}, torch {torch.__version__}, "
          f"{os.cpu_count()} cores, {len(prompts)} prompts x {args.tokens} tokens, float32", flush=True)
    rows = rows_for(str(attnlens.models.smollm2_path()), prompts, args.tokens, args.layer, args.repeats,
                    distributed_executor_backend="uni", **ENGINE)
    report("SmolLM2-135M, one process", rows)
    if args.tp:
        from vllm import envs

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
        envs.disable_envs_cache()
        rows = rows_for(str(attnlens.models.gemma3_270m_path()), prompts, args.tokens, 9, args.repeats,
                        distributed_executor_backend="mp", tensor_parallel_size=2, **ENGINE)
        report("Gemma-3-270M, two tensor-parallel ranks", rows)


if __name__ == "__main__":
    main()
