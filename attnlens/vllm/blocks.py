"""Where a layer's attention kernel and output projection sit in vLLM's modules: the two handoffs the worker keeps
and recomputes at, read off the family's vLLM locations."""

from __future__ import annotations

from typing import Any

from ..family import Family
from ..locations import Derived, ModuleInput, child
from ..locations.vllm import KernelInput


def attention_block(family: Family, layer: Any) -> Any:
    """The attention block of the block envoy `layer` in vLLM's module names: the family's, or on a hybrid's other
    layers the module the family renames to `self_attn` (Qwen3-Next's `linear_attn`); the block itself where it has
    none (Granite 4's Mamba-2 layers, where vLLM builds no `self_attn` and nothing of an attention is read)."""
    names = [family.path("attention", "vllm")]
    names += [name for name, standard in family.renames("vllm").items() if standard == "self_attn"]
    found = next((name for name in names if hasattr(layer._module, name)), None)
    return layer if found is None else child(layer, found)


def held(layers: Any) -> list[int]:
    """The blocks of the envoy `layers` this worker holds: under pipeline parallelism a stage builds its own blocks
    and a placeholder (vLLM's `PPMissingLayer`) for every other stage's; on one stage, every block."""
    from vllm.model_executor.models.utils import PPMissingLayer

    return [index for index, layer in enumerate(layers) if not isinstance(layer._module, PPMissingLayer)]


def handoffs(family: Family, config: Any, layer: int) -> tuple[str, str]:
    """(the attention kernel, the output projection) of `layer`, from the attention block, read off the family's vLLM
    locations: where keys are kept and where an edited pattern's head outputs are recomputed."""
    locations = family.locations_for(config, layer, "vllm")
    queries = locations.get("attention_queries")
    premix = locations.get("attention_premix")
    while isinstance(queries, Derived):  # the kernel's queries in another layout (Llama 4's channel order)
        queries = queries.source
    while isinstance(premix, Derived):
        premix = premix.source
    kernel = queries.kernel if isinstance(queries, KernelInput) else None
    projection = premix.module if isinstance(premix, ModuleInput) else None
    return kernel, projection
