"""What capturing a pattern every step costs on vLLM: greedy generation of a batch of prompts on SmolLM2.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_capture.py [--tokens 64] [--layer 10] [--repeats 3]

Rows, in one run and one process: plain vLLM (`vllm.LLM`); the attnlens engine (`StandardizedVLLM`) saving one
layer's `attention_probabilities` on every step of every prompt; transformers' `generate` with
`output_attentions=True` (eager attention). Each is timed after a warm-up; the best of `--repeats` is reported,
with its ratio to plain vLLM. Every prompt generates exactly `--tokens` tokens (end of sequence ignored).
"""

from __future__ import annotations

import argparse
import gc
import os
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

import torch

import attnlens

PROMPTS = [
    "The capital of France is",
    "When Mary and John went to the store, John gave a drink to",
    "Write a short poem about the sea.",
    "The three primary colours are",
    "In 1969 the first people to walk on the Moon were",
    "A good way to learn a new language is",
    "def fibonacci(n):",
    "The opposite of hot is",
]
ENGINE = dict(dtype="float32", distributed_executor_backend="uni", max_model_len=512, kv_cache_memory_bytes=256 * 2**20,
              seed=0)


def best(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    print(f"  timed: {', '.join(f'{t:.2f}' for t in times)} s", flush=True)  # rows survive a later timeout
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tokens, path = args.tokens, str(attnlens.models.smollm2_path())

    import nnsight
    import transformers
    import vllm
    from vllm import LLM, SamplingParams

    print(f"vllm {vllm.__version__}, nnsight {nnsight.__version__}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"{len(PROMPTS)} prompts x {tokens} tokens, SmolLM2-135M float32")
    rows = {}

    # as nnsight runs it: eager, no prefix cache (a repeat would skip the prefill), no chunked prefill
    llm = LLM(path, enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False, **ENGINE)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    rows["vLLM alone"] = best(lambda: llm.generate(PROMPTS, params, use_tqdm=False), args.repeats)
    llm = None
    gc.collect()

    model = attnlens.StandardizedVLLM(path, **ENGINE)
    attn = model.layers[args.layer].self_attn

    def capture():
        with torch.no_grad(), model.trace(max_tokens=tokens, temperature=0.0, ignore_eos=True) as tracer:
            for prompt in PROMPTS:
                with tracer.invoke(prompt):
                    patterns = list().save()
                    for _ in tracer.iter[:tokens]:
                        patterns.append(attn.attention_probabilities)
        assert len(patterns) == len(PROMPTS) and len(patterns[0]) == tokens

    rows[f"vLLM + attnlens, layer {args.layer} probabilities every step"] = best(capture, args.repeats)
    rows["StandardizedVLLM, no trace"] = best(
        lambda: model.generate(PROMPTS, max_tokens=tokens, temperature=0.0, ignore_eos=True), args.repeats)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, padding_side="left")
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)

    def generate():
        with torch.no_grad():
            hf.generate(**batch, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                        output_attentions=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)

    rows["transformers generate, output_attentions=True"] = best(generate, args.repeats)

    print(f"torch threads while timing: {torch.get_num_threads()} (vLLM's CPU worker pins them)")
    base = rows["vLLM alone"]
    width = max(map(len, rows))
    for name, seconds in rows.items():
        print(f"{name:<{width}}  {seconds:7.2f} s  {seconds / base:5.2f}x")


if __name__ == "__main__":
    main()
