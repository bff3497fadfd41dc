"""`make demo`: on SmolLM2, the support table for one layer, where each head of that layer attends most, and the
layer's pattern as a viewer page and a PNG (in `demo-output/`)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from attnlens import models
from attnlens.plot import plot
from attnlens.show import show


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--prompt", default="When Mary and John went to the store, John gave a drink to")
    parser.add_argument("--out", type=Path, default=Path("demo-output"), help="where the page and the PNG go")
    args = parser.parse_args(argv)
    console = Console()

    start = time.perf_counter()
    model = models.smollm2()
    console.print(f"SmolLM2-135M-Instruct loaded in {time.perf_counter() - start:.1f} s")
    console.print(model.support(layer=args.layer))

    attn = model.layers[args.layer].self_attn
    with torch.no_grad(), model.trace(args.prompt):
        pattern = attn.attention_probabilities.save()
        logits = model.logits.save()
    ids = model.tokenizer(args.prompt).input_ids
    tokens = [model.tokenizer.decode([i]) for i in ids]

    table = Table(
        title=f"layer {args.layer}: where each head attends from the last token {tokens[-1]!r}", title_justify="left"
    )
    for column in ("head", "kv head", "top key (weight)", "second", "third"):
        table.add_column(column)
    last = pattern[0, :, -1]  # [heads, keys]
    groups = attn.num_heads // attn.num_kv_heads
    for head in range(attn.num_heads):
        weights, keys = last[head].topk(3)
        cells = [f"{tokens[k]!r} @{k} ({w:.2f})" for w, k in zip(weights.tolist(), keys.tolist())]
        table.add_row(str(head), str(head // groups), *cells)
    console.print(table)
    next_token = model.tokenizer.decode([int(logits[0, -1].argmax())])
    console.print(f"next token: {next_token!r}")

    args.out.mkdir(parents=True, exist_ok=True)
    page = show(pattern, args.prompt, args.layer, model=model).save(args.out / f"layer{args.layer}.html")
    png = plot(pattern, args.prompt, args.layer, model=model, out=args.out / f"layer{args.layer}.png")
    console.print(
        f"the pattern of layer {args.layer}, every head: {page.resolve()} (open it in a browser; hover a "
        f"cell for its weight)\nthe same as a PNG: {png.resolve()}"
    )
    console.print(f"demo took {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
