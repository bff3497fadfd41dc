"""The `head_attribution` feature: per head, its direct contribution to the logit of the next token at each chosen
row, summed over sources (`attnlens.attribution`'s head pieces, `Attribution.by_head()`).

The next token of a row is the prompt's own (the observed next token) where the row has one, and the model's greedy
prediction on the last row. Per layer, inside the trace, each chosen row's head outputs are formed from the pattern
and the values as the attribution forms them (`probabilities[h, q, s] * values_h[s]`); after the last layer they are
read out through the output projection, the residual multiplier, the final norm frozen at the row's scale and the
unembedding row of the target token (the weights read where the run is: in vLLM's worker on vLLM, `analysis.vllm`).
It needs the final norm and the logits, which no static tap holds, so it keeps the traced path on vLLM (an engine
built eagerly). A norm after attention (Gemma 2 and 3) is frozen at the run's attention output, as the attribution
freezes it; layers whose attention the attribution does not split by head, or whose heads are gated, are not served
(`reason`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .features import Feature, register

READS = ("attention_probabilities", "attention_values", "attention_output")


def reason(model, layer: int) -> str | None:
    from ..analysis import reasons

    why = reasons.model_reason(model) or reasons.split_reason(model, layer)
    if why is None and model.access.reasons(layer).get("attention_gate", "absent") is None:
        why = "its heads are gated (attention_gate), which head_attribution does not fold in"
    return None if why is None else f"direct attribution: {why}"


def prepare(model, layers: list[int]):
    """The attribution's plan (weights read here on eager, in the worker on vLLM), for a unit direction."""
    from ..analysis.attribution import _text_config, final_softcap, plan

    hidden = _text_config(model).hidden_size
    found = plan(model, [0], direction=torch.zeros(hidden), split_layers=layers)
    # a logit's read-out: its multiple of the unembedding is fitted on the run, a final soft-cap undone first
    return replace(found, what="logit(next token)", softcap=final_softcap(model), logit_on_the_run=True)


def compute(context) -> dict:
    """Each chosen row's head outputs [rows, heads, head_dim], formed from the pattern and the values."""
    plan = context.state
    rows = context.rows()
    probabilities = context.values["attention_probabilities"][0][:, rows].float()  # [heads, rows, sources]
    values = context.values["attention_values"][0].float()  # [kv_heads, sources, head_dim]
    kv_of_head = plan.layers[context.layer].kv_of_head.to(values.device)
    found = {"_head_outputs": torch.einsum("hrs,hse->rhe", probabilities, values[kv_of_head])}
    if plan.layers[context.layer].post is not None:  # a norm after attention, frozen at the run's attention output
        found["_attention_output"] = context.values["attention_output"][0][rows].float()
    return found


def finish(model, plan, prompt) -> None:
    """After the last layer: the head outputs read out to the target tokens' logits, per head [heads, rows]."""
    from ..analysis.attribution import _readout_multiple
    from ..analysis.attribution import prepare as prepare_weights
    from ..analysis.vllm import prepare as prepare_in_worker

    if plan.unembedding is None:  # read once, where the run is (in vLLM's worker: its own weights)
        if plan.engine == "vllm":
            prepare_in_worker(model, plan, prepare_weights)
        else:
            prepare_weights(model, plan)
    rows = prompt.rows
    residual = prompt.finals["layer_output"][0][rows].float()
    normed = prompt.finals["final_norm_output"][0].float()
    logits = prompt.finals["logits"][0, -1].float()
    ids = prompt.ids
    targets = [int(ids[row + 1]) if row + 1 < len(ids) else int(logits.argmax()) for row in rows]
    weight, bias = plan.unembedding
    plain = weight.float() @ normed[-1] + (0 if bias is None else bias.float())
    found = {
        "last_plain": plain[: logits.shape[-1]].cpu(),
        "last_logits": logits.cpu(),
        "dtype": prompt.finals["final_norm_output"].dtype,
    }
    multiple = _readout_multiple(model, plan, found)
    final = plan.final.to(residual.device)
    readout = final.pullback(weight[targets].float().to(residual.device)) * multiple / final.scale(residual)
    for layer, columns in prompt.columns.items():
        layer_plan = plan.layers[layer]
        z = columns.pop("_head_outputs")  # [rows, heads, head_dim]
        into = readout * layer_plan.multiplier.to(readout.device)  # [rows, hidden]
        if layer_plan.post is not None:
            post = layer_plan.post.to(into.device)
            into = post.pullback(into) / post.scale(columns.pop("_attention_output").to(into.device))
        per_head = (into @ layer_plan.weight.to(into.device)).view(len(rows), z.shape[1], -1)  # W_O[:, h]^T into
        totals = (per_head * z.to(into.device)).sum(-1)  # [rows, heads]
        heads = totals.shape[1]
        columns["attribution_rows"] = torch.tensor(rows, dtype=torch.int32).expand(heads, -1)
        columns["attribution_tokens"] = torch.tensor(targets, dtype=torch.int32).expand(heads, -1)
        columns["attribution"] = totals.T.contiguous().cpu()


register(
    Feature(
        "head_attribution",
        "each head's direct contribution to the logit of the next token (the observed one; on the last row the "
        "greedy prediction) at each chosen row (attribution_rows), summed over sources; the tokens in "
        "attribution_tokens",
        READS,
        {"attribution_rows": "list<int32>", "attribution_tokens": "list<int32>", "attribution": "list<float32>"},
        compute,
        prepare=prepare,
        finish=finish,
        reason=reason,
    )
)
