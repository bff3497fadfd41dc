"""Identities that would catch a wrong wiring, for any family: run them on a family you add.

    saved = attnlens.checks.read_everything(model, "some prompt")
    attnlens.checks.failures(model, saved, layer)   # [] when every identity holds

They are written from transformers' and torch's side (the model's own modules, an independent causal mask, the
family's score function), never from the location being checked, so a value read from the wrong place fails at least
one of them. A value the family reports unavailable skips the checks that need it.
"""

import nnsight
import torch

from .values import of_scope

#: Every block value, in forward order.
BLOCK = of_scope("layer", "attention", "mlp")


def read_everything(model, prompt):
    """All values of every layer in one trace, in forward order; returns {(layer, name): tensor} and logits."""
    saved = {}
    with torch.no_grad(), model.trace(prompt):
        saved["embeddings"] = model.embeddings.save()
        for i, layer in enumerate(model.layers):
            if model.family.identities.block_arguments:  # read first: the block's inputs come before its values
                args = layer.inputs[0]
                saved[(i, "block_arguments")] = nnsight.save(
                    {name: args[position] for name, position in model.family.identities.block_arguments.items()}
                )
            report = model.support(i)
            for name, _ in sorted(model.order(i).items(), key=lambda item: item[1]):
                if report[name] is not None:
                    continue
                host = layer
                if name.startswith("self_attn."):
                    host, name = layer.self_attn, name.split(".")[1]
                elif name.startswith("mlp."):
                    host, name = layer.mlp, name.split(".")[1]
                saved[(i, name)] = getattr(host, name).save()
        if model.support()["final_norm_output"] is None:
            saved["final_norm_output"] = model.final_norm_output.save()
        saved["logits"] = model.logits.save()
    return saved


def visible(config, family, layer, length, device=None):
    """Which keys each query may see: causal, within the sliding window where the layer has one, and where the
    family's own mask lets it (a chunked layer's chunks): never more than the independent causal window."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    allowed = k <= q
    score_function = family.score_function()
    window = score_function.sliding_window(config, layer)
    if window is not None:
        allowed &= q - k < window
    return allowed & (score_function.mask(length, length, config, layer)[0, 0].to(allowed.device) == 0)


#: (atol, rtol) by the coarser dtype of the two sides: the identities are exact up to rounding, which half precision
#: makes coarse (one bfloat16 step is 2^-8 of the value; sums of a few hundred terms add a few).
TOLERANCE = {
    torch.float32: (1e-5, 1e-4),
    torch.float64: (1e-5, 1e-4),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def close(a, b, atol: float | None = None):
    """Equal up to the rounding of the coarser dtype (`TOLERANCE`), or within `atol` where given."""
    if a is None or a.shape != b.shape:
        return False
    coarse = max((a.dtype, b.dtype), key=lambda dtype: torch.finfo(dtype).eps if dtype.is_floating_point else 0)
    default_atol, rtol = TOLERANCE.get(coarse, TOLERANCE[torch.float32])
    return torch.allclose(a.float(), b.float(), atol=default_atol if atol is None else atol, rtol=rtol)


def rebuilt(function, *args, **kwargs):
    """A family function's rebuild of a value, or None where the values given cannot enter it (a miswired family
    hands it tensors of another size)."""
    try:
        return function(*args, **kwargs)
    except RuntimeError:
        return None


def failures(model, saved, layer):
    """Names of the identities that fail for `layer`; a value the family reports unavailable skips its checks."""
    f = model.family
    attn = getattr(model.layers[layer], "self_attn", None)  # None on a block without attention (Nemotron-H's MLPs)
    module = attn._module if attn is not None else None
    block = model.layers[layer]._module
    v = {name: saved[(layer, name)] for name in BLOCK if (layer, name) in saved}
    arguments = saved.get((layer, "block_arguments"), {})  # Identities.block_arguments
    batch, length = saved["logits"].shape[:2]
    bad = []

    def check(name, ok):
        if not ok:
            bad.append(name)

    def has(*names):
        return all(name in v for name in names)

    if has("attention_queries", "attention_keys", "attention_values", "attention_probabilities"):
        bad += _attention_failures(model, module, layer, v, batch, length)
    if has("attention_head_outputs", "attention_premix"):
        heads = v["attention_head_outputs"]
        if "attention_gate" in v:  # gated heads: the gate multiplies each head's output before the merge
            gate = v["attention_gate"]
            check("gate shape == head outputs shape", gate.shape == heads.shape)
            heads = heads * gate if gate.shape == heads.shape else heads
        check("merged head outputs == premix", close(rebuilt(f.merge_heads, module, heads), v["attention_premix"]))
    if has("attention_premix", "attention_output"):
        check(
            "output projection(premix) == attention output",
            close(
                f.project_routed_output(module, v["attention_premix"], v.get("attention_norm_output")),
                v["attention_output"],
            ),
        )

    def post_norm(sublayer, name, x):
        return x if name is None else f.identities.post_norm(block, sublayer, name, x)

    if has("layer_input", "attention_output", "layer_mid"):
        residual = post_norm("attention", f.attention_post_norm, v["attention_output"])
        check(
            "layer input + attention output == layer mid",
            close(rebuilt(f.residual_add, block, "attention", v["layer_input"], residual, **arguments), v["layer_mid"]),
        )
    if has("layer_mid", "mlp_norm_output"):
        norm = block.get_submodule(f.mlp_norm)  # a dotted path where the block holds its norms in a list
        check(
            "mlp norm(layer mid) == mlp norm output",
            close(norm(f.residual_read(block, "mlp", v["layer_mid"])), v["mlp_norm_output"]),
        )
    if has("mlp_input", "mlp_norm_output"):
        check("mlp input == mlp norm output", close(v["mlp_input"], v["mlp_norm_output"]))
    mlp = f.mlp_module(block)
    if has("mlp_input", "mlp_output"):
        check(
            "mlp(mlp input) == mlp output",
            close(rebuilt(f.mlp_forward, mlp, v["mlp_input"], **arguments), v["mlp_output"]),
        )
    if has("mlp_neurons") or has("mlp_activation"):  # the family's arithmetic between its MLP values
        arithmetic = f.mlp_arithmetic(mlp)
        activation_input, product, path = arithmetic.says
        if has("mlp_neurons", "mlp_output"):
            check(f"{path} == mlp output", close(rebuilt(arithmetic.output, v["mlp_neurons"]), v["mlp_output"]))
        if has("mlp_activation", "mlp_neurons", "mlp_input"):
            activation, neurons, x = v["mlp_activation"], v["mlp_neurons"], v["mlp_input"]
            if arithmetic.activation_input is not None:
                check(
                    f"activation == act({activation_input})",
                    close(rebuilt(lambda: arithmetic.act(arithmetic.activation_input(x))), activation),
                )
            if arithmetic.neurons is not None:
                check(f"{product} == neurons", close(rebuilt(arithmetic.neurons, x, activation), neurons))
    if has("layer_mid", "mlp_output", "layer_output"):
        after_mlp = post_norm("mlp", f.mlp_post_norm, v["mlp_output"])
        check(
            "layer mid + mlp output == layer output",
            close(rebuilt(f.residual_add, block, "mlp", v["layer_mid"], after_mlp, **arguments), v["layer_output"]),
        )
    elif has("layer_input", "attention_output", "mlp_output", "layer_output"):  # a parallel block
        check(
            "layer input + attention output + mlp output == layer output",
            close(
                f.residual_add(
                    block,
                    "mlp",
                    f.residual_add(block, "attention", v["layer_input"], v["attention_output"], **arguments),
                    v["mlp_output"],
                    **arguments,
                ),
                v["layer_output"],
            ),
        )
    nxt = saved.get((layer + 1, "layer_input"))
    if nxt is not None and "layer_output" in v:
        check("layer output == next layer input", close(v["layer_output"], nxt))
    return bad


def _attention_failures(model, module, layer, v, batch, length):
    f = model.family
    attn = model.layers[layer].self_attn
    q, k, vals = v["attention_queries"], v["attention_keys"], v["attention_values"]
    probs = v["attention_probabilities"]
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    bad = []

    def check(name, ok):
        if not ok:
            bad.append(name)

    check("queries shape", q.shape == (batch, h, length, attn.qk_head_dim))
    check("keys shape", k.shape == (batch, kv, length, attn.qk_head_dim))
    check("values shape", vals.shape == (batch, kv, length, d))
    check("pattern shape", probs.shape == (batch, h, length, length))
    row_sums = probs.sum(-1)
    if "attention_sinks" in v:  # the sink takes the rest of each row's mass
        sinks = v["attention_sinks"]
        check("sinks shape", sinks.shape == (batch, h, length))
        check("rows + sink share sum to one", close(row_sums + sinks, torch.ones_like(row_sums)))
        check("sink shares in (0, 1)", bool(((sinks > 0) & (sinks < 1)).all()))
        renormalised = probs / row_sums[..., None]
    else:
        check("rows sum to one", close(row_sums, torch.ones_like(row_sums)))
        renormalised = probs
    allowed = visible(model.config, f, layer, length, probs.device)
    check("masked entries exactly zero", bool((probs[..., ~allowed] == 0).all()))
    check("visible entries positive", bool((probs[..., allowed] > 0).all()))
    if "attention_scores" in v:
        scores = v["attention_scores"]
        check("scores shape", scores.shape == probs.shape)
        check("softmax(scores) == probabilities (renormalised with a sink)", close(scores.softmax(-1), renormalised))
        values = {"values": vals} if f.scores_need_values else {}  # Doge's dynamic mask
        expected = rebuilt(f.scores, attn.heads, model.config, q, k, layer, **values)
        if expected is not None and f.score_bias(model.config, layer) is not None:  # a term from the hidden states
            expected = expected + f.score_bias_value(module, v, layer)
        check("scores == family score function", close(expected, scores))
    if "attention_head_outputs" in v:
        heads = v["attention_head_outputs"]
        check("head outputs shape", heads.shape == (batch, length, h, d))
        mixed = (probs @ f.repeat_kv(vals, h // kv)).transpose(1, 2)
        check("probabilities @ values == head outputs", close(mixed, heads))
    return bad
