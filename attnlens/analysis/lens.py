"""The logit lens: every layer's residual stream (`layer_input`, `layer_mid`, `layer_output`) read through the
family's own final norm and unembedding, as if the model stopped there.

Each residual row is normalised at its own scale (the final norm's form, `NormForm`, checked on the run against
`final_norm_output`), then unembedded and multiplied as the logits are (Granite's `1 / logits_scaling`); a final
soft-cap is not applied, so the last `layer_output`'s lens equals the logits before the cap. The sums run where the
run is (vLLM's worker included): only the top tokens and the logits of the tokens asked for leave it. The residual
stream split into per-layer and per-head pieces along any direction is `attnlens.attribution(direction=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import Unavailable
from .attribution import _name, _readout_multiple, final_softcap, rows_of, run_tolerance, token_id, unembedding
from .reasons import final_norm_form, model_reason

SITES = ("layer_input", "layer_mid", "layer_output")


@dataclass
class LensPlan:
    sites: dict[int, list[str]]  #: layer -> the residual values read there, in forward order
    final: object  #: NormForm
    rows: list[int]
    tokens: list[int]
    top_k: int
    softcap: float | None
    engine: str
    final_norm_path: str
    embed_tokens_path: str
    what: str = "logit lens"  # `_readout_multiple` reads `what`
    unembedding: tuple | None = None


def collect(model, plan: LensPlan, found: dict) -> None:
    """Inside a trace: each site's lens logits, reduced to the top tokens and the tokens asked for."""
    weight, bias = unembedding(model, plan.engine, plan.embed_tokens_path)
    if plan.engine == "vllm":
        from .vllm import with_weights

        plan.final = with_weights(plan.final, model._module.get_submodule(plan.final_norm_path), weight.shape[-1])
    weight = weight.float()
    final = plan.final.to(weight.device)

    def lens(x):
        out = final.apply(x.float()) @ weight.T + (0 if bias is None else bias.float())
        return out[..., :vocab]

    vocab = None
    read = []
    for layer, names in plan.sites.items():
        for name in names:
            read.append(((layer, name), getattr(model.layers[layer], name)[0][plan.rows]))
    norm_read = model.final_norm_output[0]
    norm_output = norm_read.float()
    logits = model.logits[0, -1].float()
    vocab = logits.shape[-1]
    sites = [site for site, _ in read]
    stacked = torch.stack([x for _, x in read])  # [sites, rows, hidden]
    out = lens(stacked)  # [sites, rows, vocab]
    top = out.topk(plan.top_k, dim=-1)
    found.update(
        sites=sites,
        top_values=top.values.cpu(),
        top_ids=top.indices.cpu(),
        token_logits=out[..., plan.tokens].cpu(),
        last_site=out[-1].cpu(),
        final_check=float((final.apply(stacked[-1]) - norm_output[plan.rows]).abs().max()),
        final_scale=float(norm_output[plan.rows].abs().max()),
        dtype=norm_read.dtype,
        last_plain=(norm_output[-1] @ weight.T + (0 if bias is None else bias.float()))[:vocab].cpu(),
        last_logits=logits.cpu(),
    )


@dataclass
class LogitLens:
    """Per site (layer, residual value) and row: the top tokens of the lens, and the logits of `tokens`."""

    model: str
    tokens: list[str]  #: the prompt's tokens
    rows: list[int]
    sites: list[tuple[int, str]]
    top_ids: torch.Tensor  #: [sites, rows, k]
    top_values: torch.Tensor
    asked: list[int]  #: token ids whose logits are kept
    token_logits: torch.Tensor  #: [sites, rows, len(asked)]
    last: torch.Tensor  #: [rows, vocab]: the last site's lens (the last layer_output): equals the logits before any cap
    decode: list[list[list[str]]] = field(default_factory=list)  #: [sites][rows][k] the top tokens as text
    notes: list[str] = field(default_factory=list)

    def to_rows(self) -> list[dict]:
        out = []
        for s, (layer, name) in enumerate(self.sites):
            for r, row in enumerate(self.rows):
                entry = {
                    "layer": layer,
                    "site": name,
                    "row": row,
                    "top": [
                        (self.decode[s][r][k], round(float(self.top_values[s, r, k]), 4))
                        for k in range(self.top_ids.shape[-1])
                    ],
                }
                entry.update({f"logit[{t}]": float(self.token_logits[s, r, j]) for j, t in enumerate(self.asked)})
                out.append(entry)
        return out

    def to_dataframe(self):
        import pandas

        return pandas.DataFrame(self.to_rows())

    def table(self, row: int = 0):
        from rich.table import Table

        table = Table(
            title=f"logit lens · {self.model} · row {self.rows[row]} ({self.tokens[self.rows[row]]!r})",
            title_justify="left",
        )
        for column in ("layer", "site", "top tokens", *(f"logit[{t}]" for t in self.asked)):
            table.add_column(column)
        for s, (layer, name) in enumerate(self.sites):
            tops = ", ".join(
                f"{self.decode[s][row][k]!r} {float(self.top_values[s, row, k]):.2f}"
                for k in range(self.top_ids.shape[-1])
            )
            table.add_row(
                str(layer), name, tops, *(f"{float(self.token_logits[s, row, j]):.3f}" for j in range(len(self.asked)))
            )
        table.caption = "; ".join(self.notes)
        return table

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        from .results import render

        return render(self.table())

    def plot(self, out, row: int = 0, dpi: int = 150):
        """A PNG: the logits of the tokens asked for, per site (rows of the grid) and token."""
        from .results import heatmap

        return heatmap(
            self.token_logits[:, row],
            out,
            title=f"{self.model} · logit lens at row {self.rows[row]}",
            x_label="token",
            y_label="site",
            x_ticks=[str(t) for t in self.asked],
            y_ticks=[f"{layer} {name}" for layer, name in self.sites],
            dpi=dpi,
            label="logit",
        )


def logit_lens(model, prompt, rows=-1, tokens=(), top_k: int = 5, layers=None) -> LogitLens:
    """The logit lens of `prompt` at query `rows` on every layer's `layer_input`, `layer_mid` (where served) and
    `layer_output` (or those of `layers`); `tokens` (ids or one-token strings) whose logits are kept at every site."""
    from ..capture import prompts_of

    reason = model_reason(model)
    if reason is not None:
        raise Unavailable(f"logit lens on {model.family.name}: {reason}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1; got {top_k}")
    ids = prompts_of(model, prompt)[0]
    if len(ids) != 1:
        raise ValueError(f"logit_lens takes one prompt; got {len(ids)}")
    ids = ids[0]
    chosen = (
        list(range(model.num_layers))
        if layers is None
        else sorted({model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)})
    )
    if chosen[-1] != model.num_layers - 1:
        chosen.append(model.num_layers - 1)  # the last layer_output anchors the identity with the logits
    sites = {}
    for layer in chosen:
        order = model.order(layer)
        sites[layer] = sorted((name for name in SITES if name in order), key=lambda name: order[name])
    asked = [token_id(model, token) for token in tokens]
    engine = model.access.engine
    plan = LensPlan(
        sites,
        final_norm_form(model),
        rows_of(rows, len(ids)),
        asked,
        top_k,
        final_softcap(model),
        engine,
        model.family.path("final_norm", engine),
        model.family.path("embed_tokens", engine),
    )
    if engine == "vllm":
        with torch.no_grad(), model.trace(ids.tolist(), max_tokens=1, temperature=0.0):
            found = [{}].save()
            collect(model, plan, found[0])
        found = found[0]
    else:
        found = {}
        with torch.no_grad(), model.trace(ids[None]):
            collect(model, plan, found)
    if found["final_check"] > run_tolerance(found["dtype"]) * max(1.0, found["final_scale"]):
        raise Unavailable(
            f"logit lens on {model.family.name}: the final norm frozen as {plan.final.name} does not "
            f"give the run's final_norm_output (off by {found['final_check']:.2e})"
        )
    multiple = _readout_multiple(model, plan, found)
    notes = [f"each residual row normalised by the final norm {plan.final.module} at its own scale"]
    if plan.softcap is not None:
        notes.append(f"before the final soft-cap tanh(x / {plan.softcap}) * {plan.softcap}")
    if multiple != 1.0:
        notes.append(f"multiplied by {multiple:.6g}, as the logits are")
    tokenizer = getattr(model, "tokenizer", None)

    def text(i):
        return tokenizer.decode([int(i)]) if tokenizer is not None else str(int(i))

    decode = [[[text(i) for i in row] for row in site] for site in found["top_ids"].tolist()]
    return LogitLens(
        model=_name(model),
        tokens=[text(i) for i in ids],
        rows=plan.rows,
        sites=found["sites"],
        top_ids=found["top_ids"],
        top_values=found["top_values"] * multiple,
        asked=asked,
        token_logits=found["token_logits"] * multiple,
        last=found["last_site"] * multiple,
        decode=decode,
        notes=notes,
    )
