"""`attnlens.plot`: a PNG heatmap of one layer's heads, labelled for a paper (matplotlib's Agg canvas, no pyplot)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .show import patterns

#: Above this many tokens on an axis, only some are labelled (with their positions).
ALL_LABELS = 48


def _label(token: str) -> str:
    """A token as a tick label: whitespace made visible, `$` kept literal (not mathtext)."""
    return token.replace(" ", "\u2423").replace("\n", "\u23ce").replace("\t", "\u21e5").replace("$", r"\$")[:20]


def _ticks(positions: list[int], tokens: list[str]) -> tuple[list[int], list[str]]:
    if len(positions) <= ALL_LABELS:
        return list(range(len(positions))), [_label(tokens[p]) for p in positions]
    step = math.ceil(len(positions) / (ALL_LABELS // 2))
    picked = list(range(0, len(positions), step))
    return picked, [f"{positions[i]} {_label(tokens[positions[i]])}" for i in picked]


def plot(
    source,
    prompt=None,
    layer: int | None = None,
    *,
    out: str | Path,
    columns: int | None = None,
    vmax: float | None = 1.0,
    dpi: int = 150,
    **options,
) -> Path:
    """Write a PNG heatmap of one layer: every head (or `heads=`) in a grid, tokens on both axes, head numbers, a
    colour bar, the model and layer in the title. Takes what `attnlens.show` takes (a model with `prompt` and
    `layer`, a `capture_attention` result, a [heads, query, key] tensor; see `attnlens.show.patterns`). `vmax=None`
    scales the colours to the largest weight shown instead of 1. Returns the path written.

    On a multimodal model's inputs (a prompt with images), the PNG is attention over the images: for each image (a
    row of panels; one per view of an image of several, LLaVA-NeXT's base view then its tiles, both over the whole
    image, and one per frame of a video), each head's and the heads' mean attention from the query `rows=`
    (positions; default the last, averaged over several) to the image's tokens, on the image's token grid, laid over
    the image; the colours run to the largest weight drawn (`vmax` is the patterns')."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"{out}: attnlens.plot writes .png (attnlens.show(...).save writes .html)")
    figure(source, prompt, layer, columns=columns, vmax=vmax, dpi=dpi, **options).savefig(out, format="png")
    return out


def figure(
    source,
    prompt=None,
    layer: int | None = None,
    *,
    columns: int | None = None,
    vmax: float | None = 1.0,
    dpi: int = 150,
    **options,
):
    """The matplotlib `Figure` `plot` writes (on an Agg canvas; pyplot's state is never touched)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "attnlens.plot needs matplotlib: pip install matplotlib (or attnlens[plot])"
        ) from None
    rows = options.pop("rows", None)
    shown = patterns(source, prompt, layer, **options)
    pattern = shown.layer(layer if len(shown.layers) > 1 else None)
    if shown.images:
        return _over_images(Figure, FigureCanvasAgg, shown, pattern, rows, dpi)
    if rows is not None:
        raise ValueError("rows= picks the text rows whose attention is drawn over a prompt's images; this has none")
    probs, num_heads = pattern.probs.numpy(), len(pattern.heads)
    num_queries, num_keys = probs.shape[1:]
    columns = columns or (num_heads if num_heads <= 3 else math.ceil(math.sqrt(num_heads)))
    rows = math.ceil(num_heads / columns)
    side = min(7.0, max(2.6, 0.17 * max(num_queries, num_keys) + 1.4))
    height = side * min(1.0, max(0.3, num_queries / num_keys))
    fig = Figure(figsize=(columns * side + 1.2, rows * height + 1.1), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, columns, squeeze=False)
    x_ticks, x_labels = _ticks(pattern.key_positions, shown.tokens)
    y_ticks, y_labels = _ticks(pattern.query_positions, shown.tokens)
    small = 7 if max(num_queries, num_keys) <= ALL_LABELS else 6
    top = float(probs.max()) if vmax is None else vmax
    image = None
    for index, ax in enumerate(axes.flat):
        if index >= num_heads:
            ax.set_axis_off()
            continue
        image = ax.imshow(probs[index], cmap="Blues", vmin=0.0, vmax=top, aspect="auto", interpolation="nearest")
        ax.set_title(f"head {pattern.heads[index]}", fontsize=9)
        column = index % columns
        bottom = index + columns >= num_heads  # nothing drawn below this panel
        ax.set_xticks(x_ticks, x_labels if bottom else [], rotation=90, fontsize=small)
        ax.set_yticks(y_ticks, y_labels if column == 0 else [], fontsize=small)
        if column == 0:
            ax.set_ylabel("query", fontsize=8)
        if bottom:
            ax.set_xlabel("key", fontsize=8)
    assert image is not None  # num_heads >= 1
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight")
    title = " · ".join(part for part in (shown.model, f"layer {pattern.layer}") if part)
    prompt_text = shown.prompt if len(shown.prompt) <= 110 else shown.prompt[:107] + "..."
    fig.suptitle(f"{title}\n" + prompt_text.replace("\n", " ").replace("$", r"\$"), fontsize=10)
    return fig


def image_heats(shown, pattern, rows=None) -> tuple[list[torch.Tensor], list[int]]:
    """What `plot` lays over each image of a prompt: per image (each view of one, `shown.images`), [heads + 1, grid
    rows, grid columns], each head's attention from the query positions `rows` (default the last; averaged over
    several) to the image's tokens on its grid, then the heads' mean; and the query positions drawn."""
    positions = pattern.query_positions
    chosen = [positions[-1]] if rows is None else [rows] if isinstance(rows, int) else list(rows)
    chosen = [row % len(shown.tokens) for row in chosen]
    missing = [row for row in chosen if row not in positions]
    if missing:
        raise IndexError(f"rows {missing} are not among the pattern's query positions")
    at = [positions.index(row) for row in chosen]
    keys = {position: column for column, position in enumerate(pattern.key_positions)}
    mean_rows = pattern.probs[:, at].mean(1)  # [heads, key]
    heats = []
    for image in shown.images:
        grid = mean_rows[:, [keys[p] for p in image.positions]].reshape(len(pattern.heads), *image.grid)
        heats.append(torch.cat([grid, grid.mean(0, keepdim=True)]))
    return heats, chosen


def _over_images(Figure, FigureCanvasAgg, shown, pattern, rows, dpi):
    """The figure of attention over a prompt's images: a row of panels per image (per view), a column per head and the
    mean."""
    found, chosen = image_heats(shown, pattern, rows)
    heats = [heat.numpy() for heat in found]
    panels = [*(f"head {h}" for h in pattern.heads), "mean of heads"]
    top = max(float(heat.max()) for heat in heats)  # attention to one image token is small: the largest is the top
    columns, side = len(panels), 2.4
    fig = Figure(figsize=(columns * side + 1.2, len(heats) * side + 1.0), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heats), columns, squeeze=False)
    drawn = None
    for number, (row_axes, image, heat) in enumerate(zip(axes, shown.images, heats)):
        height, width = image.pixels.shape[:2]
        row_axes[0].set_ylabel(image.name or f"image {number}", fontsize=9)
        for index, ax in enumerate(row_axes):
            ax.imshow(image.pixels.numpy(), interpolation="bilinear")
            drawn = ax.imshow(
                heat[index],
                cmap="inferno",
                vmin=0.0,
                vmax=top,
                alpha=0.6,
                extent=(0, width, height, 0),
                interpolation="nearest",
            )
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(panels[index], fontsize=9)
    assert drawn is not None
    fig.colorbar(drawn, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight (to the largest drawn)")
    said = ", ".join(f"{row} {_label(shown.tokens[row])}" for row in chosen)
    title = " · ".join(part for part in (shown.model, f"layer {pattern.layer}") if part)
    fig.suptitle(f"{title}\nattention from query {said} to each image's tokens", fontsize=10)
    return fig
