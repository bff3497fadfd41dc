"""`support()`'s report: which values a layer serves and, for each that it doesn't, why; and which analyses built on
them (attribution, patching, ...) the layer serves, answered by the tools layer through `register_analyses`."""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.table import Table

#: (model, layer) -> {analysis: None or why not}: filled by the layers above (attnlens.analysis registers itself when
#: imported, and importing attnlens imports it), so this layer names no analysis itself.
_ANALYSES: list[Callable[[Any, int], dict[str, str | None]]] = []


def register_analyses(answer: Callable[[Any, int], dict[str, str | None]]) -> None:
    """Add `answer(model, layer)` to what `Support.analyses` reports (registering the same function twice is once)."""
    if answer not in _ANALYSES:
        _ANALYSES.append(answer)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Support(Mapping[str, str | None]):
    """Value key (`"self_attn.attention_probabilities"`, `"layer_input"`, `"logits"`) -> None or the reason.

    Reads like a mapping (`report[key]`, iteration in forward order) and prints as a table.
    """

    family: str
    layer: int
    engine: str = "transformers"
    reasons: dict[str, str | None]
    #: What a served value means on this family and engine, where it says more than docs/values.md.
    notes: dict[str, str] = dataclasses.field(default_factory=dict)
    #: The engine's model the report is of (set by the engines; None in vLLM's worker): the analyses are asked of it.
    model: Any = dataclasses.field(default=None, repr=False, compare=False)
    #: Values of the catalogue outside this block's vocabulary (a decoder-only block's cross-attention), with the
    #: reason: `report[key]` answers them, the table and iteration leave them out.
    omitted: dict[str, str] = dataclasses.field(default_factory=dict, repr=False)

    @functools.cached_property
    def analyses(self) -> dict[str, str | None]:
        """Analysis (`"attribution"`, `"patch:heads"`, `"knock_out"`, ...) -> None (served on this layer) or why not.
        Worked out on first use (each analysis probes the model's modules once), never in a run."""
        found: dict[str, str | None] = {}
        if self.model is not None:
            for answer in _ANALYSES:
                found.update(answer(self.model, self.layer))
        return found

    def __getitem__(self, key: str) -> str | None:
        if key in self.omitted:
            return self.omitted[key]
        if key not in self.reasons:
            raise KeyError(f"{key!r} is not a standardized value; known: {', '.join(self.reasons)}")
        return self.reasons[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.reasons)

    def __len__(self) -> int:
        return len(self.reasons)

    @property
    def available(self) -> list[str]:
        return [key for key, reason in self.reasons.items() if reason is None]

    @property
    def unavailable(self) -> dict[str, str]:
        return {key: reason for key, reason in self.reasons.items() if reason is not None}

    def __rich__(self) -> Table:
        from rich.table import Table

        table = Table(title=f"{self.family} · layer {self.layer} · {self.engine}", title_justify="left")
        table.add_column("value")
        table.add_column("status")
        table.add_column("note or reason", overflow="fold")
        for key, reason in self.reasons.items():
            status = "[green]available[/]" if reason is None else "[red]unavailable[/]"
            table.add_row(key, status, reason or self.notes.get(key, ""))
        for name, reason in self.analyses.items():
            status = "[green]served[/]" if reason is None else "[red]unavailable[/]"
            table.add_row(f"analysis: {name}", status, reason or "")
        return table

    def __str__(self) -> str:
        from rich.console import Console

        console = Console(width=120, record=True, file=io.StringIO())
        console.print(self)
        return console.export_text()
