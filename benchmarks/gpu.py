"""What reading attention costs on an accelerator, as ratios within one run: attnlens against plain forwards and
against nnsight by hand.

    python benchmarks/gpu.py [--device cuda] [--dtype bfloat16] [--shapes smollm2 llama-1b qwen3-4b]
        [--lengths 128 1024 4096] [--repeats 20] [--out results.json]

Models are built from config classes at real sizes with random weights (no download): SmolLM2-135M, Llama-3.2-1B and
Qwen3-4B shapes. For each shape and prompt length (and a batch of 8 x 128 tokens), rows:
- `sdpa`, `eager`: a plain forward of the transformers model;
- `nnsight by hand`: a trace reading the eight attention values of every layer at the operations attnlens reads
  them from, written out by hand (the floor attnlens's own cost is measured against);
- `attnlens, 8 values x every layer`: the same reads through attnlens's names;
- `attnlens, one layer's pattern (eager)`, `(rebuilt on sdpa)`: one layer's attention_probabilities;
- `capture_attention, one layer (eager)`: the same through capture_attention;
- `every layer's pattern, rebuilt on sdpa`: attention_probabilities of every layer, each freed as it is read;
- `generate 32 tokens`: plain, and reading one layer's pattern on every step (eager and rebuilt).
Each row is the median of `--repeats` timed runs after warm-up, synchronised; peak memory above the model's own.
`--device cpu --shapes tiny` tries the script on a machine without one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import attnlens

SHAPES = {
    "tiny": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=512,
        ),
    ),
    "smollm2": (
        "LlamaConfig",
        dict(
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            vocab_size=49152,
            tie_word_embeddings=True,
        ),
    ),
    "llama-1b": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            vocab_size=128256,
            tie_word_embeddings=True,
        ),
    ),
    "qwen3-4b": (
        "Qwen3Config",
        dict(
            hidden_size=2560,
            intermediate_size=9728,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            tie_word_embeddings=True,
        ),
    ),
}
#: The eight attention values of the common layout, and where nnsight reaches each by hand, given `call(attn)`, the
#: attention forward's call of transformers' attention interface (`interface_call`, or one kept per layer).
BY_HAND = {
    "attention_queries": lambda attn, call: call(attn).inputs[0][1],
    "attention_keys": lambda attn, call: call(attn).inputs[0][2],
    "attention_values": lambda attn, call: call(attn).inputs[0][3],
    "attention_scores": lambda attn, call: call(attn).source.attn_weights_1.output,
    "attention_probabilities": lambda attn, call: call(attn).source.attn_weights_3.output,
    "attention_head_outputs": lambda attn, call: call(attn).output[0],
    "attention_premix": lambda attn, call: attn.o_proj.input,
    "attention_output": lambda attn, call: attn.output[0],
}


def interface_call(attn):
    """The call of the attention interface, as a user reaches it by hand: nnsight builds it anew each time."""
    return attn.source.attention_interface_1


def read_by_hand(model, ids, call=interface_call) -> None:
    """A trace reading the eight values of every layer by hand (`BY_HAND`)."""
    with model.trace(ids):
        for block in model.layers:
            attn = block.self_attn
            for read in BY_HAND.values():
                read(attn, call)


class Timer:
    def __init__(self, device: torch.device, repeats: int):
        self.device, self.repeats = device, repeats

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def __call__(self, fn) -> tuple[float, float]:
        """(median ms, peak MiB above what was allocated before)."""
        fn()
        fn()  # warm-up: instrumentation, allocator, kernels
        self.sync()
        base = torch.cuda.memory_allocated() if self.device.type == "cuda" else 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.repeats):
            start = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - base if self.device.type == "cuda" else 0
        return statistics.median(times) * 1000, peak / 2**20


def build(shape: str, implementation: str, device, dtype):
    import transformers

    config_class, kwargs = SHAPES[shape]
    config = getattr(transformers, config_class)(**kwargs, max_position_embeddings=8192)
    config._attn_implementation = implementation
    torch.manual_seed(0)
    with torch.device(device):
        inner = getattr(transformers, config_class.replace("Config", "ForCausalLM"))(config).to(dtype).eval()
    return attnlens.StandardizedTransformer(
        inner,
        tokenizer=attnlens.models.char_tokenizer(),
        attn_implementation=implementation,
        rebuild_patterns=implementation == "sdpa",
    )


def rows(eager, sdpa, ids, timer, layer) -> dict:
    names = list(BY_HAND)
    found = {}

    def plain(model):
        return lambda: model._module(ids)

    def by_hand():
        read_by_hand(eager, ids)

    def standardized():
        with eager.trace(ids):
            for block in eager.layers:
                attn = block.self_attn
                for name in names:
                    getattr(attn, name)

    def one_pattern(model):
        def run():
            with model.trace(ids):
                model.layers[layer].self_attn.attention_probabilities.save()

        return run

    def every_pattern():
        with sdpa.trace(ids):
            for block in sdpa.layers:
                block.self_attn.attention_probabilities.sum()  # formed and freed, layer by layer

    with torch.no_grad():
        found["sdpa"] = timer(plain(sdpa))
        found["eager"] = timer(plain(eager))
        found["nnsight by hand, 8 values x every layer"] = timer(by_hand)
        found["attnlens, 8 values x every layer"] = timer(standardized)
        found["attnlens, one layer's pattern (eager)"] = timer(one_pattern(eager))
        found["attnlens, one layer's pattern (rebuilt on sdpa)"] = timer(one_pattern(sdpa))
        found["capture_attention, one layer (eager)"] = timer(
            lambda: attnlens.capture_attention(eager, ids, layer, keep="probs", progress=False)
        )
        found["every layer's pattern, rebuilt on sdpa"] = timer(every_pattern)
    return found


def generation(eager, sdpa, ids, timer, layer, tokens=32) -> dict:
    def plain(model):
        return lambda: model._module.generate(
            ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
        )

    def reading(model):
        def run():
            with model.generate(
                ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0
            ) as tracer:
                for _ in tracer.iter[:tokens]:
                    model.layers[layer].self_attn.attention_probabilities.sum().save()

        return run

    with torch.no_grad():
        return {
            f"generate {tokens} tokens, sdpa": timer(plain(sdpa)),
            f"generate {tokens} tokens, eager": timer(plain(eager)),
            f"generate {tokens}, one layer's pattern every step (eager)": timer(reading(eager)),
            f"generate {tokens}, one layer's pattern every step (rebuilt)": timer(reading(sdpa)),
        }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--shapes", nargs="+", default=["smollm2", "llama-1b", "qwen3-4b"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    timer = Timer(device, args.repeats)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}, torch {torch.__version__}, {args.dtype}, median of {args.repeats}", flush=True)
    results = []
    for shape in args.shapes:
        eager, sdpa = build(shape, "eager", device, dtype), build(shape, "sdpa", device, dtype)
        layer = eager.num_layers // 2
        vocab = eager.config.vocab_size
        inputs = [(f"1 x {n}", (1, n)) for n in args.lengths] + [("8 x 128", (8, 128))]
        for label, size in inputs:
            ids = torch.randint(0, vocab, size, generator=torch.Generator().manual_seed(0)).to(device)
            found = rows(eager, sdpa, ids, timer, layer)
            if label == "1 x 128":
                found.update(generation(eager, sdpa, ids, timer, layer))
            report(shape, label, found)
            results.append({"shape": shape, "input": label, "rows": found})
        del eager, sdpa
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as file:
            json.dump(results, file, indent=1)


def report(shape: str, label: str, found: dict) -> None:
    sdpa, eager, floor = found["sdpa"][0], found["eager"][0], found["nnsight by hand, 8 values x every layer"][0]
    print(f"\n{shape}, {label} tokens")
    print(f"  {'row':<62}{'ms':>9}{'x sdpa':>8}{'x eager':>9}{'x hand':>8}{'peak MiB':>10}")
    for name, (ms, peak) in found.items():
        print(f"  {name:<62}{ms:>9.2f}{ms / sdpa:>8.2f}{ms / eager:>9.2f}{ms / floor:>8.2f}{peak:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
