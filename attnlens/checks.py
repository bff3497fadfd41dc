"""Identities that would catch a wrong wiring, for any family: run them on a family you add.

    saved = attnlens.checks.read_everything(model, "some prompt")
    attnlens.checks.failures(model, saved, layer)   # [] when every identity holds

They are written from transformers' and torch's side (the model's own modules, an independent causal mask, the
family's score function), never from the location being checked, so a value read from the wrong place fails at least
one of them. A value the family reports unavailable skips the checks that need it.
"""

from collections.abc import Mapping

import nnsight
import torch

from .errors import Unavailable
from .locations import child, submodule
from .parts.multimodal import holds_images
from .values import BY_KEY, of_scope

#: Every block value, in forward order.
BLOCK = of_scope("layer", "attention", "cross_attention", "mlp")


def read_everything(model, prompt, layers=None, saved=None, **inputs):
    """All values of every layer (or of `layers`) in one trace, in forward order; returns {(layer, name): tensor},
    and the model's own values by name (into `saved` where given: what was read before a read failed). A multimodal
    model's towers (`model.towers`) run before its language model's blocks: each tower's values are under its name
    ({"vision": {(layer, name): tensor}})."""
    saved = {} if saved is None else saved
    towers = [name for name, tower in getattr(model.family, "towers", {}).items() if set(tower.inputs) & set(inputs)]
    images = getattr(model.family, "images", None)
    given = {**prompt, **inputs} if isinstance(prompt, Mapping) else inputs
    prefix = None if images is None else images.prefix(model.config, given)
    if prefix is not None:  # a prefix-LM's prefix (PaliGemma's, from its token types): it sees itself both ways
        saved["prefix"] = prefix
    with_images = holds_images(model.family, given)
    with torch.no_grad(), model.trace(prompt, **inputs):
        for name in towers:
            _read_stack(getattr(model, name), None, saved.setdefault(name, {}))
        if with_images:  # where the images sit: an image's tokens may see each other both ways (the family's mask)
            try:  # noqa: SIM105  (plain try in a trace body, which nnsight runs as written)
                saved["image_of"] = model.positions(prompt, **inputs).image
            except Unavailable:  # images not laid out (a family without `images`): their rows held to the text mask
                pass
        added = getattr(model.family, "added_between_blocks", None)
        if towers and added is not None:  # handed to the language model before its first block runs
            kwargs = child(model, added.module).inputs[1]
            saved["added_between_blocks"] = nnsight.save((kwargs.get(added.rows), kwargs.get(added.features)))
        _read_stack(model, layers, saved)
        if model.support()["logits"] is None:  # a base model without a head has none
            saved["logits"] = model.logits.save()
    for name in towers:  # a tower whose patches attend within segments of its sequence (Qwen's: images, windows)
        stack = getattr(model, name)
        if hasattr(stack.family, "segments"):
            for i in range(stack.num_layers):
                saved[name][(i, "segments")] = stack.family.segments(stack.config, inputs, i)
    return saved


def read_stacks(model, *inputs, **kwargs):
    """`read_everything` for an encoder-decoder (`StandardizedSeq2Seq`): every value of each stack, in one trace of
    `inputs` (and `decoder_input_ids=`); returns {stack: {(layer, name): tensor}}, the logits with the decoder's."""
    saved = {name: {} for name in model.stacks}
    with torch.no_grad(), model.trace(*inputs, **kwargs):
        for name in model.stacks:
            _read_stack(getattr(model, name), None, saved[name])
        saved[name]["logits"] = model.logits.save()
    return saved


def _read_stack(stack, layers, saved):
    """Inside a trace: the values of `stack`'s blocks (a model, or one stack of an encoder-decoder), in forward
    order, its embeddings before them and its final norm's output after."""
    if stack.support()["embeddings"] is None:
        saved["embeddings"] = stack.embeddings.save()
    for i in range(stack.num_layers) if layers is None else sorted(set(layers)):
        layer = stack.layers[i]
        if stack.family.identities.block_arguments:  # read first: the block's inputs come before its values
            args, kwargs = layer.inputs
            saved[(i, "block_arguments")] = nnsight.save(
                {
                    name: args[position] if isinstance(position, int) else kwargs.get(position)
                    for name, position in stack.family.identities.block_arguments.items()
                }
            )
        report = stack.support(i)
        for key, _ in sorted(stack.order(i).items(), key=lambda item: item[1]):
            if report[key] is not None:
                continue
            sublayer, _, attribute = key.rpartition(".")
            saved[(i, BY_KEY[key].name)] = getattr(getattr(layer, sublayer) if sublayer else layer, attribute).save()
    if stack.support()["final_norm_output"] is None:
        saved["final_norm_output"] = stack.final_norm_output.save()


def batch_and_length(saved: dict, layer: int | None = None) -> tuple[int, int]:
    """The batch size and sequence length of a `read_everything` run: off a block's input (a classifier's logits are
    [batch, labels]), else the embeddings, else the logits."""
    held = (saved.get((layer, "layer_input")), saved.get("embeddings"), saved.get("logits"))
    return tuple(next(tensor for tensor in held if tensor is not None).shape[:2])


def visible(config, family, layer, length, device=None, image_of=None, prefix=None):
    """Which keys each query may see: causal (every key, where the family's score function says its attention is
    bidirectional), within the sliding window where the layer has one, and where the family's own mask lets it (a
    chunked layer's chunks, an image's tokens both ways where `image_of` places images): [q, k], or [batch, q, k]
    with `image_of` ([batch, sequence]) or a prefix-LM's `prefix` ([batch, sequence]: positions seeing each other)."""
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    score_function = family.score_function()
    score_function.image_of, score_function.prefix = image_of, prefix
    own = score_function.mask(length, length, config, layer)[:, 0].to(device) == 0
    if image_of is not None or prefix is not None:  # the family's mask says which keys they see
        return own
    own = own[0]
    allowed = k <= q if score_function.causal(config) else torch.ones_like(k <= q)
    window = score_function.sliding_window(config, layer)
    if window is not None:
        allowed &= q - k < window
    return allowed & own


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


class Failed(str):
    """The name of an identity that failed (what `failures` lists, equal to the plain name), with what was expected
    and what was found (`detail`)."""

    detail: str

    def __new__(cls, name: str, detail: str = ""):
        failed = super().__new__(cls, name)
        failed.detail = detail
        return failed


def compared(expected, found, atol: float | None = None) -> str | None:
    """None where `found` is `expected` (a shape, a truth, a tensor up to rounding: `close`), else what differs."""
    if isinstance(expected, bool):
        return None if expected else "it does not hold"
    if isinstance(expected, tuple):
        return None if tuple(found) == expected else f"expected shape {expected}, found {tuple(found)}"
    if expected is None or found is None:
        return "the family's function could not compute it from the values read (their sizes disagree)"
    if found.shape != expected.shape:
        return f"expected shape {tuple(expected.shape)}, found {tuple(found.shape)}"
    if close(expected, found, atol):
        return None
    coarse = atol if atol is not None else TOLERANCE.get(found.dtype, TOLERANCE[torch.float32])[0]
    expected, found = expected.float(), found.float()
    difference = torch.where(expected == found, 0.0, (expected - found).abs()).nan_to_num(float("inf")).max()
    return f"largest difference {difference.item():.3g} (tolerance {coarse:g})"


class Checks(list):
    """The identities that failed so far, as `Failed` names."""

    def __call__(self, name: str, expected, found=True, atol: float | None = None) -> None:
        """Record `name` as failed where `found` is not `expected` (`compared`)."""
        detail = compared(expected, found, atol)
        if detail is not None:
            self.append(Failed(name, detail))


def failures(model, saved, layer):
    """The identities that fail for `layer` (`Failed` names, each with what was expected and found); a value the
    family reports unavailable skips its checks."""
    f = model.family
    oracle = f.identities
    attn = getattr(model.layers[layer], "self_attn", None)  # None on a block without attention (Nemotron-H's MLPs)
    module = attn._module if attn is not None else None
    block = model.layers[layer]._module
    v = {name: saved[(layer, name)] for name in BLOCK if (layer, name) in saved}
    arguments = saved.get((layer, "block_arguments"), {})  # Identities.block_arguments
    batch, length = batch_and_length(saved, layer)
    check = Checks()

    def has(*names):
        return all(name in v for name in names)

    if has("attention_queries", "attention_keys", "attention_values", "attention_probabilities"):
        check += _attention_failures(model, module, layer, v, batch, length, saved)
    if has("attention_head_outputs", "attention_premix"):
        heads = v["attention_head_outputs"]
        if "attention_gate" in v:  # gated heads: the gate multiplies each head's output before the merge
            gate = v["attention_gate"]
            check("gate shape == head outputs shape", tuple(heads.shape), gate.shape)
            heads = heads * gate if gate.shape == heads.shape else heads
        check("merged head outputs == premix", rebuilt(oracle.merge_heads, module, heads), v["attention_premix"])
    if has("attention_premix", "attention_output"):
        check(
            "output projection(premix) == attention output",
            rebuilt(oracle.project_routed_output, module, v["attention_premix"], v.get("attention_norm_output")),
            v["attention_output"],
        )

    def post_norm(sublayer, name, x):
        return x if name is None else oracle.post_norm(block, sublayer, name, x)

    # the stream after the self-attention: the cross-attention's input where it runs (a decoder given encoder states)
    after_attention = "cross_attention_input" if "cross_attention_input" in v else "layer_mid"
    if has("layer_input", "attention_output", after_attention):
        residual = post_norm("attention", f.attention_post_norm, v["attention_output"])
        check(
            f"layer input + attention output == {after_attention.replace('_', ' ')}",
            rebuilt(oracle.residual_add, block, "attention", v["layer_input"], residual, **arguments),
            v[after_attention],
        )
    if has("cross_attention_input", "cross_attention_norm_output"):
        norm = submodule(block, f.cross_attention_norm)
        check(
            "cross attention norm(cross attention input) == cross attention norm output",
            rebuilt(lambda: norm(v["cross_attention_input"])),
            v["cross_attention_norm_output"],
        )
    if has("cross_attention_queries", "cross_attention_keys", "cross_attention_values"):
        check += _cross_attention_failures(model, layer, v, batch, length)
    if has("cross_attention_input", "cross_attention_output", "layer_mid"):
        check(
            "cross attention input + cross attention output == layer mid",
            rebuilt(
                oracle.residual_add, block, "cross_attention", v["cross_attention_input"], v["cross_attention_output"]
            ),
            v["layer_mid"],
        )
    if has("layer_mid", "mlp_norm_output"):
        norm = submodule(block, f.mlp_norm)  # a dotted path where the block holds its norms in a list
        check(
            "mlp norm(layer mid) == mlp norm output",
            rebuilt(lambda: _tensor(norm(oracle.residual_read(block, "mlp", v["layer_mid"])))),
            v["mlp_norm_output"],
        )
    if has("mlp_input", "mlp_norm_output"):
        check("mlp input == mlp norm output", v["mlp_norm_output"], v["mlp_input"])
    mlp = oracle.mlp_module(block)
    if has("mlp_input", "mlp_output"):
        check(
            "mlp(mlp input) == mlp output",
            rebuilt(oracle.mlp_forward, mlp, v["mlp_input"], **arguments),
            v["mlp_output"],
        )
    if has("mlp_neurons") or has("mlp_activation"):  # the family's arithmetic between its MLP values
        arithmetic = oracle.mlp_arithmetic(mlp)
        activation_input, product, path = arithmetic.says
        if has("mlp_neurons", "mlp_output"):
            check(f"{path} == mlp output", rebuilt(arithmetic.output, v["mlp_neurons"]), v["mlp_output"])
        if has("mlp_activation", "mlp_neurons", "mlp_input"):
            activation, neurons, x = v["mlp_activation"], v["mlp_neurons"], v["mlp_input"]
            if arithmetic.activation_input is not None:
                check(
                    f"activation == act({activation_input})",
                    rebuilt(lambda: arithmetic.act(arithmetic.activation_input(x))),
                    activation,
                )
            if arithmetic.neurons is not None:
                check(f"{product} == neurons", rebuilt(arithmetic.neurons, x, activation), neurons)
    if has("layer_mid", "mlp_output", "layer_output"):
        after_mlp = post_norm("mlp", f.mlp_post_norm, v["mlp_output"])
        check(
            "layer mid + mlp output == layer output",
            rebuilt(oracle.residual_add, block, "mlp", v["layer_mid"], after_mlp, **arguments),
            v["layer_output"],
        )
    elif has("layer_input", "attention_output", "mlp_output", "layer_output"):  # a parallel block
        check(
            "layer input + attention output + mlp output == layer output",
            rebuilt(
                lambda: oracle.residual_add(
                    block,
                    "mlp",
                    oracle.residual_add(block, "attention", v["layer_input"], v["attention_output"], **arguments),
                    v["mlp_output"],
                    **arguments,
                )
            ),
            v["layer_output"],
        )
    nxt = saved.get((layer + 1, "layer_input"))
    rows, added = saved.get("added_between_blocks") or (None, None)
    if nxt is not None and "layer_output" in v and added is not None and layer < len(added):
        # the model adds features to the image tokens' rows after this block, outside it (Qwen3-VL's deepstack)
        stream = v["layer_output"].clone()
        stream[rows] = stream[rows] + added[layer].to(stream.dtype)
        check("layer output + features added on the image rows == next layer input", stream, nxt)
    elif nxt is not None and "layer_output" in v:
        check("layer output == next layer input", v["layer_output"], nxt)
    return list(check)


def _tensor(output):
    """A norm's output: the tensor, or item 0 of the (output, scaling factor) pair I-BERT's norms return."""
    return output[0] if isinstance(output, tuple) else output


def _attention_failures(model, module, layer, v, batch, length, saved):
    f = model.family
    attn = model.layers[layer].self_attn
    q, k, vals = v["attention_queries"], v["attention_keys"], v["attention_values"]
    probs = v["attention_probabilities"]
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    scoring, oracle = f.score_function(), f.identities
    check = Checks()
    check("queries shape", (batch, h, length, attn.qk_head_dim), q.shape)
    check("keys shape", (batch, kv, length, attn.qk_head_dim), k.shape)
    check("values shape", (batch, kv, length, d), vals.shape)
    check("pattern shape", (batch, h, length, length), probs.shape)
    row_sums = probs.sum(-1)
    if "attention_sinks" in v:  # the sink takes the rest of each row's mass
        sinks = v["attention_sinks"]
        check("sinks shape", (batch, h, length), sinks.shape)
        check("rows + sink share sum to one", torch.ones_like(row_sums), rebuilt(lambda: row_sums + sinks))
        check("sink shares in (0, 1)", bool(((sinks > 0) & (sinks < 1)).all()))
        renormalised = probs / row_sums[..., None]
    else:
        check("rows sum to one", torch.ones_like(row_sums), row_sums)
        renormalised = probs
    image_of = saved.get((layer, "segments"), saved.get("image_of"))  # a tower's segments, or where images sit
    prefix = saved.get("prefix")  # a prefix-LM's (a tower's saved values hold none)
    allowed = visible(model.config, f, layer, length, probs.device, image_of, prefix)
    allowed = (allowed if image_of is not None or prefix is not None else allowed[None])[:, None].expand_as(probs)
    if probs.shape == allowed.shape:
        check("masked entries exactly zero", bool((probs[~allowed] == 0).all()))
        check("visible entries positive", bool((probs[allowed] > 0).all()))
    if "attention_position_bias" in v:  # computed by the block, or handed on from the stack's first
        own = rebuilt(oracle.layer_position_bias, getattr(model, "_module", None), module, v, length, length)
        first = saved.get((0, "attention_position_bias"))
        check("position bias == the family's", own if own is not None else first, v["attention_position_bias"])
    if "attention_scores" in v:
        scores = v["attention_scores"]
        check("scores shape", tuple(probs.shape), scores.shape)
        check("softmax(scores) == probabilities (renormalised with a sink)", scores.softmax(-1), renormalised)
        values = {"values": vals} if scoring.scores_need_values else {}  # Doge's dynamic mask
        scoring.image_of, scoring.prefix = image_of, prefix
        expected = rebuilt(scoring.scores, attn.heads, model.config, q, k, layer, **values)
        if expected is not None and scoring.score_bias(model.config, layer) is not None:  # from the hidden states
            expected = expected + oracle.score_bias_value(module, v, layer)
        check("scores == family score function", expected, scores)
    if "attention_head_outputs" in v:
        heads = v["attention_head_outputs"]
        check("head outputs shape", (batch, length, h, d), heads.shape)
        mixed = rebuilt(lambda: (probs @ scoring.repeat_kv(vals, h // kv)).transpose(1, 2))
        check("probabilities @ values == head outputs", mixed, heads)
    return check


def _cross_attention_failures(model, layer, v, batch, length):
    """The identities of a decoder block's cross-attention: its queries from the decoder's positions, its keys and
    values from the encoder's (`source` of them, read off the keys), no mask on an unpadded source."""
    attn = model.layers[layer].cross_attn
    module, oracle, scoring = attn._module, model.family.identities, model.family.score_function()
    q, k, vals = v["cross_attention_queries"], v["cross_attention_keys"], v["cross_attention_values"]
    h, kv, d, source = attn.num_heads, attn.num_kv_heads, attn.head_dim, k.shape[2]
    check = Checks()
    check("cross queries shape", (batch, h, length, attn.qk_head_dim), q.shape)
    check("cross keys shape", (batch, kv, source, attn.qk_head_dim), k.shape)
    check("cross values shape", (batch, kv, source, d), vals.shape)
    if "cross_attention_scores" in v:
        scores = v["cross_attention_scores"]
        expected = rebuilt(scoring.cross_scores, attn.heads, model.config, q, k, layer)
        check("cross scores == family cross score function", expected, scores)
    if "cross_attention_probabilities" in v:
        probs = v["cross_attention_probabilities"]
        check("cross pattern shape", (batch, h, length, source), probs.shape)
        check("cross rows sum to one", torch.ones_like(probs.sum(-1)), probs.sum(-1))
        check("every source position seen", bool((probs > 0).all()))
        if "cross_attention_scores" in v:
            check("softmax(cross scores) == cross probabilities", v["cross_attention_scores"].softmax(-1), probs)
        if "cross_attention_head_outputs" in v:
            mixed = rebuilt(lambda: (probs @ scoring.repeat_kv(vals, h // kv)).transpose(1, 2))
            check("cross probabilities @ values == head outputs", mixed, v["cross_attention_head_outputs"])
    if "cross_attention_head_outputs" in v and "cross_attention_premix" in v:
        merged = rebuilt(oracle.merge_heads, module, v["cross_attention_head_outputs"])
        check("merged cross head outputs == cross premix", merged, v["cross_attention_premix"])
    if "cross_attention_premix" in v and "cross_attention_output" in v:
        projected = rebuilt(oracle.project_output, module, v["cross_attention_premix"])
        check("output projection(cross premix) == cross attention output", projected, v["cross_attention_output"])
    return check
