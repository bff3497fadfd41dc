"""Running many prompts: token ids from any input, batches of similar lengths (left-padded on eager, one request
each on vLLM), a progress bar, and results held or written to disk as safetensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..inputs import check_inputs


def _as_ids(model, prompt) -> torch.Tensor:
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids")
        return model.tokenizer(prompt, return_tensors="pt")["input_ids"][0]
    ids = torch.as_tensor(prompt)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.is_floating_point():
        raise ValueError(f"a prompt is a string or 1-D token ids; got {tuple(ids.shape)} {ids.dtype}")
    return ids


def prompts_of(model, inputs) -> tuple[list[torch.Tensor], bool]:
    """(token ids of each prompt, whether `inputs` is one prompt).

    One prompt: a string, 1-D ids, a [1, seq] tensor or a list of ints. Several: a list (of strings or ids), a
    [batch, seq] tensor, or an encoding with `input_ids` and `attention_mask` (padding is dropped)."""
    if isinstance(inputs, Mapping):
        ids = torch.as_tensor(inputs["input_ids"])
        ids = ids[None] if ids.dim() == 1 else ids
        mask = inputs.get("attention_mask")
        rows = list(ids) if mask is None else [row[torch.as_tensor(m).bool()] for row, m in zip(ids, mask)]
        return rows, len(rows) == 1
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2:
        return list(inputs), inputs.shape[0] == 1
    if isinstance(inputs, (list, tuple)) and not all(isinstance(x, int) for x in inputs):
        return [_as_ids(model, prompt) for prompt in inputs], False
    return [_as_ids(model, inputs)], True


def checked_prompts(model, inputs) -> tuple[list[torch.Tensor], bool]:
    """`prompts_of`, refusing empty input before anything runs."""
    check_inputs((inputs,))
    prompts, single = prompts_of(model, inputs)
    if not prompts:
        raise ValueError("no prompts given: pass at least one prompt (a string or token ids)")
    for i, ids in enumerate(prompts):
        if len(ids) == 0:
            raise ValueError(f"prompt {i} has no tokens: a forward needs at least one")
    return prompts, single


def batches(model, lengths: list[int], batch_size: int) -> list[list[int]]:
    """Prompt indexes in batches of similar lengths (longest first), so little padding is computed; only equal
    lengths share a forward where the family's values change under left padding (`Family.padding_changes_values`)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if model.family.padding_changes_values is None:
        return [order[at : at + batch_size] for at in range(0, len(order), batch_size)]
    found: list[list[int]] = []
    for i in order:
        if found and len(found[-1]) < batch_size and lengths[found[-1][0]] == lengths[i]:
            found[-1].append(i)
        else:
            found.append([i])
    return found


def _progress(show: bool | None, total: int, batch_size: int):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    show = total > batch_size if show is None else show
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not show,
        transient=False,
    )


class Stored(Sequence):
    """Results written to disk, one safetensors file per prompt; indexing loads one prompt's result."""

    def __init__(self, paths: list[Path], load: Callable[[dict], Any]):
        self.paths = paths
        self._load = load

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(len(self))[index]]
        from safetensors.torch import load_file

        return self._load(load_file(self.paths[index]))

    def __repr__(self) -> str:
        where = self.paths[0].parent if self.paths else "-"
        return f"Stored({len(self)} results in {where})"


def run(
    model,
    prompts: list[torch.Tensor],
    collect,
    *,
    batch_size: int,
    progress: bool | None,
    save_to: str | Path | None,
    kind: str,
) -> list:
    """Run `prompts` in batches; `collect(indexes, spans)`, called inside each trace with the batch's prompt indexes
    and where each prompt's tokens lie (`spans`), returns one flat dict of tensors per prompt. Returns them in prompt
    order, or their files."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    lengths = [len(ids) for ids in prompts]
    results: list = [None] * len(prompts)
    folder = None if save_to is None else Path(save_to)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
    with _progress(progress, len(prompts), batch_size) as bar, torch.no_grad():
        task = bar.add_task(f"attnlens {kind}", total=len(prompts))
        for batch in batches(model, lengths, batch_size):
            collected = (
                _requests(model, prompts, batch, collect)
                if _per_request(model)
                else _padded(model, prompts, batch, collect)
            )
            for i, flat in zip(batch, collected):
                results[i] = flat if folder is None else _write(folder / f"{i:06d}.safetensors", flat, kind)
            bar.advance(task, len(batch))
    return results


def _per_request(model) -> bool:
    """vLLM serves each prompt as its own request (batch axis 1, no padding); it batches them itself."""
    return model.access.engine == "vllm"


def spans(model, lengths: list[int]) -> list[slice]:
    """Where each of a padded batch's prompts (of `lengths` tokens) lies along its positions: after the padding where
    the tokenizer pads on the left (nnsight left-pads a causal LM and gives the padded rows mask-derived positions),
    before it where it pads on the right (an encoder's, so that its positions stay its own). On vLLM (a request per
    prompt, no padding) the whole sequence: `[slice(0, None)]`."""
    longest = max(lengths)
    if getattr(model.tokenizer, "padding_side", "left") == "right":
        return [slice(0, length) for length in lengths]
    return [slice(longest - length, longest) for length in lengths]


def _padded(model, prompts, batch, collect) -> list[dict]:
    """One eager forward over the batch, padded as the tokenizer pads (`spans`)."""
    batch_input = prompts[batch[0]][None] if len(batch) == 1 else [prompts[i] for i in batch]
    collected: list[dict] = []
    with model.trace(batch_input):
        collected.extend(collect(batch, spans(model, [len(prompts[i]) for i in batch])))
    return collected


def _requests(model, prompts, batch, collect) -> list[dict]:
    """One vLLM request per prompt. The reads run in vLLM's worker, which receives the trace shipped with the
    request, so results come back only through `.save()`."""
    out = []
    for i in batch:
        with model.trace(prompts[i].tolist()):
            collected = list().save()
            collected.extend(collect([i], [slice(0, None)]))
        out.extend(collected)
    return out


def _write(path: Path, flat: dict[str, torch.Tensor], kind: str) -> Path:
    from safetensors.torch import save_file

    save_file({key: t.contiguous() for key, t in flat.items()}, str(path), metadata={"attnlens": kind})
    return path


def deliver(results: list, single: bool, save_to, load: Callable[[dict], Any]):
    if save_to is not None:
        return Stored(results, load)
    out = [load(flat) for flat in results]
    return out[0] if single else out
