"""What capturing a pattern on every step costs on vLLM: greedy generation of many prompts, plain and captured.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_capture.py [--prompts 32] [--tokens 64] [--layer 10]
        [--repeats 15] [--rows eager,static,untraced,traced,compiled,heads,collect] [--tp | --pp]

Rows, in one process, on SmolLM2-135M float32, each a ratio to plain vLLM at its defaults (`vllm.LLM` as a user builds
it: compiled model, prefix caching, chunked prefill): plain vLLM configured as an engine for traces runs (eager, for
reference); static capture (`StandardizedVLLM(static_points=[attn_probs.L])` with `static_generate`, which runs vLLM's
defaults: the pattern is rebuilt at the attention op each step, over keys read from the paged KV cache); the attnlens
engine for traces (eager) without a trace; traced capture (`trace` + `tracer.iter` saving layer L's
`attention_probabilities` on every step of every prompt); the same trace on the static-capture engine, which runs vLLM's
compiled model and hands the attention op's values to a trace there (`worker.hand_off_at_kernel`). Then the memory
attnlens holds beside vLLM's KV cache after the traced run (0: earlier keys are read from the cache; the copy the
earlier design kept is given for comparison). The engines are built side by side and timed in alternation after a
warm-up, so load from other processes falls on all alike. Each row's figure is the median of its ratios to plain vLLM in
the same round, with the quartiles, over `--repeats` rounds (the best-of ratio and every round's are printed too): on a
shared 2-core machine a round's time moves by 10-20%, so a best-of ratio compares two rounds' luck (CPU time is no
steadier there: torch's OpenMP threads spin while they wait). Every prompt generates exactly `--tokens` tokens. Head
summaries (`attnlens.head_summaries` of every layer on its repeated random sequences, reduced at the attention op in the
worker, on the static-capture engine at vLLM's defaults) are timed beside plain vLLM at its defaults prefilling the same
sequences (one token each, salted out of the prefix cache, as the summaries' requests skip reading it); and
`attnlens.collect` of entropy, sink, previous and top keys on every layer (reduced in the worker) beside plain vLLM
prefilling the same prompts, salted. `--tp` adds the same rows on two tensor-parallel CPU ranks, on Gemma-3-270M (4
query heads, 1 key/value head: its heads divide over two ranks; SmolLM2's 9 do not). `--pp` runs, instead, the rows a
pipelined engine serves (static capture of a layer on each stage, head summaries, collection) on two pipeline stages of
SmolLM2 (15 blocks each; one core per stage), every engine, plain vLLM's too, on two stages at vLLM's defaults. `--rows`
chooses the rows beside plain vLLM (default: all); only their engines are built, since an idle engine's ranks load the
machine the others run on. Progress (each engine built, each run) and the load average go to stdout as they happen, so a
run on a loaded machine shows where it is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import uuid

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

import torch

import attnlens
from attnlens.heads import head_summaries, repeated_tokens

SUBJECTS = ["France", "the sea", "the Moon", "a new language", "colours", "Python", "the weather", "music"]
STARTS = ["Tell me about {}.", "Three facts about {}:", "A short poem about {}:", "Why does {} matter?"]
#: Prompts of different lengths, as a serving engine would see them.
PROMPTS = [start.format(subject) for start in STARTS for subject in SUBJECTS]
ENGINE = dict(dtype="float32", max_model_len=512, kv_cache_memory_bytes=256 * 2**20, seed=0)
#: The rows `--rows` chooses from, each beside plain vLLM at its defaults.
ROWS = ("eager", "static", "untraced", "traced", "compiled", "heads", "collect")
#: What the collection row reduces in the worker, on every layer.
COLLECTED = ["entropy", "sink", "previous", "top_keys"]


def say(text: str) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"  [{time.strftime('%H:%M:%S')} load {load}] {text}", flush=True)


def interleaved(runs: dict, repeats: int) -> dict:
    """Each run once as a warm-up, then `repeats` rounds taking every run in turn. Returns each run's time in every
    round."""
    for name, fn in runs.items():
        start = time.perf_counter()
        fn()
        say(f"warm-up: {name} {time.perf_counter() - start:.2f} s")
    times = {name: [] for name in runs}
    for round in range(repeats):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
        say(f"round {round + 1}/{repeats}: " + ", ".join(f"{t[-1]:.2f}" for t in times.values()) + " s")
    return times


def built(what: str, make):
    start = time.perf_counter()
    found = make()
    say(f"built {what} in {time.perf_counter() - start:.0f} s")
    return found


def rows_for(path: str, prompts: list, tokens: int, layers: list, repeats: int, rows: set[str], **engine) -> tuple:
    """The chosen `rows` (ROWS' names) beside plain vLLM at its defaults: only their engines are built (an idle
    engine's ranks would load the machine the others run on). Static capture taps `layers`; traces read the first."""
    import tempfile

    from vllm import LLM, SamplingParams

    layer = layers[0]
    folder = tempfile.mkdtemp(prefix="attnlens-bench-")
    corpus = os.path.join(folder, "corpus.jsonl")
    with open(corpus, "w") as out:  # the collection's prompts: the generation's, four times over
        out.writelines(f'{{"text": "{prompt}"}}\n' for prompt in prompts * 4)

    sampling = dict(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    llm = built("plain vLLM (defaults)", lambda: LLM(path, **engine))
    eager = static = model = None
    if "eager" in rows:
        eager = built(
            "plain vLLM (eager)",
            lambda: LLM(path, enforce_eager=True, enable_prefix_caching=False, enable_chunked_prefill=False, **engine),
        )
    if {"static", "compiled", "heads", "collect"} & rows:
        points = [f"attn_probs.{layer}" for layer in layers]
        static = built(
            "attnlens static capture", lambda: attnlens.StandardizedVLLM(path, static_points=points, **engine)
        )
        assert static.compiled
    if {"untraced", "traced"} & rows:
        model = built("attnlens engine for traces", lambda: attnlens.StandardizedVLLM(path, **engine))
    sequences = [ids.tolist() for ids in repeated_tokens(static or model, 50, 8, 0)] if "heads" in rows else []

    def plain():
        llm.generate(prompts, SamplingParams(**sampling), use_tqdm=False)

    def plain_eager():
        eager.generate(prompts, SamplingParams(**sampling), use_tqdm=False)

    def untraced():
        model.generate(prompts, **sampling)

    def captured_statically():
        results = static.static_generate(prompts, **sampling)
        assert len(results) == len(prompts) and len(results[0].steps) == tokens

    def traced_capture(engine):
        attn = engine.layers[layer].self_attn
        with torch.no_grad(), engine.trace(**sampling) as tracer:
            for prompt in prompts:
                with tracer.invoke(prompt):
                    saved = list().save()
                    for _ in tracer.iter[:tokens]:
                        saved.append(attn.attention_probabilities)
        assert len(saved) == len(prompts) and len(saved[0]) == tokens

    def prefill_plain():  # salted: each round computes the prefill, as the summaries' traced requests do
        salt = uuid.uuid4().hex
        requests = [{"prompt_token_ids": ids, "cache_salt": salt} for ids in sequences]
        llm.generate(requests, SamplingParams(max_tokens=1), use_tqdm=False)

    def prefill_corpus():  # salted: each round computes the prefill, as the collection's requests do
        salt = uuid.uuid4().hex
        requests = [{"prompt": prompt, "cache_salt": salt} for prompt in prompts * 4]
        llm.generate(requests, SamplingParams(max_tokens=1), use_tqdm=False)

    def collected():  # reduced at the attention op in the worker, every layer, on the engine at vLLM's defaults
        out = os.path.join(folder, uuid.uuid4().hex)
        result = attnlens.collect(static, corpus, COLLECTED, out, progress=False)
        assert result.prompts == len(prompts) * 4 and not result.errors

    def summaries():  # reduced at the attention op, on the engine at vLLM's defaults
        found = head_summaries(static, length=50, sequences=8, seed=0, progress=False)
        assert len(found.layers) == static.num_layers

    chosen = {
        "eager": {"plain vLLM, eager (as for traces)": plain_eager},
        "static": {f"static capture, layer {', '.join(map(str, layers))} pattern": captured_statically},
        "untraced": {"attnlens engine for traces, no trace": untraced},
        "traced": {f"traced capture, layer {layer} pattern": lambda: traced_capture(model)},
        "compiled": {f"traced capture on the static engine (compiled), layer {layer}": lambda: traced_capture(static)},
        "heads": {
            "plain vLLM, prefill of 8 x 101 tokens": prefill_plain,
            "head summaries, every layer, same 8 x 101 (in the worker, vLLM's defaults)": summaries,
        },
        "collect": {
            f"plain vLLM, prefill of {len(prompts) * 4} prompts": prefill_corpus,
            f"collect {'+'.join(COLLECTED)}, every layer, same prompts (in the worker)": collected,
        },
    }
    runs = {"plain vLLM": plain}
    for short, found in chosen.items():
        if short in rows:
            runs.update(found)
    times = interleaved(runs, repeats)
    if model is None:
        return times, {}
    cache = model.vllm_entrypoint.collective_rpc("attnlens_cache_bytes")
    held = [stats["bytes"] for stats in model.kept()]
    c = model.text_config
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim or c.hidden_size // c.num_attention_heads)
    tokens_held = sum(len(model.tokenizer(p).input_ids) + tokens for p in prompts)
    memory = {
        "KV cache (vLLM's, per rank)": cache,
        "attnlens beside it, after the traced run (per rank)": held,
        "the copy the earlier design kept at the end of the run": per_token * 4 * tokens_held,
    }
    return times, memory


def report(title: str, found: tuple) -> None:
    """Each row's best time and its ratio to the best of plain vLLM; the median and quartiles of its ratios to plain
    vLLM in the same round; then each round's ratio."""
    rows, memory = found
    width = max(map(len, [*rows, *memory]))
    print(title)
    print(f"  {'':<{width}}  {'best':>7}    {'ratio':>5}  median (quartiles)")
    base = "plain vLLM"
    for name, seconds in rows.items():
        if name.startswith("plain vLLM, prefill"):
            base = name  # the head summaries' rows compare with plain prefill of the same sequences
        ratios = [t / b for t, b in zip(seconds, rows[base])]
        low, middle, high = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"  {name:<{width}}  {min(seconds):7.2f} s  {min(seconds) / min(rows[base]):5.2f}x  "
            f"{middle:5.2f}x ({low:.2f}-{high:.2f})  (rounds: {', '.join(f'{r:.2f}' for r in ratios)})"
        )
    for name, size in memory.items():
        sizes = size if isinstance(size, list) else [size]
        print(f"  {name:<{width}}  " + ", ".join(f"{b / 2**20:.1f} MiB" for b in sizes))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--rows", default=",".join(ROWS), help=f"which rows beside plain vLLM, comma-separated: {', '.join(ROWS)}"
    )
    parser.add_argument("--tp", action="store_true", help="also two tensor-parallel ranks, on Gemma-3-270M")
    parser.add_argument("--tp-only", action="store_true", help=argparse.SUPPRESS)  # --tp's second process
    parser.add_argument("--pp", action="store_true", help="instead, the rows on two pipeline stages (SmolLM2)")
    args = parser.parse_args()
    prompts = (PROMPTS * (1 + args.prompts // len(PROMPTS)))[: args.prompts]
    chosen = set(args.rows.split(",")) - {""}
    if chosen - set(ROWS):
        parser.error(f"unknown rows {sorted(chosen - set(ROWS))}; choose from {', '.join(ROWS)}")

    import nnsight
    import vllm

    print(
        f"vllm {vllm.__version__}, nnsight {nnsight.__version__}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, {len(prompts)} prompts x {args.tokens} tokens, float32",
        flush=True,
    )

    def rows(path: str, layers: list, **engine) -> tuple:
        return rows_for(path, prompts, args.tokens, layers, args.repeats, chosen, **engine, **ENGINE)

    if args.pp:  # two pipeline stages on the `mp` executor, every engine at vLLM's defaults
        from vllm import envs

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per stage
        envs.disable_envs_cache()
        chosen.intersection_update({"static", "heads", "collect"})  # a pipelined engine serves no trace
        # a layer on each stage (15 blocks each)
        found = rows(
            str(attnlens.models.smollm2_path()),
            [args.layer, args.layer + 15],
            distributed_executor_backend="mp",
            pipeline_parallel_size=2,
        )
        report("SmolLM2-135M, two pipeline stages", found)
        return

    if args.tp_only:  # --tp's rows, in a process of their own: beside the one-process engines, 24 GiB ran out
        from vllm import envs

        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"  # one core per rank
        envs.disable_envs_cache()
        found = rows(
            str(attnlens.models.gemma3_270m_path()), [9], distributed_executor_backend="mp", tensor_parallel_size=2
        )
        report("Gemma-3-270M, two tensor-parallel ranks", found)
        return
    report(
        "SmolLM2-135M, one process",
        rows(str(attnlens.models.smollm2_path()), [args.layer], distributed_executor_backend="uni"),
    )
    say("done, one process")
    if args.tp:
        import subprocess
        import sys

        subprocess.run([sys.executable, __file__, *[a for a in sys.argv[1:] if a != "--tp"], "--tp-only"], check=True)


if __name__ == "__main__":
    main()
