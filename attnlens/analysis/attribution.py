"""Direct attribution by head and source position: how much each head, reading each key, adds to a logit.

For a query row `q` and a read-out `direction` of the final norm's output (a token's unembedding, a difference of
two, any vector), the logit is split into pieces that add up to it exactly:

    logit = embeddings + sum over layers (sum over heads h and sources s of heads[h, s] + attention bias + rest)
            + final bias

    heads[h, s] = probabilities[h, q, s] * values_h[s] @ W_O[:, h] . u        (u: `direction` pulled back)

The final norm is frozen at its scale on the run's own final residual (`NormForm`): with that scale held, the norm
is linear and the residual's pieces pass through it one by one. A norm after attention (Gemma 2 and 3) is frozen the
same way at the run's attention output, a residual multiplier (Granite) is a constant. `rest` is what else the block
adds (its MLP); a layer whose attention cannot be split (`reasons.split_reason`) gives its whole attention update as
one term. Final logit soft-caps are outside the split: the decomposed value is the logit before the cap.

The sums are computed inside the run, a layer at a time, as the values are formed (`collect`); on vLLM that body
runs in the worker, so only the `[rows, heads, sources]` numbers leave it.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from ..checks import TOLERANCE
from ..errors import Unavailable
from ..family import final_softcap
from .norms import NormForm
from .reasons import (
    direction_reason,
    final_norm_form,
    hidden_size,
    model_reason,
    on_stages,
    output_map,
    post_norm_form,
    residual_multiplier,
    split_reason,
)

if TYPE_CHECKING:
    from .vllm import Held

#: The residual values read per layer, and those a split layer adds.
BLOCK_READS = ("layer_input", "layer_mid", "layer_output")
SPLIT_READS = (
    "self_attn.attention_values",
    "self_attn.attention_probabilities",
    "self_attn.attention_gate",
    "self_attn.attention_output",
)


# --- what to read and with which weights ---------------------------------------------------------------------------


@dataclass
class LayerPlan:
    """How one layer is read and split."""

    reads: list[str]  #: value keys, in forward order
    split: bool
    reason: str | None = None  #: why it is not split
    weight: torch.Tensor | None = None  #: the output projection's [hidden, heads * head_dim], float32
    bias: torch.Tensor | None = None  #: its bias [hidden] or None
    kv_of_head: torch.Tensor | None = None  #: [heads]: the key/value head each query head reads
    head_dim: int = 0
    post: NormForm | None = None  #: the norm between the attention output and the residual add
    multiplier: torch.Tensor | None = None  #: the residual add's multiplier of the update [hidden]


@dataclass
class Plan:
    layers: dict[int, LayerPlan]
    final: NormForm
    directions: torch.Tensor | None  #: [rows, hidden]: the read-outs of the final norm's output, float32
    offsets: torch.Tensor | None  #: [rows]: what the read-out adds (the unembedding's bias), float32
    rows: list[int]
    softcap: float | None
    what: str
    engine: str = "transformers"
    #: module paths on the engine: final_norm, output_projection, embed_tokens, attention_post_norm (None: none)
    paths: dict[str, str | None] = field(default_factory=dict)
    tokens: tuple[int, int | None] | None = None  #: (target, versus) where the read-out is a logit
    unembedding: tuple[torch.Tensor, torch.Tensor | None] | None = None  #: weight [vocab, hidden], bias, once read
    #: Whether the read-out is a logit chosen on the run (collect's next token): the unembedding is read then too
    logit_on_the_run: bool = False


def _text_config(model):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def unembedding(model, engine: str, embeddings: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
    """The unembedding's weight [vocab, hidden] and bias [vocab] (or None), where the run is (`embeddings`: the
    input embeddings' path on vLLM, which tied models unembed with)."""
    if engine == "vllm":
        from .vllm import unembedding as vllm_unembedding

        return vllm_unembedding(model._module, embeddings)
    head = model._module.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise Unavailable(f"attribution on {model.family.name}: the model has no output embedding to read tokens with")
    return head.weight, getattr(head, "bias", None)


def token_id(model, token) -> int:
    """A token given as an id or as text that is exactly one token."""
    if isinstance(token, int) and not isinstance(token, bool):
        vocab = _text_config(model).vocab_size
        if not 0 <= token < vocab:
            raise ValueError(f"token id {token} is outside the vocabulary [0, {vocab})")
        return token
    if not isinstance(token, str):
        raise TypeError(f"a token is an int id or a string; got {type(token).__name__}")
    ids = model.tokenizer(token, add_special_tokens=False).input_ids
    if len(ids) != 1:
        pieces = [model.tokenizer.decode([i]) for i in ids]
        raise ValueError(
            f"{token!r} is {len(ids)} tokens ({pieces}), not one; pass a single token (mind the leading "
            f"space) or its id"
        )
    return ids[0]


def kv_of_head(model, layer: int) -> torch.Tensor:
    heads = model.access.geometry(layer)
    paired = model.family.score_function().repeat_kv(torch.arange(heads.num_kv_heads).view(1, -1, 1, 1), heads.groups)
    return paired.flatten()


def plan(model, rows: list[int], target=None, versus=None, direction=None, *, split_layers=None) -> Plan:
    """What `collect` reads and with which weights; raises `Unavailable` where the model serves no attribution (a
    `direction=` of the final norm's output is served where only the modules after the final norm are not linear:
    an encoder's prediction head, a classifier's)."""
    reason = direction_reason(model) if direction is not None else model_reason(model)
    if reason is not None:
        hint = ""
        if direction is None and direction_reason(model) is None:
            hint = (
                "; a direction of final_norm_output (attribution(..., direction=vector): what the head reads) is "
                "decomposed exactly"
            )
        raise Unavailable(f"attribution on {model.family.name}: {reason}{hint}")
    final = final_norm_form(model)
    if (target is None) == (direction is None):
        raise ValueError("attribution takes a target token (with an optional versus token) or a direction, not both")
    if direction is not None:
        if versus is not None:
            raise ValueError("versus goes with target, not with direction")
        direction = torch.as_tensor(direction, dtype=torch.float32)
        hidden = hidden_size(model)
        if direction.shape not in ((hidden,), (len(rows), hidden)):
            raise ValueError(
                f"direction must be [{hidden}] (the final norm output's basis) or [rows, {hidden}]; got "
                f"{list(direction.shape)}"
            )
        directions, offsets = direction.expand(len(rows), -1).clone(), torch.zeros(len(rows))
        tokens, softcap, what = None, None, "direction . final_norm_output"
    else:
        tokens = (token_id(model, target), None if versus is None else token_id(model, versus))
        directions = offsets = None  # read off the unembedding where the run is (`prepare`)
        what = f"logit({_label(model, tokens[0])})" + (
            f" - logit({_label(model, tokens[1])})" if versus is not None else ""
        )
        softcap = final_softcap(model)
    layers = {}
    chosen = range(model.num_layers) if split_layers is None else split_layers
    for layer in range(model.num_layers):
        why = split_reason(model, layer) if layer in chosen else "not asked for"
        order = model.order(layer)
        wanted = [*BLOCK_READS, *(SPLIT_READS if why is None else ())]
        reads = sorted((key for key in wanted if key in order), key=lambda key: order[key])
        layers[layer] = LayerPlan(reads, why is None, why)
        if why is None:
            layers[layer].kv_of_head = kv_of_head(model, layer)
            layers[layer].head_dim = model.access.geometry(layer).head_dim
            layers[layer].post = post_norm_form(model, layer)
            layers[layer].multiplier = residual_multiplier(model, layer)
    engine = model.access.engine
    roles = ("final_norm", "output_projection", "embed_tokens", "attention_post_norm")
    paths = {role: model.family.path(role, engine) for role in roles}
    found = Plan(layers, final, directions, offsets, rows, softcap, what, engine, paths, tokens)
    if model.access.engine == "transformers":  # on vLLM the worker reads its own weights (vllm.prepare)
        prepare(model, found)
    return found


def prepare(model, plan: Plan, stage: Held | None = None) -> None:
    """The weights `plan` computes with, read off the model's modules where the run is (eager: before the trace; a
    pipeline stage: those of the blocks it holds, and the read-out on the stage holding the unembedding)."""
    if (stage is None or stage.last) and (plan.tokens is not None or plan.logit_on_the_run):
        # a direction= alone reads none (a classifier has none)
        weight, bias = unembedding(model, plan.engine, plan.paths["embed_tokens"])
        plan.unembedding = (weight.detach(), None if bias is None else bias.detach())
        if plan.tokens is not None:
            read_out(plan, weight, bias)
    for layer, layer_plan in plan.layers.items():
        if layer_plan.split and (stage is None or layer in stage.layers):
            _weights(model, layer, layer_plan, plan)


def read_out(plan: Plan, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """`plan`'s directions and offsets: its target token's unembedding row (minus its versus token's) in `weight`
    [vocab, hidden] and `bias`, one per row."""
    t, v = plan.tokens
    directions = weight[t].detach().float().cpu()
    offsets = bias[t].detach().float().cpu() if bias is not None else torch.zeros(())
    if v is not None:
        directions = directions - weight[v].detach().float().cpu()
        offsets = offsets - (bias[v].detach().float().cpu() if bias is not None else 0)
    rows = len(plan.rows)
    plan.directions, plan.offsets = directions.expand(rows, -1).clone(), offsets.expand(rows).clone()


def stage_read_out(worker, plan: bytes) -> bytes | None:
    """In each worker of a pipelined engine (`analysis.vllm.in_workers`): on the stage holding the final norm, the
    pickled plan's directions and offsets (`read_out` of its unembedding) and the final norm with its weights
    (pickled); None on the others."""
    from .vllm import final_norm_held, unembedding, with_weights

    plan = pickle.loads(plan)
    module = worker.model_runner.nnsight_model._module
    norm = final_norm_held(module, plan)
    if norm is None:
        return None
    if plan.tokens is not None:
        read_out(plan, *unembedding(module, plan.paths["embed_tokens"]))
    return pickle.dumps((plan.directions, plan.offsets, with_weights(plan.final, norm, plan.directions.shape[-1])))


def _label(model, token: int) -> str:
    tokenizer = getattr(model, "tokenizer", None)
    return repr(tokenizer.decode([token])) if tokenizer is not None else str(token)


def _weights(model, layer: int, found: LayerPlan, plan: Plan) -> None:
    """The output projection as a matrix [hidden, heads * head_dim] and its bias."""
    attention = model.layers[layer].self_attn._module
    projection = attention.get_submodule(plan.paths["output_projection"]) if plan.engine == "vllm" else None
    width = len(found.kv_of_head) * found.head_dim
    if plan.engine == "vllm":
        from .vllm import projection_weights

        found.weight, found.bias = projection_weights(projection, width)
    else:  # the family's project_output on the identity: the output projection, where it nests (BERT's output.dense)
        found.weight, found.bias = output_map(model, layer)


def linear_map(module: torch.nn.Module, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An affine module's matrix [out, width] and offset [out] (None where zero), read by running it on the identity:
    the same for a Linear, GPT-2's transposed Conv1D or anything else affine."""
    parameter = next(module.parameters())
    with torch.no_grad():
        basis = torch.eye(width + 1, width, device=parameter.device, dtype=parameter.dtype)  # the last row is zero
        out = module(basis)
    out = (out[0] if isinstance(out, tuple) else out).float()
    offset = out[-1]
    return (out[:-1] - offset).T.contiguous(), (offset if bool(offset.abs().max() > 0) else None)


# --- inside the run ------------------------------------------------------------------------------------------------


def head_pieces(
    probabilities: torch.Tensor,
    values: torch.Tensor,
    kv_of_head: torch.Tensor,
    weight: torch.Tensor,
    read: torch.Tensor,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows, heads, sources]: what each head adds to `read . attention output`, split by the key it reads.

    `probabilities` [heads, rows, sources], `values` [kv_heads, sources, head_dim], `weight` the output projection's
    [hidden, heads * head_dim], `read` [rows, hidden] the read-out in the attention output's basis, `gate`
    [rows, heads, head_dim] where an output gate multiplies the head outputs."""
    heads, rows, _ = probabilities.shape
    per_head = (read.float() @ weight).view(rows, heads, -1)  # W_O[:, h]^T read
    if gate is not None:
        per_head = per_head * gate.float()
    value_reads = torch.einsum("hse,rhe->rhs", values.float()[kv_of_head.to(values.device)], per_head)
    return probabilities.float().transpose(0, 1) * value_reads


def collect(model, plan: Plan, found: dict, stage: Held | None = None) -> None:
    """Inside a trace (on vLLM, inside its worker): every term of `plan`'s decomposition, unscaled by the final norm,
    into `found` (plain tensors on the CPU); on a pipeline stage (`stage`), those of its own blocks, with the
    embeddings' on the first stage and the final norm's and logits' on the last."""
    rows = plan.rows
    pulled = plan.final.pullback(plan.directions)  # [rows, hidden]
    terms = {"heads": {}, "attention": {}, "attention_bias": {}, "rest": {}, "split_error": {}}
    last = None
    for layer, layer_plan in plan.layers.items():
        if stage is not None and layer not in stage.layers:
            continue
        envoy = model.layers[layer]
        read = {}
        for key in layer_plan.reads:
            host, name = (envoy.self_attn, key.split(".")[1]) if key.startswith("self_attn.") else (envoy, key)
            value = getattr(host, name)
            read[key] = value[0] if key != "self_attn.attention_probabilities" else value[0][:, rows]
        here = pulled.to(read["layer_input"].device)
        for key in ("layer_input", "layer_mid", "layer_output", "self_attn.attention_output"):
            if key in read:
                read[key] = read[key][rows].float()
        if layer == 0:
            terms["embeddings"] = (here * read["layer_input"]).sum(-1).cpu()
        block = (here * (read["layer_output"] - read["layer_input"])).sum(-1)
        attention = None
        if "layer_mid" in read:
            attention = (here * (read["layer_mid"] - read["layer_input"])).sum(-1)
        if layer_plan.split:
            attention, pieces, bias = _split(layer_plan, read, here, rows, attention)
            terms["heads"][layer] = pieces.cpu()
            terms["attention_bias"][layer] = bias.cpu()
        if attention is not None:
            terms["attention"][layer] = attention.cpu()
            block = block - attention
        terms["rest"][layer] = block.cpu()
        last = read["layer_output"]
    terms["directions"], terms["offsets"] = plan.directions.cpu(), plan.offsets.cpu()
    if stage is not None and not stage.last:
        found.update(terms)
        return
    final_read = model.final_norm_output[0]
    final = final_read.float()
    terms["final_residual"] = last.cpu()
    terms["final_norm_output"] = final[rows].cpu()
    if plan.tokens is not None:  # the read-out checked against the logits (a direction= reads none)
        logits = model.logits[0, -1].float()
        weight, bias = plan.unembedding
        plain = weight.float() @ final[-1] + (0 if bias is None else bias.float())
        terms["last_plain"] = plain[: logits.shape[-1]].cpu()  # vLLM pads its vocabulary
        terms["last_logits"] = logits.cpu()
    terms["final_form"] = plan.final.to("cpu")
    terms["dtype"] = final_read.dtype
    found.update(terms)


def _split(layer_plan: LayerPlan, read: dict, pulled: torch.Tensor, rows, attention_from_residual):
    """The layer's head pieces [rows, heads, sources], bias term [rows] and attention update [rows]."""
    device = pulled.device
    multiplier = layer_plan.multiplier.to(device)
    into_output = pulled * multiplier  # the read-out in the basis of what the residual add receives
    bias = torch.zeros(len(rows), device=device)
    output = read["self_attn.attention_output"]
    if layer_plan.post is not None:  # frozen at the run's attention output
        post = layer_plan.post
        bias = bias + post.bias_term(into_output)
        into_output = post.pullback(into_output) / post.scale(output)
    gate = read.get("self_attn.attention_gate")
    pieces = head_pieces(
        read["self_attn.attention_probabilities"],
        read["self_attn.attention_values"],
        layer_plan.kv_of_head,
        layer_plan.weight.to(device),
        into_output,
        None if gate is None else gate[rows],
    )
    if layer_plan.bias is not None:
        bias = bias + into_output @ layer_plan.bias.to(device)
    attention = attention_from_residual
    if attention is None:  # no layer_mid (a parallel block): the attention update through its own output
        attention = (
            (into_output * output).sum(-1)
            + bias
            - (into_output @ layer_plan.bias.to(device) if layer_plan.bias is not None else 0)
        )
    return attention, pieces, bias


# --- the result ----------------------------------------------------------------------------------------------------


@dataclass
class Attribution:
    """A decomposition of `value` (one per query row) into pieces that add up to it. Every term is a float32 tensor
    with a leading `rows` axis; `heads[layer]` is [rows, heads, sources]."""

    model: str
    tokens: list[str]
    rows: list[int]
    what: str  #: what is decomposed: `logit(' Mary') - logit(' John')`, or `direction . final_norm_output`
    value: torch.Tensor  #: [rows]: the run's own value (before any final soft-cap)
    embeddings: torch.Tensor
    heads: dict[int, torch.Tensor]
    attention_bias: dict[int, torch.Tensor]
    attention: dict[int, torch.Tensor]  #: each layer's whole attention update (split or not)
    rest: dict[int, torch.Tensor]  #: what else each block adds (its MLP)
    final_bias: torch.Tensor  #: the final norm's bias and the unembedding's, read out
    unsplit: dict[int, str] = field(default_factory=dict)  #: layers whose attention is one term, and why
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> torch.Tensor:
        """The sum of every piece: equals `value` (the decomposition's identity)."""
        total = self.embeddings + self.final_bias
        for layer in self.rest:
            total = total + self.rest[layer] + self.attention.get(layer, 0)
        return total

    def split_total(self, layer: int) -> torch.Tensor:
        """The layer's head pieces and bias summed: equals `attention[layer]` (the per-layer identity)."""
        return self.heads[layer].sum((1, 2)) + self.attention_bias[layer]

    def by_span(self, spans: Mapping[str, Sequence[int]]) -> dict[str, torch.Tensor]:
        """Name -> [rows]: the head pieces from the sources in each span, summed over every split layer and head
        ("how much of this logit came from image 1": `model.positions(inputs).spans()` names each image's tokens,
        the text and the special tokens). Only attention reads sources: the embeddings, MLPs, biases and unsplit
        layers are in no span, so the spans of every position add up to the split layers' head pieces."""
        found = {}
        for name, positions in spans.items():
            where = torch.as_tensor(list(positions), dtype=torch.long)
            found[name] = sum(
                (pieces[..., where].sum((1, 2)) for pieces in self.heads.values()), torch.zeros(len(self.rows))
            )
        return found

    def by_head(self) -> dict[int, torch.Tensor]:
        """Layer -> [rows, heads]: each head's contribution summed over sources."""
        return {layer: pieces.sum(-1) for layer, pieces in self.heads.items()}

    def grid(self, row: int = 0) -> torch.Tensor:
        """[layers, heads] of one row (NaN for unsplit layers)."""
        width = max((p.shape[1] for p in self.heads.values()), default=0)
        grid = torch.full((len(self.rest), width), math.nan)
        for layer, pieces in self.heads.items():
            grid[layer, : pieces.shape[1]] = pieces[row].sum(-1)
        return grid

    def top(self, count: int = 10, row: int = 0) -> list[tuple[int, int, int, float]]:
        """The `count` largest pieces by magnitude: (layer, head, source, contribution)."""
        found = [
            (layer, head, source, float(pieces[row, head, source]))
            for layer, pieces in self.heads.items()
            for head in range(pieces.shape[1])
            for source in range(pieces.shape[2])
        ]
        return sorted(found, key=lambda item: -abs(item[3]))[:count]

    def to_rows(self) -> list[dict]:
        """One dict per (row, layer, head, source): the long table `to_dataframe` builds."""
        out = []
        for r, row in enumerate(self.rows):
            for layer, pieces in self.heads.items():
                for head in range(pieces.shape[1]):
                    for source in range(pieces.shape[2]):
                        out.append(
                            {
                                "row": row,
                                "layer": layer,
                                "head": head,
                                "source": source,
                                "token": self.tokens[source],
                                "contribution": float(pieces[r, head, source]),
                            }
                        )
        return out

    def terms(self, row: int = 0) -> list[dict]:
        """The decomposition's terms of one row: embeddings, per layer heads / attention bias / attention (unsplit) /
        rest, final bias; they sum to `value`."""
        out = [{"term": "embeddings", "layer": None, "value": float(self.embeddings[row])}]
        for layer in self.rest:
            if layer in self.heads:
                out.append({"term": "heads", "layer": layer, "value": float(self.heads[layer][row].sum())})
                out.append({"term": "attention bias", "layer": layer, "value": float(self.attention_bias[layer][row])})
            elif layer in self.attention:
                out.append({"term": "attention (unsplit)", "layer": layer, "value": float(self.attention[layer][row])})
            out.append({"term": "rest (mlp)", "layer": layer, "value": float(self.rest[layer][row])})
        out.append({"term": "final bias", "layer": None, "value": float(self.final_bias[row])})
        return out

    def to_dataframe(self):
        import pandas

        return pandas.DataFrame(self.to_rows())

    def table(self, count: int = 15, row: int = 0):
        from rich.table import Table

        table = Table(
            title=f"attribution · {self.model} · {self.what} at row {self.rows[row]} "
            f"({self.tokens[self.rows[row]]!r}) = {float(self.value[row]):.4f}",
            title_justify="left",
        )
        for column in ("layer", "head", "source", "token", "contribution"):
            table.add_column(column, justify="right" if column != "token" else "left")
        for layer, head, source, value in self.top(count, row):
            table.add_row(str(layer), str(head), str(source), repr(self.tokens[source]), f"{value:+.4f}")
        table.caption = "; ".join(self.notes)
        return table

    def __rich__(self):
        return self.table()

    def __str__(self) -> str:
        from .results import render

        return render(self.table())

    def show(self, model, prompt, layers=None, **options):
        """The viewer of `prompt`'s patterns on `model` with this map beside them: `attnlens.show(model, prompt,
        layers, attribution=self, **options)` (by default every layer this splits by head)."""
        from ..show import show

        return show(model, prompt, layers, attribution=self, **options)

    def plot(self, out, layer: int | None = None, row: int = 0, dpi: int = 150):
        """A PNG: the layers x heads grid (each head summed over sources), or with `layer` its heads x sources map."""
        from .results import heatmap

        if layer is None:
            grid = self.grid(row)
            return heatmap(
                grid,
                out,
                title=f"{self.model} · {self.what} at row {self.rows[row]}",
                x_label="head",
                y_label="layer",
                dpi=dpi,
            )
        if layer not in self.heads:
            raise KeyError(
                f"layer {layer} is not split by head" + (f": {self.unsplit[layer]}" if layer in self.unsplit else "")
            )
        return heatmap(
            self.heads[layer][row],
            out,
            title=f"{self.model} · layer {layer} · {self.what}",
            x_label="source",
            y_label="head",
            x_ticks=self.tokens,
            dpi=dpi,
        )


# --- running it ----------------------------------------------------------------------------------------------------


def _finish(model, plan: Plan, found: dict, tokens: list[str]) -> Attribution:
    """The run's terms scaled by the frozen final norm, the read-out's scale fitted and checked on the run."""
    final = found["final_form"]  # as the run completed it (vLLM's worker reads the norm's weight)
    residual, norm_output = found["final_residual"], found["final_norm_output"]
    if not torch.allclose(final.apply(residual), norm_output, atol=1e-3, rtol=1e-3):
        error = float((final.apply(residual) - norm_output).abs().max())
        raise Unavailable(
            f"attribution on {model.family.name}: the final norm {final.module} frozen as {final.name} "
            f"does not give the run's final_norm_output (off by {error:.2e})"
        )
    scale = final.scale(residual)[:, 0]
    multiple, notes = _readout_multiple(model, plan, found), []
    factor = multiple / scale

    def scaled(term):
        return term * factor

    directions, offsets = found["directions"], found["offsets"]
    value = multiple * ((directions * norm_output).sum(-1) + offsets)
    final_bias = multiple * (final.bias_term(directions) + offsets)
    notes.append(f"final norm {final.module} ({final.name}) frozen at its scale on this run's final residual")
    if plan.softcap is not None:
        notes.append(f"decomposes the logits before the final soft-cap tanh(x / {plan.softcap}) * {plan.softcap}")
    if multiple != 1.0:
        notes.append(f"the logits are {multiple:.6g} x the unembedding of the final norm's output")
    unsplit = {layer: p.reason for layer, p in plan.layers.items() if not p.split}
    return Attribution(
        model=_name(model),
        tokens=tokens,
        rows=plan.rows,
        what=plan.what,
        value=value,
        embeddings=scaled(found["embeddings"]),
        heads={k: v * factor[:, None, None] for k, v in found["heads"].items()},
        attention_bias={k: scaled(v) for k, v in found["attention_bias"].items()},
        attention={k: scaled(v) for k, v in found["attention"].items()},
        rest={k: scaled(v) for k, v in found["rest"].items()},
        final_bias=final_bias,
        unsplit=unsplit,
        notes=notes,
    )


def run_tolerance(dtype: torch.dtype) -> float:
    """How far, relative, a float32 read-out may be from what the run computed in `dtype` (bfloat16: to its
    rounding): the logits against the unembedding, the frozen final norm against the run's."""
    return max(1e-3, TOLERANCE.get(dtype, TOLERANCE[torch.float32])[1])


def _readout_multiple(model, plan: Plan, found: dict) -> float:
    """What the logits are a multiple of the unembedding by (1 on most families; Granite's 1 / logits_scaling,
    Cohere's logit_scale), fitted on the run's last position and checked there, the soft-cap undone first."""
    if plan.what.startswith("direction"):
        return 1.0
    plain = found["last_plain"]
    logits = found["last_logits"]
    if plan.softcap is not None:
        logits = plan.softcap * torch.atanh((logits / plan.softcap).clamp(-1 + 1e-6, 1 - 1e-6))
    multiple = float((logits * plain).sum() / (plain * plain).sum())
    multiple = 1.0 if abs(multiple - 1.0) < 1e-5 else multiple
    rtol = run_tolerance(found["dtype"])
    if not torch.allclose(multiple * plain, logits, atol=rtol * float(logits.abs().max()) + 1e-4, rtol=rtol):
        raise Unavailable(
            f"attribution on {model.family.name}: the logits are no multiple of the unembedding of "
            f"final_norm_output" + (" (soft-cap undone)" if plan.softcap else "")
        )
    return multiple


def _name(model) -> str:
    from ..heads import model_name

    return model_name(model)


def rows_of(rows, length: int) -> list[int]:
    rows = [rows] if isinstance(rows, int) else list(rows)
    if not rows:
        raise ValueError("rows is empty: give one query row or more")
    for row in rows:
        if isinstance(row, bool) or not isinstance(row, int) or not -length <= row < length:
            raise IndexError(f"row {row!r} is out of range for a prompt of {length} tokens")
    return [row % length for row in rows]


def stack_attribution(
    model,
    prompt,
    rows=-1,
    target=None,
    versus=None,
    direction=None,
    layers=None,
    max_new_tokens: int = 0,
):
    """`attnlens.attribution` on a model of one stack of blocks (a decoder, an encoder, a multimodal model's
    language model); `analysis.entry.attribution` hands an encoder-decoder to `analysis.seq2seq`."""
    from ..capture import prompts_of

    inputs: dict = {}
    if isinstance(prompt, Mapping):  # a multimodal model's inputs: the ids beside the images
        if max_new_tokens or model.access.engine == "vllm":
            raise ValueError("attribution of a prompt with images runs one forward on the transformers engine")
        inputs = {name: value for name, value in prompt.items() if name != "input_ids"}
        prompt = torch.as_tensor(prompt["input_ids"]).reshape(-1)
    ids = prompts_of(model, prompt)[0]
    if len(ids) != 1:
        raise ValueError(f"attribution takes one prompt; got {len(ids)}")
    ids = ids[0]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens is an int >= 0; got {max_new_tokens!r}")
    with on_stages(model, max_new_tokens):
        the_plan = _planned(model, rows_of(rows, len(ids)), target, versus, direction, layers)
    tokens = (
        [model.tokenizer.decode([int(i)]) for i in ids]
        if getattr(model, "tokenizer", None)
        else [str(int(i)) for i in ids]
    )
    if inputs:
        from ..show import labels

        tokens = labels(model, ids, model.positions(ids, **inputs))
    vllm = model.access.engine == "vllm"
    if max_new_tokens == 0:
        if vllm:
            from .vllm import run_attribution

            found = run_attribution(model, ids, the_plan, prepare, collect, stage_read_out)
        else:
            found = {}
            with torch.no_grad(), model.trace(ids[None], **inputs):
                collect(model, the_plan, found)
        return _finish(model, the_plan, found, tokens)
    from .vllm import prepare as prepare_in_worker  # imported here: the body below runs in vLLM's worker

    steps = [{} for _ in range(max_new_tokens)]  # filled in place on eager; on vLLM saved from the worker
    with (
        torch.no_grad(),
        model.generate(ids.tolist() if vllm else ids[None], max_new_tokens=max_new_tokens, do_sample=False) as tracer,
    ):
        if vllm:
            steps = [{} for _ in range(max_new_tokens)].save()
            prepare_in_worker(model, the_plan, prepare)
        decode, step = decode_plan(the_plan), 0
        for _ in tracer.iter[:max_new_tokens]:
            collect(model, the_plan if step == 0 else decode, steps[step])
            step += 1  # noqa: SIM113 (nnsight's tracer.iter yields no index)
    found = []
    for step, terms in enumerate(steps):
        step_tokens = tokens + [f"<generated {i}>" for i in range(step)]
        step_plan = (
            the_plan if step == 0 else replace(decode_plan(the_plan, prepared=False), rows=[len(step_tokens) - 1])
        )
        found.append(_finish(model, step_plan, terms, step_tokens))
    return found


def _planned(model, rows: list[int], target, versus, direction, layers) -> Plan:
    """`plan` with the layers split by head (`layers`: one, several or None for all), each checked."""
    split_layers = (
        None
        if layers is None
        else [model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)]
    )
    for layer in split_layers or ():
        reason = split_reason(model, layer)
        if reason is not None:
            raise Unavailable(f"attribution: layer {layer} on {model.family.name} is not split by head: {reason}")
    return plan(model, rows, target, versus, direction, split_layers=split_layers)


def decode_plan(plan: Plan, prepared: bool = True) -> Plan:
    """`plan` for a decode step: its one new row (the last), the read-out of the first row."""
    if not prepared or plan.directions is None:
        return replace(plan, rows=[-1])
    return replace(plan, rows=[-1], directions=plan.directions[:1], offsets=plan.offsets[:1])
