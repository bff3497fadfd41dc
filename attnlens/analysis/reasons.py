"""Where the analyses are served, and why not: `unavailable(model, layer)`, from the family's facts and the model's
own modules (each probed on random input, never in a run).

Direct attribution splits a layer's attention update into `probabilities[h, q, s] * values_h[s] @ W_O[:, h]`, which
is exact where the update is linear in the head outputs given the run's own statistics: the heads merged by
concatenation, one output projection, then (optionally) a norm frozen at the run's scale and a constant residual
multiplier. A layer that is not linear in that way is not split: its attention update is still one term of the
decomposition (as an MLP is), and `unavailable` names why. The model-level reasons (no final norm of a known form, a
residual stream that is not one vector) make the attribution unavailable on the whole model.
"""

from __future__ import annotations

import contextlib

import torch

from .. import verification
from ..errors import Unavailable
from ..parts.identities import overrides
from .norms import NormForm

#: What can be patched: the value read and written, and the axes of the grid it gives.
OVER = {
    "heads": ("self_attn.attention_head_outputs", ("layer", "head")),
    "head_positions": ("self_attn.attention_head_outputs", ("layer", "head", "position")),
    "residual": ("layer_input", ("layer", "position")),
    "patterns": ("self_attn.attention_probabilities", ("layer", "head")),
}
ATTRIBUTION = "attribution"
LENS = "lens"
KNOCK_OUT = "knock_out"
#: The analyses `unavailable` and `support().analyses` answer for, and what each is: one per patching grid kind.
ANALYSES = {
    ATTRIBUTION: "direct attribution by head and source position (attnlens.attribution)",
    LENS: "the logit lens on the residual stream (attnlens.logit_lens)",
    **{f"patch:{over}": f"activation patching over {over} (attnlens.patch(..., over={over!r}))" for over in OVER},
    **{
        f"attribution_patching:{over}": f"attribution patching over {over} (attnlens.attribution_patching)"
        for over in OVER
    },
    KNOCK_OUT: "edge knockouts (attnlens.analysis.knock_out)",
}
#: What the residual-stream analyses read on every layer.
RESIDUAL = ("layer_input", "layer_output")
#: What splitting a layer's attention by head and source reads.
SPLIT = ("self_attn.attention_probabilities", "self_attn.attention_values", "self_attn.attention_output")


def hidden_size(model) -> int:
    """The residual stream's width (`verification.hidden_size`: the config's, else the input embeddings')."""
    if model.access.engine == "transformers":
        return verification.hidden_size(model._module, model.family)
    config = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    return config.hidden_size


def frozen_norm(model, module: torch.nn.Module) -> NormForm | None:
    """The frozen form of the norm `module`, its gain where the family's `Identities.norm_gain` finds it."""
    return NormForm.of(module, hidden_size(model), model.family.identities.norm_gain(module))


def final_norm_form(model) -> NormForm | str:
    """The final norm's frozen form, or why it has none."""
    family = model.family
    if overrides(family, "residual_read"):
        return f"the {family.name} family's final norm reads several residual streams collapsed (residual_read)"
    if model.access.engine == "vllm":
        from .vllm import final_norm_form as vllm_form

        return vllm_form(model)
    try:
        module = model._module.get_submodule(family.final_norm)
    except AttributeError:
        return f"the {family.name} family names no final norm module"
    form = frozen_norm(model, module)
    return (
        form
        if form is not None
        else (
            f"the final norm {type(module).__name__} is neither an RMSNorm nor a "
            f"LayerNorm attnlens can freeze at the run's scale"
        )
    )


def residual_multiplier(model, layer: int) -> torch.Tensor | str:
    """What the block's residual add multiplies the attention update by ([hidden], float32), or why it is not a
    constant multiplier of the update added to the block's input."""
    family = model.family
    if not overrides(family, "residual_add"):
        return torch.ones(hidden_size(model))
    if family.identities.block_arguments:
        return (
            f"the {family.name} family's residual add takes the block's arguments "
            f"({', '.join(family.identities.block_arguments)}) as well as the update"
        )
    # On vLLM the block is its module on the meta device: the add is probed with the constants it holds (Granite's
    # residual_multiplier), and one that needs its weights cannot be probed.
    block = model.layers[layer]._module
    hidden = hidden_size(model)
    generator = torch.Generator().manual_seed(0)
    stream, update = (torch.randn(1, 2, hidden, generator=generator) for _ in range(2))
    try:
        with torch.no_grad():
            kept = family.identities.residual_add(block, "attention", stream, torch.zeros_like(update))
            multiplier = family.identities.residual_add(block, "attention", stream, torch.ones_like(update)) - kept
            added = family.identities.residual_add(block, "attention", stream, update) - kept
    except Exception as error:  # noqa: BLE001  (a residual add that needs more than the two tensors)
        return f"the {family.name} family's residual add could not be probed ({type(error).__name__}: {error})"
    if not torch.allclose(kept, stream, atol=1e-6):
        return f"the {family.name} block adds its update to something other than its input (residual_add)"
    multiplier = multiplier[0, 0]
    if not torch.allclose(added, update * multiplier, atol=1e-5, rtol=1e-4) or not torch.allclose(
        multiplier, multiplier.mean().expand_as(multiplier)
    ):
        return f"the {family.name} family's residual add is not a constant multiple of the update (residual_add)"
    return multiplier.float()


def post_norm_form(model, layer: int) -> NormForm | str | None:
    """The frozen form of the norm between the attention output and the residual add (None: there is none), or why
    it has none."""
    name = model.family.attention_post_norm
    if name is None:
        return None
    if model.access.engine == "vllm":  # its class gives the form; the worker reads its weights (vllm.prepare)
        from .vllm import norm_form

        path = model.family.path("attention_post_norm", "vllm")
        return norm_form(model.layers[layer]._module.get_submodule(path), f"norm after attention ({path})")
    module = model.layers[layer]._module.get_submodule(name)
    form = frozen_norm(model, module)
    return (
        form
        if form is not None
        else (
            f"the module after attention, {name} ({type(module).__name__}), is no norm "
            f"attnlens can freeze at the run's scale"
        )
    )


def head_between(model) -> str | None:
    """Why the unembedding does not read the final norm's output directly (`verification.head_between`); None where
    nothing sits between them (eager only: vLLM's implementations are checked by their families)."""
    if model.access.engine != "transformers":
        return None
    return verification.head_between(model._module, model.family)


def _cache(model) -> dict:
    """The model's reasons worked out so far, per engine mode (`Access.mode`: a pipelined engine's attribution is
    planned with the values of one stage, `stages.stage_aware`)."""
    return model.__dict__.setdefault("_attnlens_analysis", {}).setdefault(type(model.access.mode).__name__, {})


def model_reason(model) -> str | None:
    """Why no analysis of the residual stream is served on this model (None: it is)."""
    cached = _cache(model)
    if "model" not in cached:
        cached["model"] = direction_reason(model) or head_between(model)
    return cached["model"]


def direction_reason(model) -> str | None:
    """Why no read-out of `final_norm_output` (attribution's `direction=`) is decomposed on this model (None: it is):
    `model_reason` without the modules between the final norm and the logits, which a direction of the final norm's
    output never passes through (an encoder's prediction head, a classifier's pooler and classifier)."""
    cached = _cache(model)
    if "direction" not in cached:
        reason = None
        for layer in range(model.num_layers):
            report = model.support(layer)
            missing = [name for name in RESIDUAL if report[name] is not None]
            if missing:
                reason = f"layer {layer}: {missing[0]} is unavailable ({report[missing[0]]})"
                break
        if reason is None:
            reason = post_norm_reason(model)
        if reason is None and model.support()["final_norm_output"] is not None:
            reason = f"final_norm_output is unavailable ({model.support()['final_norm_output']})"
        if reason is None:
            form = final_norm_form(model)
            reason = form if isinstance(form, str) else None
        cached["direction"] = reason
    return cached["direction"]


def post_norm_reason(model) -> str | None:
    """Why the residual stream is no sum of the pieces the blocks add (None: it is, as far as the probe sees): a
    post-norm block (BERT, BART, GPT-1) normalises the stream after its MLP's add, so the block's output is not its
    input plus updates: the family's `residual_add` of a zero MLP update, probed on random input, changes the stream.
    Probed on the transformers engine on the first block; a residual add that needs more than the two tensors is
    left to `residual_multiplier`."""
    family = model.family
    if model.access.engine != "transformers" or not overrides(family, "residual_add"):
        return None
    if family.identities.block_arguments:
        return None
    block = model.layers[0]._module
    stream = torch.randn(1, 2, hidden_size(model), generator=torch.Generator().manual_seed(0))
    parameter = next(block.parameters(), None)
    if parameter is not None:
        stream = stream.to(device=parameter.device, dtype=parameter.dtype)
    try:
        with torch.no_grad():
            kept = family.identities.residual_add(block, "mlp", stream, torch.zeros_like(stream))
    except Exception:  # noqa: BLE001  (a residual add this probe cannot call: left to the other checks)
        return None
    if torch.allclose(kept.float(), stream.float(), atol=1e-5):
        return None
    return (
        f"the {family.name} block is post-norm: a norm follows its residual add (residual_add), so the stream is "
        f"rescaled after every block and the blocks' updates do not add up to the final residual; direct "
        f"attribution splits a pre-norm stream only"
    )


def split_reason(model, layer: int) -> str | None:
    """Why `layer`'s attention update is not split by head and source (None: it is)."""
    cached = _cache(model)
    if ("split", layer) not in cached:
        cached["split", layer] = _split_reason(model, layer)
    return cached["split", layer]


def _split_reason(model, layer: int) -> str | None:
    family = model.family
    report = model.support(layer)
    for name in SPLIT:
        if report[name] is not None:
            return f"{name.split('.')[-1]} is unavailable ({report[name]})"
    premix = report["self_attn.attention_premix"]
    if model.access.engine == "transformers" and premix is not None:  # NeoMME's exclusive self-attention
        return f"the output projection does not read the heads merged: attention_premix is unavailable ({premix})"
    for method, what in (
        ("merge_heads", "transforms the head outputs before the output projection"),
        ("project_output", "computes the attention output otherwise than its output projection"),
        ("project_routed_output", "routes the output projection by the attention's input"),
    ):
        if overrides(family, method) and not (method == "project_output" and affine_output(model, layer)):
            return f"the {family.name} family {what} ({method})"
    for reason in (residual_multiplier(model, layer), post_norm_form(model, layer)):
        if isinstance(reason, str):
            return reason
    return None


def output_map(model, layer: int, attention=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention output as an affine map of the merged heads: the family's `project_output` (what the forward
    computes from the premix) run on the identity, as [hidden, heads * head_dim] and its offset (None where zero).
    `attention`: the attention module (default: block `layer`'s self-attention)."""
    module = model.layers[layer].self_attn._module if attention is None else attention
    geometry = model.family.sizes.geometry(module, model.family)
    width = geometry.num_heads * geometry.head_dim
    parameter = next(module.parameters())
    project = model.family.identities.project_output
    with torch.no_grad():
        basis = torch.eye(width + 1, width, device=parameter.device, dtype=parameter.dtype)[None]  # last row zero
        out = project(module, basis)[0].float()
    offset = out[-1]
    return (out[:-1] - offset).T.contiguous(), (offset if bool(offset.abs().max() > 0) else None)


def affine_output(model, layer: int, attention=None) -> bool:
    """Whether a family's own `project_output` is affine in the merged heads (BERT's `output.dense`, nested in the
    attention module): its map read on the identity (`output_map`) reproduces it on random input. The transformers
    engine only (vLLM's modules are not the ones the identity names)."""
    if model.access.engine != "transformers":
        return False
    module = model.layers[layer].self_attn._module if attention is None else attention
    try:
        weight, bias = output_map(model, layer, module)
        parameter = next(module.parameters())
        x = torch.randn(1, 3, weight.shape[1], generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            out = model.family.identities.project_output(module, x.to(device=parameter.device, dtype=parameter.dtype))
    except Exception:  # noqa: BLE001  (a projection that is not one map of the merged heads)
        return False
    expected = x.to(weight.device) @ weight.T + (0 if bias is None else bias)
    return bool(torch.allclose(out.float(), expected, atol=1e-4, rtol=1e-4))


def read_only(access, key: str, layer: int) -> str | None:
    """Why `key` (served on `layer`) cannot be written there, which patching it and knocking out edges do (None: it
    can); on vLLM a pattern past an output gate is read-only, for one. `access`: the model's (also in vLLM's worker)."""
    location = access.location(key.rpartition(".")[2], layer)
    return None if location.writable else f"{key} is read-only here ({location.why_not})"


def on_stages(model, max_new_tokens: int):
    """Where attribution is planned: on a pipelined vLLM engine with every value its family serves on one stage
    (`stages.stage_aware`; each stage computes its own blocks' terms), which it must run eagerly, its prefill only;
    elsewhere as the model is."""
    if getattr(model, "stages", 1) == 1:
        return contextlib.nullcontext()
    from ..vllm import stages

    if model.compiled:
        raise Unavailable(stages.ATTRIBUTION_COMPILED)
    if max_new_tokens:
        raise Unavailable(
            "attribution on pipeline stages splits a prefill: call it on the prompt and on each longer prompt in "
            "turn (max_new_tokens=0)"
        )
    return stages.stage_aware(model)


def served(model, layer: int) -> dict[str, str | None]:
    """Every analysis (`ANALYSES`) -> None where `layer` of `model` serves it, else why not: what `support(layer)`
    lists as its `analyses` on a model of one stack (`analysis.entry.served` answers on every model)."""
    layer = model.access.check_layer(layer)
    report = model.support(layer)
    reasons: dict[str, str | None] = dict.fromkeys(ANALYSES)
    reasons[LENS] = model_reason(model)
    try:
        staged = on_stages(model, 0)  # on pipeline stages attribution only, its own way
    except Unavailable as why:
        reasons[ATTRIBUTION] = str(why)
    else:
        with staged:
            reasons[ATTRIBUTION] = model_reason(model)
            split = split_reason(model, layer) if reasons[ATTRIBUTION] is None else None
            if split is not None:
                reasons[ATTRIBUTION] = f"layer {layer}'s attention is not split by head and source: {split}"
    vllm = model.access.engine == "vllm"
    for over, (key, _axes) in OVER.items():
        needs = report[key] and f"{key} is unavailable ({report[key]})"
        reasons[f"patch:{over}"] = needs or read_only(model.access, key, layer)
        reasons[f"attribution_patching:{over}"] = (
            "attribution patching takes gradients, which vLLM does not compute; use the eager engine"
            if vllm
            else needs or None
        )
    reasons[KNOCK_OUT] = knock_out_reason(model.access, layer)
    return reasons


def knock_out_reason(access, layer: int) -> str | None:
    """Why `layer` cannot have edges knocked out (None: it can): it needs the pattern, and writes it. `access`: the
    model's (also in vLLM's worker, where `knock_out` runs)."""
    probabilities = access.support(layer)["self_attn.attention_probabilities"]
    if probabilities is not None:
        return f"attention_probabilities is unavailable ({probabilities})"
    return read_only(access, "self_attn.attention_probabilities", layer)
