"""What the analyses' results share: rich tables as text, PNG heatmaps in attnlens.plot's style."""

from __future__ import annotations

import io
from pathlib import Path

import torch


def render(table, width: int = 140) -> str:
    """A rich renderable as plain text."""
    from rich.console import Console

    console = Console(width=width, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def heatmap(
    values: torch.Tensor,
    out,
    *,
    title: str,
    x_label: str,
    y_label: str,
    x_ticks=None,
    y_ticks=None,
    dpi: int = 150,
    label: str = "contribution",
) -> Path:
    """Write a [rows, columns] grid of signed numbers as a PNG (a diverging map centred on zero, NaN blank)."""
    from ..plot import _label

    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"{out}: plots are written as .png")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ModuleNotFoundError:
        raise ModuleNotFoundError("plots need matplotlib: pip install matplotlib (or attnlens[plot])") from None
    grid = values.detach().float().cpu().numpy()
    rows, columns = grid.shape
    finite = abs(grid[grid == grid]) if (grid == grid).any() else [1.0]
    top = float(max(finite.max() if hasattr(finite, "max") else 1.0, 1e-12))
    fig = Figure(figsize=(min(14.0, 1.6 + 0.32 * columns), min(12.0, 1.4 + 0.26 * rows)), dpi=dpi, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-top, vmax=top, aspect="auto", interpolation="nearest")
    if x_ticks is not None:
        ax.set_xticks(range(columns), [_label(str(t)) for t in x_ticks], rotation=90, fontsize=7)
    if y_ticks is not None:
        ax.set_yticks(range(rows), [_label(str(t)) for t in y_ticks], fontsize=7)
    ax.set_xlabel(x_label, fontsize=8)
    ax.set_ylabel(y_label, fontsize=8)
    fig.colorbar(image, ax=ax, shrink=0.8, label=label)
    fig.suptitle(title.replace("$", r"\$"), fontsize=9)
    fig.savefig(out, format="png")
    return out
