"""Direct attribution of an encoder-decoder's decoder logit, by decoder head and source, through the cross-attention
by encoder position (`StandardizedSeq2Seq`; `attnlens.attribution(model, source, target=..., decoder_input_ids=...)`).

A pre-norm decoder block adds three updates to its stream: its self-attention's (`cross_attention_input -
layer_input`), its cross-attention's (`layer_mid - cross_attention_input`) and its MLP's (`layer_output -
layer_mid`). With the decoder's final norm frozen at the run's scale (as for a decoder-only model, `attribution`),

    logit = embeddings + sum over layers (self heads + self bias + cross heads + cross bias + mlp) + final bias

    heads[layer][row, h, t]       = probabilities[h, row, t] * values_h[t] @ W_O[:, h] . u   (t: a decoder position)
    cross_heads[layer][row, h, s] = cross_probabilities[h, row, s] * cross_values_h[s] @ W_O'[:, h] . u
                                                                       (s: an encoder position; the cross values
                                                                        are the encoder's output projected)

`u` is the read-out pulled back through the frozen final norm. The sum of a cross head's pieces over the encoder's
positions is that head's contribution. What the encoder's own heads do reaches the logit only through the cross
keys and values (not directly): it is inside the cross pieces, not split further. A post-norm decoder (BART,
Marian, PLBART, Blenderbot-small: a norm after every add) has no such sum and is refused, saying so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import Unavailable
from .attribution import Attribution, final_softcap, head_pieces, rows_of, run_tolerance, token_id
from .reasons import (
    ANALYSES,
    ATTRIBUTION,
    affine_output,
    direction_reason,
    frozen_norm,
    hidden_size,
    output_map,
    post_norm_form,
    residual_multiplier,
)
from .reasons import split_reason as self_split_reason

#: The residual values read per decoder block, in forward order.
RESIDUAL = ("layer_input", "cross_attention_input", "layer_mid", "layer_output")
SPLIT = ("attention_values", "attention_probabilities", "attention_output")


class DecoderStack:
    """The decoder of a `StandardizedSeq2Seq` as the attribution machinery reads a decoder-only model: its family,
    access, blocks, `support()` and `order()`, and its stack module (where its final norm is)."""

    def __init__(self, model):
        self.model = model
        self.family = model.decoder.family
        self.access = model.stacks["decoder"]
        self.layers = model.decoder.layers
        self.config = model.config
        self.tokenizer = getattr(model, "tokenizer", None)
        self._module = model.decoder._module

    @property
    def num_layers(self) -> int:
        return self.access.num_layers

    def support(self, layer: int = 0):
        return self.model.decoder.support(layer)

    def order(self, layer: int = 0):
        return self.model.decoder.order(layer)


def decoder_stack(model) -> DecoderStack:
    """The model's `DecoderStack`, made once (the reasons are cached on it)."""
    return model.__dict__.setdefault("_attnlens_decoder_stack", DecoderStack(model))


def cross_split_reason(stack: DecoderStack, layer: int) -> str | None:
    """Why block `layer`'s cross-attention update is not split by head and encoder position (None: it is)."""
    cached = stack.__dict__.setdefault("_attnlens_analysis", {})
    if ("cross", layer) not in cached:
        report = stack.support(layer)
        reason = None
        for name in (*SPLIT, "attention_premix"):
            said = report[f"cross_attn.{name}"]
            if said is not None:
                reason = f"cross_attn.{name} is unavailable ({said})"
                break
        if reason is None and not affine_output(stack, layer, stack.layers[layer].cross_attn._module):
            reason = "the cross-attention's output is no affine map of its heads merged (project_output)"
        post = cross_post_norm(stack, layer)
        if reason is None and isinstance(post, str):
            reason = post
        cached["cross", layer] = reason
    return cached["cross", layer]


def cross_post_norm(stack: DecoderStack, layer: int):
    """The frozen form of the norm between block `layer`'s cross-attention output and the residual add (T5Gemma's
    `cross_attention_post_norm`), None where there is none, or why it cannot be frozen."""
    name = getattr(stack.family, "cross_attention_post_norm", None)
    if name is None:
        return None
    module = stack.layers[layer]._module.get_submodule(name)
    form = frozen_norm(stack, module)
    return form if form is not None else f"the norm after the cross-attention, {name}, is no norm attnlens can freeze"


def model_reason(model, direction: bool) -> str | None:
    """Why the decoder's logit (`direction`: a read-out of its final norm's output) is not decomposed (None: it is)."""
    stack = decoder_stack(model)
    reason = direction_reason(stack)
    if reason is None and "cross_attention_input" not in stack.order(0):
        reason = "the decoder blocks' stream after the self-attention (cross_attention_input) is not served"
    if reason is None and not direction and model._module.get_output_embeddings() is None:
        reason = "the model has no output embedding to read tokens with"
    return reason


@dataclass
class Seq2SeqAttribution(Attribution):
    """`Attribution` of a decoder logit of an encoder-decoder: `heads`, `attention`, `attention_bias` are the decoder's
    self-attention (sources: decoder positions, `tokens`); `cross_heads[layer]` [rows, heads, encoder positions],
    `cross_bias`, `cross_attention` its cross-attention (sources: `sources`, the encoder's positions); `rest` the
    MLP."""

    sources: list[str] = field(default_factory=list)
    cross_heads: dict[int, torch.Tensor] = field(default_factory=dict)
    cross_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    cross_attention: dict[int, torch.Tensor] = field(default_factory=dict)
    cross_unsplit: dict[int, str] = field(default_factory=dict)

    @property
    def total(self) -> torch.Tensor:
        total = super().total
        for update in self.cross_attention.values():
            total = total + update
        return total

    def cross_split_total(self, layer: int) -> torch.Tensor:
        """The layer's cross pieces and bias summed: equals `cross_attention[layer]`."""
        return self.cross_heads[layer].sum((1, 2)) + self.cross_bias[layer]

    def by_cross_head(self) -> dict[int, torch.Tensor]:
        """Layer -> [rows, heads]: each cross head's contribution, summed over the encoder's positions."""
        return {layer: pieces.sum(-1) for layer, pieces in self.cross_heads.items()}

    def top_cross(self, count: int = 10, row: int = 0) -> list[tuple[int, int, int, float]]:
        """The `count` largest cross pieces by magnitude: (layer, head, encoder position, contribution)."""
        found = [
            (layer, head, source, float(pieces[row, head, source]))
            for layer, pieces in self.cross_heads.items()
            for head in range(pieces.shape[1])
            for source in range(pieces.shape[2])
        ]
        return sorted(found, key=lambda item: -abs(item[3]))[:count]

    def terms(self, row: int = 0) -> list[dict]:
        out = super().terms(row)
        final = out.pop()
        for layer, update in self.cross_attention.items():
            term = "cross heads" if layer in self.cross_heads else "cross attention (unsplit)"
            out.append({"term": term, "layer": layer, "value": float(update[row])})
        return [*out, final]


def _labels(model, ids) -> list[str]:
    tokenizer = getattr(model, "tokenizer", None)
    return [tokenizer.decode([int(i)]) for i in ids] if tokenizer is not None else [str(int(i)) for i in ids]


def _ids(model, tokens) -> torch.Tensor:
    from ..capture import prompts_of

    found = prompts_of(model, tokens)[0]
    if len(found) != 1:
        raise ValueError(f"attribution takes one prompt; got {len(found)}")
    return found[0]


def _source(model, prompt) -> tuple[dict, list[str]]:
    """The encoder's inputs and a label per encoder position (`@i` where the input is not tokens: Whisper's frames,
    labelled after the run by the cross keys' length)."""
    if isinstance(prompt, dict) and "input_ids" not in prompt:
        return dict(prompt), []
    ids = _ids(model, prompt)
    return {"input_ids": ids[None]}, _labels(model, ids)


def _kv_of_head(family, module) -> torch.Tensor:
    heads = family.sizes.geometry(module, family)
    paired = family.score_function().repeat_kv(torch.arange(heads.num_kv_heads).view(1, -1, 1, 1), heads.groups)
    return paired.flatten()


def seq2seq_attribution(
    model, prompt, decoder_input_ids, rows=-1, target=None, versus=None, direction=None
) -> Seq2SeqAttribution:
    """See the module's docstring: `prompt` is the encoder's input (text, token ids, or a mapping such as Whisper's
    `{"input_features": ...}`), `decoder_input_ids` the decoder's tokens (text or ids), `rows` decoder positions."""
    if decoder_input_ids is None:
        raise ValueError("attribution on an encoder-decoder takes the decoder's tokens: decoder_input_ids=")
    if (target is None) == (direction is None):
        raise ValueError("attribution takes a target token (with an optional versus token) or a direction, not both")
    if direction is not None and versus is not None:
        raise ValueError("versus goes with target, not with direction")
    stack = decoder_stack(model)
    name = f"attribution on {model.family.name}"
    reason = model_reason(model, direction is not None)
    if reason is not None:
        raise Unavailable(f"{name}: {reason}")
    target_ids = _ids(model, decoder_input_ids)
    chosen = rows_of(rows, len(target_ids))
    inputs, sources = _source(model, prompt)
    hidden = hidden_size(stack)
    root = model._module
    offsets = torch.zeros(len(chosen))
    if direction is not None:
        direction = torch.as_tensor(direction, dtype=torch.float32)
        if direction.shape not in ((hidden,), (len(chosen), hidden)):
            raise ValueError(f"direction must be [{hidden}] or [rows, {hidden}]; got {list(direction.shape)}")
        directions, what = direction.expand(len(chosen), -1).clone(), "direction . final_norm_output"
        weight = bias = None
    else:
        t, v = token_id(model, target), None if versus is None else token_id(model, versus)
        head = root.get_output_embeddings()
        weight = head.weight.detach().float()
        bias = getattr(head, "bias", None)
        bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float()
        extra = getattr(root, "final_logits_bias", None)  # BART's buffer, added after lm_head
        if extra is not None:
            bias = bias + extra.detach().float().reshape(-1)[: bias.shape[0]]
        directions = (weight[t] - (weight[v] if v is not None else 0)).expand(len(chosen), -1).clone()
        offsets = (bias[t] - (bias[v] if v is not None else 0)).expand(len(chosen)).clone()
        label = f"logit({_labels(model, [t])[0]!r})"
        what = label + (f" - logit({_labels(model, [v])[0]!r})" if v is not None else "")
    # what is read, and with which weights
    plans: dict[int, dict[str, Any]] = {}
    for layer in range(stack.num_layers):
        envoy = stack.layers[layer]
        self_why, cross_why = self_split_reason(stack, layer), cross_split_reason(stack, layer)
        plans[layer] = {"self": self_why, "cross": cross_why}
        if self_why is None:  # split_reason found it a constant (ones on every pre-norm encoder-decoder)
            plans[layer]["self_multiplier"] = residual_multiplier(stack, layer)
            plans[layer]["self_post"] = post_norm_form(stack, layer)  # (a reason string was split_reason's)
        if cross_why is None:
            plans[layer]["cross_post"] = cross_post_norm(stack, layer)
        for kind, why, attention in (("self", self_why, envoy.self_attn), ("cross", cross_why, envoy.cross_attn)):
            if why is None:
                module = attention._module
                plans[layer][f"{kind}_weights"] = output_map(stack, layer, module)
                plans[layer][f"{kind}_kv"] = _kv_of_head(stack.family, module)
    reads = {}
    with torch.no_grad(), model.trace(**inputs, decoder_input_ids=target_ids[None]):
        for layer in range(stack.num_layers):
            envoy, order = stack.layers[layer], stack.order(layer)
            wanted = list(RESIDUAL)
            for kind in ("self", "cross"):
                if plans[layer][kind] is None:
                    wanted += [f"{kind}_attn.{value}" for value in SPLIT]
            for key in sorted(wanted, key=lambda key: order[key]):
                host, _, value = key.rpartition(".")
                reads[layer, key] = getattr(getattr(envoy, host) if host else envoy, value)[0].save()
        final_read = model.decoder.final_norm_output[0].save()
        logits = model.logits[0].save()
    return _finish(
        model,
        stack,
        plans,
        reads,
        final_read,
        logits,
        chosen,
        directions,
        offsets,
        weight,
        bias,
        what,
        _labels(model, target_ids),
        sources,
    )


def _finish(
    model, stack, plans, reads, final_read, logits, rows, directions, offsets, weight, bias, what, tokens, sources
) -> Seq2SeqAttribution:
    from .reasons import final_norm_form

    name = f"attribution on {model.family.name}"
    final = final_norm_form(stack)
    last = stack.num_layers - 1
    residual = reads[last, "layer_output"][rows].float()
    norm_output = final_read[rows].float()
    if not torch.allclose(final.apply(residual), norm_output, atol=1e-3, rtol=1e-3):
        error = float((final.apply(residual) - norm_output).abs().max())
        raise Unavailable(
            f"{name}: the decoder's final norm {final.module} frozen as {final.name} does not give the "
            f"run's final_norm_output (off by {error:.2e})"
        )
    notes = [f"decoder's final norm {final.module} ({final.name}) frozen at its scale on this run's final residual"]
    multiple = 1.0
    if (
        weight is not None
    ):  # the logits a multiple of the unembedding (T5's d_model ** -0.5 where tied): fitted, checked
        plain = norm_output @ weight.T + bias
        seen = logits[rows].float()[..., : plain.shape[-1]]
        cap = final_softcap(model)
        if cap is not None:  # decomposed before the final soft-cap (T5Gemma's), as on a decoder-only model
            seen = cap * torch.atanh((seen / cap).clamp(-1 + 1e-6, 1 - 1e-6))
            notes.append(f"decomposes the logits before the final soft-cap tanh(x / {cap}) * {cap}")
        multiple = float((seen * plain).sum() / (plain * plain).sum())
        multiple = 1.0 if abs(multiple - 1.0) < 1e-5 else multiple
        rtol = run_tolerance(final_read.dtype)
        if not torch.allclose(multiple * plain, seen, atol=rtol * float(seen.abs().max()) + 1e-4, rtol=rtol):
            raise Unavailable(
                f"{name}: the logits are no multiple of the unembedding of the decoder's final_norm_output"
            )
        if multiple != 1.0:
            notes.append(f"the logits are {multiple:.6g} x the unembedding of the final norm's output")
    factor = multiple / final.scale(residual)[:, 0]
    pulled = final.pullback(directions)  # [rows, hidden], unscaled
    value = multiple * ((directions * norm_output).sum(-1) + offsets)
    final_bias = multiple * (final.bias_term(directions) + offsets)

    def read(layer, key):
        return reads[layer, key][rows].float()

    def along(x):
        return (pulled * x).sum(-1) * factor

    terms = {kind: {} for kind in ("heads", "bias", "attention", "cross_heads", "cross_bias", "cross", "rest")}
    for layer, plan in plans.items():
        start, between = read(layer, "layer_input"), read(layer, "cross_attention_input")
        mid, out = read(layer, "layer_mid"), read(layer, "layer_output")
        terms["attention"][layer] = along(between - start)
        terms["cross"][layer] = along(mid - between)
        terms["rest"][layer] = along(out - mid)
        for kind, heads, biases in (("self", "heads", "bias"), ("cross", "cross_heads", "cross_bias")):
            if plan[kind] is not None:
                continue
            o_weight, o_bias = plan[f"{kind}_weights"]
            probabilities = reads[layer, f"{kind}_attn.attention_probabilities"][:, rows]
            into = pulled * plan.get(f"{kind}_multiplier", 1.0)
            post_bias = torch.zeros(len(rows))
            post = plan.get(f"{kind}_post")
            if post is not None:  # a norm after the sublayer (T5Gemma's), frozen at the run's attention output
                post_bias = post.bias_term(into)
                into = post.pullback(into) / post.scale(read(layer, f"{kind}_attn.attention_output"))
            pieces = head_pieces(
                probabilities, reads[layer, f"{kind}_attn.attention_values"], plan[f"{kind}_kv"], o_weight, into
            )
            terms[heads][layer] = pieces * factor[:, None, None]
            own_bias = into @ o_bias if o_bias is not None else torch.zeros(len(rows))
            terms[biases][layer] = (own_bias + post_bias) * factor
    first = next(iter(plans))
    if not sources:
        count = next((p.shape[-2] for (_, key), p in reads.items() if key == "cross_attn.attention_values"), 0)
        sources = [f"@{i}" for i in range(count)]
    from .attribution import _name

    return Seq2SeqAttribution(
        model=_name(model),
        tokens=tokens,
        rows=rows,
        what=what,
        value=value,
        embeddings=along(read(first, "layer_input")),
        heads=terms["heads"],
        attention_bias=terms["bias"],
        attention=terms["attention"],
        rest=terms["rest"],
        final_bias=final_bias,
        unsplit={layer: plan["self"] for layer, plan in plans.items() if plan["self"] is not None},
        notes=notes,
        sources=sources,
        cross_heads=terms["cross_heads"],
        cross_bias=terms["cross_bias"],
        cross_attention=terms["cross"],
        cross_unsplit={layer: plan["cross"] for layer, plan in plans.items() if plan["cross"] is not None},
    )


def served(model, layer: int) -> dict[str, str | None]:
    """`served` on a `StandardizedSeq2Seq` (whose reports do not say which stack they are of): `attribution` answers
    for the decoder's logit by decoder block `layer` (its self- and cross-attention split by head and source); the
    other analyses are not served on encoder-decoders yet."""
    stack = decoder_stack(model)
    reasons: dict[str, str | None] = dict.fromkeys(
        ANALYSES,
        "not served on an encoder-decoder yet: attribution is (of a decoder logit, by decoder head and source)",
    )
    whole = model_reason(model, direction=True) or model_reason(model, direction=False)
    if whole is not None:
        reasons[ATTRIBUTION] = whole
    elif layer < stack.num_layers:
        split = self_split_reason(stack, layer) or cross_split_reason(stack, layer)
        reasons[ATTRIBUTION] = None if split is None else f"decoder layer {layer} is not split by head: {split}"
    else:
        reasons[ATTRIBUTION] = f"the decoder has {stack.num_layers} layers: attribution splits the decoder's logit"
    return reasons
