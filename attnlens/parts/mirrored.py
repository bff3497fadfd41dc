"""vLLM locations mirrored from a family's eager ones, where vLLM keeps transformers' module names: vLLM's
Transformers backend, and vLLM's own ports of the older LayerNorm families (GPT-2, GPT-J, OPT, Bloom, Falcon).

vLLM's Transformers backend (`TransformersForCausalLM`) runs the family's own transformers modules, built as `model`
(the base model, whatever the eager class calls it: `gpt_neox`, `transformer`), with vLLM's attention kernel as the
attention function: each attention module gets the kernel as `attn`, and transformers' attention interface hands it
q, k and v flat (`vllm_attention_forward`). It fuses separate q/k/v projections into `qkv_proj`, a GLU's gate and up
projections into `gate_up_proj` with the activation (`SiluAndMul`), and swaps in vLLM's linear layers and norms, all
under the names the family reads; the forward keeps a batch axis of one. So every module input and output the family
reads on eager is read at the same place there, with no change of layout.

vLLM's own ports hold tokens flat (`[tokens, hidden]`: a batch axis is added), return `(output, bias)` from their
linear layers and some blocks, and run LayerNorm blocks with a plain residual stream (no `(hidden, residual)` pair):
`locations.vllm.HiddenArgument` reads a block's hidden states where positions come first.

On both, the attention's values are read at the kernel, as on vLLM's Llama-like models: queries, keys and values as
the kernel receives them (keys over the whole context on decode steps), the pattern rebuilt with the family's score
function, each head's output from the heads merged (the output projection's input; on BitNet what its sub-norm
receives).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..locations import Derived, Location, ModuleInput, ModuleOutput, OutputField
from ..values import BY_NAME
from .vllm import VLLMLayout


def _split_heads(envoy, flat):
    access = envoy.interleaver.attnlens.of(envoy)
    return flat.unflatten(-1, (-1, access.geometry(access.layer_of(envoy)).head_dim))


def _merge_heads(envoy, old, new):
    return new.flatten(-2)


def _add_batch(envoy, value):
    return value[None]


def _drop_batch(envoy, old, new):
    return new[0]


def mirrored(family: Any, eager: dict[str, Location], own_port: bool) -> dict[str, Location]:
    """`eager`'s locations on vLLM, in the same order: the attention's values at the kernel (`family.vllm.kernel`),
    the logits vLLM samples from, and every module input and output where it is, as the first item of a tuple.

    On vLLM's `own_port` of the family, tokens are flat (a batch axis is added) and one activation module serves every
    layer (`get_act_fn` caches it), so `mlp_activation` is read as what the down projection receives (the same tensor,
    with no gate). Any other kind is the family's to state: it raises."""
    from ..locations.vllm import KernelInput, RebuiltPattern, SampledLogits, batched, heads_of

    kernel, merged, said = family.vllm.kernel, ModuleInput(family.output_projection), "the output projection's input"
    premix = eager.get("attention_premix")
    if isinstance(premix, ModuleInput) and premix != merged:  # BitNet's heads merged go to a norm before o_proj
        merged, said = premix, f"what {premix.module} receives"
    replaced = {
        "attention_queries": KernelInput(kernel, 0),
        "attention_keys": KernelInput(kernel, 1),
        "attention_values": KernelInput(kernel, 2),
        "attention_scores": RebuiltPattern(kernel, "scores"),
        "attention_probabilities": RebuiltPattern(kernel, "probabilities"),
        "attention_head_outputs": heads_of(merged)
        if own_port
        else Derived(merged, _split_heads, _merge_heads, note=f"{said}, split into heads"),
    }
    if own_port and "mlp_activation" in eager:
        replaced["mlp_activation"] = Derived(
            eager["mlp_neurons"],
            _add_batch,
            _drop_batch,
            note="read as what the down projection receives (the same tensor: no gate): vLLM shares one activation "
            "module between every layer",
        )
    out = {}
    for name, location in eager.items():
        if name in replaced:
            out[name] = replaced[name]
        elif isinstance(location, OutputField) and name == "logits":
            out[name] = SampledLogits()
        elif isinstance(location, (ModuleInput, ModuleOutput)):
            if isinstance(location, ModuleOutput) and location.item is None:
                location = ModuleOutput(location.module, 0)  # a tensor is read whole; a tuple's first item
            out[name] = batched(location) if own_port else location
        elif (
            not own_port and isinstance(location, Derived) and isinstance(location.source, (ModuleInput, ModuleOutput))
        ):
            # the backend runs transformers' own modules: a view of one of their tensors is the same view there
            source = location.source
            if isinstance(source, ModuleOutput) and source.item is None:
                source = ModuleOutput(source.module, 0)
            out[name] = replace(location, source=source)
        else:
            raise ValueError(
                f"family {family.name}, value {name}: no vLLM location mirrors {location!r}; state it "
                f"in the family's vllm = VLLMLayout(locations=...)"
            )
    return out


def transformers_backend(model_types: tuple[str, ...], fused_activation: bool = False, **fields: Any) -> VLLMLayout:
    """The layout of a family vLLM runs through its Transformers backend: its vLLM locations are its eager ones
    (`mirrored`), under vLLM's `model` where the eager model names its base model otherwise. `fused_activation`:
    vLLM fuses the MLP's activation into a GLU's `gate_up_proj` (`SiluAndMul`), so it is never formed."""

    def locations(family) -> dict[str, Location]:
        eager = {}
        for name, location in family.locations().items():
            if name == "mlp_activation" and fused_activation:
                continue
            if BY_NAME[name].scope == "model" and isinstance(location, (ModuleInput, ModuleOutput)):
                location = replace(location, module=_in_vllm_model(family, location.module))
            elif BY_NAME[name].scope == "model" and isinstance(location, Derived):
                source = location.source
                if isinstance(source, (ModuleInput, ModuleOutput)):
                    location = replace(location, source=replace(source, module=_in_vllm_model(family, source.module)))
            eager[name] = location
        return mirrored(family, eager, own_port=False)

    if not fused_activation:
        fields.setdefault("unavailable", {})
    return VLLMLayout(
        model_types=model_types, names=_backend_names, locations=locations, backend="transformers", **fields
    )


def _backend_names(family) -> dict[str, str]:
    """The model's module paths in vLLM's model (`Family.path`), where its base model is named otherwise."""
    paths = {role: getattr(family, role) for role in ("layers", "embed_tokens", "final_norm")}
    moved = {role: _in_vllm_model(family, path) for role, path in paths.items()}
    return {role: path for role, path in moved.items() if path != paths[role]}


def _in_vllm_model(family, path: str) -> str:
    """A module path of the eager model in vLLM's: the base model is `model` there."""
    base = family.layers.split(".")[0]
    return "model" + path[len(base) :] if path.split(".")[0] == base else path
