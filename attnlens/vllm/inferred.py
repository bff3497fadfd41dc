"""The verified common layout on vLLM: a model type attnlens has no family for, served where vLLM runs the modules the
inference verified, or modules attnlens's own vLLM layouts were checked against.

On the transformers engine, `attnlens.inferred.Inferred` reads the model's structure and source and checks that its
blocks are the common layout (`inferred.CHECKS`). On vLLM the same inference runs on transformers' model built from
the checkpoint's config on the meta device (no weights), and then what vLLM runs must be what was verified:

- vLLM's Transformers backend (the architecture is listed for it, it is not in vLLM's registry at all, or
  `model_impl="transformers"`): it runs those very transformers modules with its own attention kernel as the
  attention function, so the inferred family serves there as the backend families do (`parts.mirrored`);
- vLLM's own Llama (and its subclasses, Mistral's): the modules `families.llama.Llama`'s vLLM layout is tested
  against, so the inferred family serves with that layout.

Anything else is refused, naming the check that failed (`VLLM_CHECKS`), before an engine starts where that can be known
from the config, after vLLM builds its model otherwise. Mixture-of-experts layers are refused: vLLM replaces the
experts with its fused MoE, whose routing attnlens has not checked for a model it infers.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import torch

from ..errors import InferredFamilyWarning, UnknownFamily
from ..families.llama import Llama
from ..inferred import Inferred, NotCommonLayout
from ..parts.mirrored import transformers_backend

#: What is checked on vLLM after the transformers-side checks (`attnlens.inferred.CHECKS`), in order.
VLLM_CHECKS = {
    "vllm_implementation": "vLLM runs the model through its Transformers backend (the modules verified) or through "
    "its own Llama (the modules attnlens's Llama layout is tested against)",
    "vllm_moe": "no layer is a mixture of experts (vLLM replaces the experts with its fused MoE)",
    "vllm_modules": "the model vLLM built is the implementation chosen: the backend's TransformersForCausalLM over the "
    "verified block classes, or vLLM's Llama decoder layers",
}
#: `additional_config["attnlens_family"]` for an inferred family: the worker infers it again from the same config.
MARKER = "inferred"
#: vLLM's own model files whose classes are vLLM's Llama or subclass it.
LLAMA_MODULES = ("llama", "mistral")


def _refuse(model_type: str, check: str, detail: str) -> UnknownFamily:
    return UnknownFamily(
        f"attnlens has no family for model type {model_type!r}, and StandardizedVLLM cannot serve the common layout "
        f"it infers: check {check} failed ({VLLM_CHECKS[check]}): {detail}. Register a family for it "
        f"(docs/extending.md), or read it on StandardizedTransformer, which serves the inferred layout"
    )


def implementation(config: Any, model_impl: str = "auto") -> str:
    """Which of vLLM's implementations runs a model of `config`: "transformers" (its Transformers backend) or the
    name of vLLM's own model file, as vLLM resolves the first listed architecture."""
    from vllm.model_executor.models.registry import _VLLM_MODELS

    if model_impl == "transformers":
        return "transformers"
    architecture = (getattr(config, "architectures", None) or [None])[0]
    module = _VLLM_MODELS.get(architecture, ("transformers",))[0]  # unlisted: vLLM tries its Transformers backend
    return module


def infer(config: Any, model_impl: str = "auto") -> Inferred:
    """The inferred family of a model of `config` on vLLM, its `vllm` layout chosen by `implementation`; raises
    `UnknownFamily` naming the first failed check."""
    import transformers

    model_type = config.model_type
    architecture = (getattr(config, "architectures", None) or [None])[0]
    model_class = getattr(transformers, architecture, None) if architecture else None
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' warnings about the config reach the user on the eager load
        model = model_class(config) if model_class else transformers.AutoModelForCausalLM.from_config(config)
    try:
        family = Inferred(model)
    except NotCommonLayout as refusal:
        raise UnknownFamily(
            f"attnlens has no family for model type {model_type!r}, and its blocks are not the common layout "
            f"(check {refusal}; see docs/inferred.md): register a family for it (docs/extending.md)"
        ) from refusal
    if family.experts:
        raise _refuse(model_type, "vllm_moe", f"its MLPs hold experts ({family.experts})")
    impl = implementation(config, model_impl)
    if impl == "transformers":
        family.vllm = transformers_backend((model_type,), fused_activation=_glu(model, family))
    elif impl in LLAMA_MODULES:
        family.vllm = replace(Llama.vllm, model_types=(model_type,))
    else:
        raise _refuse(model_type, "vllm_implementation", f"vLLM runs it with its own model file {impl}.py")
    family.vllm_implementation = impl
    family.block_classes = {type(block) for block in model.get_submodule(family.layers)}
    return family


def _glu(model: torch.nn.Module, family: Inferred) -> bool:
    """Whether the MLP is a GLU whose gate and up projections vLLM's backend fuses with the activation (so the
    activation alone is never formed): separate `gate_proj` and `up_proj` linear layers beside the activation."""
    mlp = model.get_submodule(f"{family.layers}.0.{family.mlp}")
    return all(isinstance(getattr(mlp, name, None), torch.nn.Linear) for name in ("gate_proj", "up_proj"))


def verify(family: Inferred, vllm_model: torch.nn.Module) -> None:
    """Check that vLLM built the implementation `infer` chose (`vllm_modules`), and warn as the eager engine does."""
    from vllm.model_executor.models.llama import LlamaDecoderLayer

    blocks = vllm_model.get_submodule(family.path("layers", "vllm"))
    if family.vllm_implementation == "transformers":
        built = {type(block) for block in blocks}
        if type(vllm_model).__name__ != "TransformersForCausalLM" or not built <= family.block_classes:
            raise _refuse(
                family.model_type,
                "vllm_modules",
                f"vLLM built {type(vllm_model).__name__} with blocks {sorted(c.__name__ for c in built)}",
            )
        expected = family.vllm.unavailable.get("mlp_activation") is not None  # a split GLU, to be fused
        mlp = vllm_model.get_submodule(f"{family.path('layers', 'vllm')}.0.{family.mlp}")
        if expected and not hasattr(mlp, "gate_up_proj"):
            raise _refuse(family.model_type, "vllm_modules", "vLLM left the GLU's gate and up projections apart")
    elif not all(isinstance(block, LlamaDecoderLayer) for block in blocks):
        raise _refuse(
            family.model_type,
            "vllm_modules",
            f"vLLM built {sorted({type(b).__name__ for b in blocks})}, not vLLM's Llama decoder layers",
        )
    warnings.warn(
        f"{family.advice()}\nOn vLLM it runs through "
        + ("vLLM's Transformers backend" if family.vllm_implementation == "transformers" else "vLLM's own Llama")
        + " (attnlens.vllm.inferred)",
        InferredFamilyWarning,
        stacklevel=3,
    )
