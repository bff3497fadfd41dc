"""What the static backend costs on vLLM: the same greedy workload plain, with static taps, and traced.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_static.py [--prompts 4] [--tokens 32] [--layer 10]

Rows, in one run and one process, on SmolLM2-135M float32: plain vLLM (`vllm.LLM`, as nnsight configures it);
`StandardizedVLLM(static_points=[attn_probs.L, value.L])` with `static_generate` (plain requests, the captures taken
and the patterns rebuilt afterwards, included in the time); the traced path (`StandardizedVLLM.trace` saving the same
layer's `attention_probabilities` and `attention_values` on every step of every prompt). The three engines are
built side by side and timed in alternation after a warm-up (so load from other processes falls on all alike); the
best of `--repeats` rounds is reported with its ratio to plain vLLM. Every prompt generates exactly `--tokens`.
"""

from __future__ import annotations

import argparse
import time

import torch
from vllm_capture import ENGINE as _CAPTURE_ENGINE  # first: it sets vLLM's in-process environment
from vllm_capture import PROMPTS

import attnlens

ENGINE = {**_CAPTURE_ENGINE, "kv_cache_memory_bytes": 128 * 2**20}


def interleaved(runs: dict, repeats: int) -> dict:
    """Each run once as a warm-up, then `repeats` rounds taking every run in turn, so that load from other
    processes falls on all of them alike. Returns each run's best time."""
    for fn in runs.values():
        fn()
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        print("  round: " + ", ".join(f"{name.split()[0]} {t[-1]:.2f} s" for name, t in times.items()), flush=True)
    return {name: min(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    prompts, tokens, layer = PROMPTS[:args.prompts], args.tokens, args.layer
    path = str(attnlens.models.smollm2_path())
    from vllm import LLM, SamplingParams

    print(f"{len(prompts)} prompts x {tokens} tokens, SmolLM2-135M float32, layer {layer} probabilities and values, "
          f"{torch.get_num_threads()} threads", flush=True)
    sampling = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    # three engines side by side on the same weights (SmolLM2 is small), timed in alternation
    llm = LLM(path, enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False, **ENGINE)
    static = attnlens.StandardizedVLLM(path, static_points=[f"attn_probs.{layer}", f"value.{layer}"], **ENGINE)
    model = attnlens.StandardizedVLLM(path, **ENGINE)
    attn = model.layers[layer].self_attn

    def plain():
        llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)

    def captured_statically():
        results = static.static_generate(prompts, **sampling)
        assert len(results) == len(prompts) and len(results[0].steps) == tokens

    def traced():
        with torch.no_grad(), model.trace(**sampling) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    saved = list().save()
                    for _ in tracer.iter[:tokens]:
                        saved.append((attn.attention_probabilities, attn.attention_values))
        assert len(saved) == len(prompts) and len(saved[0]) == tokens

    rows = interleaved({"plain vLLM": plain, "static capture (static_generate)": captured_statically,
                        "traced capture (trace + tracer.iter)": traced}, args.repeats)

    base = rows["plain vLLM"]
    width = max(map(len, rows))
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds:7.2f} s  {seconds / base:5.2f}x")
    static_s, traced_s = rows["static capture (static_generate)"], rows["traced capture (trace + tracer.iter)"]
    print(f"traced / static: {traced_s / static_s:.2f}x")


if __name__ == "__main__":
    main()
