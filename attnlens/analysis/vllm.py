"""The analyses on `StandardizedVLLM`: the trace body runs in vLLM's worker, which reads its own weights there
(`prepare`), so only the terms leave it.

The client holds vLLM's modules on the meta device: it knows their classes (which form the final norm has), not
their weights. vLLM's output projection is a `RowParallelLinear` (`[hidden, heads * head_dim]`, `weight` as a
`Linear`'s), its norms `RMSNorm` (`weight * x / rms`) or `GemmaRMSNorm` (`(1 + weight) * ...`), its unembedding a
`ParallelLMHead` whose vocabulary is padded (the padding rows are dropped). Under tensor parallelism each rank holds
its heads' columns of the output projection and its share of the vocabulary: every rank gathers the whole matrices
(once per weights, as on one rank), while the values the sums read are already every rank's heads (views.py).
"""

from __future__ import annotations

import pickle
import uuid
import weakref
from dataclasses import dataclass, replace

import torch

from ..errors import Unavailable
from ..locations.views import tensor_parallel
from .norms import NormForm, _eps, gain_of

#: vLLM's norm classes (and transformers' that its Transformers backend keeps) and the form each computes; a class
#: is known by the first of these names in its MRO (the backend's `TPAwareRMSNorm` is an `RMSNorm`).
NORM_CLASSES = {
    "GemmaRMSNorm": ("RMSNorm with 1 + weight (Gemma)", False, "one_plus"),
    "RMSNorm": ("RMSNorm", False, "weight"),
    "LayerNorm": ("LayerNorm", True, "weight"),
    "OlmoLayerNorm": ("LayerNorm without weight", True, "none"),  # transformers' OLMo: F.layer_norm, no weight
}


def norm_form(module, what: str) -> NormForm | str:
    """The form of vLLM's norm `module` from its class (its weights are read in the worker: `with_weights`), or why
    it has none (`what` names the module in the reason)."""
    for klass in type(module).__mro__:
        if klass.__name__ in NORM_CLASSES:
            form, centred, enters = NORM_CLASSES[klass.__name__]
            return NormForm(form, type(module).__name__, centred, torch.empty(0), None, _eps(module), enters)
    return (
        f"vLLM's {what} {type(module).__name__} is neither an RMSNorm nor a LayerNorm attnlens can freeze at the "
        f"run's scale"
    )


def final_norm_form(model) -> NormForm | str:
    """The final norm's form from its class, or why it has none."""
    return norm_form(model._module.get_submodule(model.family.path("final_norm", "vllm")), "final norm")


def with_weights(form: NormForm, module, hidden: int) -> NormForm:
    """`form` with the gain and bias of `module`, vLLM's norm in the worker (`hidden`: the width without a weight)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    if weight is not None and weight.numel() == 0:  # the Transformers backend's RMSNorm for a weightless norm
        weight = None
    gain = gain_of(weight, form.enters, hidden, None if weight is None else weight.device)
    return replace(form, gain=gain, bias=None if bias is None else bias.detach().float())


#: Per output projection module of this worker: its weights' identity and the matrix read from them. Reading the
#: matrix runs vLLM's matmul on the identity, so it is done once per weights, not per call; the identity changes when
#: vLLM packs the weights anew (a new `cpu_linear` kernel) or the weight tensor is edited in place (its version).
_MATRICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _weights_identity(projection) -> tuple:
    weight = projection.weight
    return getattr(projection, "cpu_linear", None), weight.data_ptr(), weight._version, tuple(weight.shape)


def _gathered(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Every tensor-parallel rank's share of `x` joined along `dim`, in rank order (each rank calls it: the worker
    runs the same body on every rank)."""
    if tensor_parallel()[0] == 1:
        return x
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x.contiguous(), dim=dim)


def _cached(module, read) -> torch.Tensor:
    """`read()` of `module`'s weights, kept until they change."""
    identity = _weights_identity(module)
    cached = _MATRICES.get(module)
    if cached is None or cached[0] != identity:  # the kernel is compared by identity (functions' equality), held
        cached = _MATRICES[module] = (identity, read())
    return cached[1]


def projection_weights(projection, width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's output projection as [hidden, width] and its bias, read by running its own matmul (`quant_method`) on the
    identity: vLLM's CPU backend packs the weight for its kernels and leaves `weight` empty. Under tensor parallelism
    each rank reads its heads' columns and the ranks' are joined. Cached per weights."""

    def read() -> torch.Tensor:
        weight = projection.weight
        local = getattr(projection, "input_size_per_partition", width)  # this rank's heads * head_dim
        basis = torch.eye(local, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            matrix = projection.quant_method.apply(projection, basis, None).float().T.contiguous()
        return _gathered(matrix, 1)

    bias = getattr(projection, "bias", None)  # whole on every rank (the all-reduce adds it once)
    return _cached(projection, read), None if bias is None else bias.detach().float()


def unembedding(module, embeddings: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """vLLM's unembedding (`module`: its model, in the worker), its padded vocabulary whole on every rank: its
    `lm_head` (a multimodal class's is its language model's, vLLM's `get_language_model()`: Qwen3.5's
    `language_model.lm_head`; else the model's own, where its language model is a bare text model: Idefics3's
    `model.text_model`), or where the model ties its embeddings and vLLM keeps no head (Cohere's, Gemma 4's
    logits are computed from `embed_tokens`) the input embeddings at `embeddings`."""
    language = module.get_language_model() if hasattr(module, "get_language_model") else module
    head = getattr(language, "lm_head", None)
    if head is None:
        head = getattr(module, "lm_head", None)
    config = getattr(module, "config", None)
    if head is None and config is not None and getattr(config.get_text_config(), "tie_word_embeddings", False):
        head = module.get_submodule(embeddings)
    if head is None or getattr(head, "weight", None) is None:
        raise Unavailable("attribution on vLLM: the model has no lm_head to read tokens with")
    bias = getattr(head, "bias", None)
    if tensor_parallel()[0] == 1:
        return head.weight, bias
    return _cached(head, lambda: _gathered(head.weight.detach(), 0)), None if bias is None else _gathered(bias, 0)


def prepare(model, plan, prepare_weights, stage=None) -> None:
    """In the worker: the unembedding and the output projections (`prepare_weights`: `attribution.prepare`, passed in
    so this module need not import it back), then the weights of the final norm and of the norms after attention; on
    a pipeline stage (`stage`: `Held`) those it holds (the final norm's: `attribution.stage_read_out`)."""
    prepare_weights(model, plan, stage)
    hidden = plan.directions.shape[-1]
    if stage is None or stage.last:
        plan.final = with_weights(plan.final, model._module.get_submodule(plan.paths["final_norm"]), hidden)
    for layer, layer_plan in plan.layers.items():
        if layer_plan.split and layer_plan.post is not None and (stage is None or layer in stage.layers):
            norm = model.layers[layer]._module.get_submodule(plan.paths["attention_post_norm"])
            layer_plan.post = with_weights(layer_plan.post, norm, hidden)


def run_attribution(model, ids: torch.Tensor, plan, prepare_weights, collect, stage_read_out) -> dict:
    """One request of `ids`, its prefill only; the terms computed in the worker (`collect`: `attribution.collect`;
    `stage_read_out`: `attribution.stage_read_out`, on pipeline stages)."""
    if model.stages > 1:
        return _on_stages(model, ids, plan, prepare_weights, collect, stage_read_out)
    with torch.no_grad(), model.trace(ids.tolist(), max_tokens=1, temperature=0.0):
        found = [{}].save()
        prepare(model, plan, prepare_weights)
        collect(model, plan, found[0])
    return found[0]


# --- on pipeline stages --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What one pipeline stage holds (`StandardizedVLLM` with pipeline_parallel_size > 1, where each stage computes
    the terms of its own blocks): its blocks, and whether it holds the final norm and the unembedding (the last)."""

    layers: frozenset[int]
    last: bool


def _on_stages(model, ids: torch.Tensor, plan, prepare_weights, collect, stage_read_out) -> dict:
    """`run_attribution` on an engine of pipeline stages: each stage computes the terms of the blocks it holds in one
    trace (`stages.stage_aware`), keeps them in its worker (`_keep`), and the client takes and joins them (`take`). The
    read-out every stage projects onto (the unembedding's rows through the final norm's gain, on the last stage) is
    read first (`stage_read_out`), so only it and the terms travel."""
    from ..vllm import stages

    read = in_workers(model, stage_read_out, pickle.dumps(plan))
    directions, offsets, final = pickle.loads(next(found for found in read if found))
    plan = replace(plan, directions=directions, offsets=offsets, final=final)
    tag = uuid.uuid4().hex
    with stages.stage_aware(model), torch.no_grad(), model.trace(ids.tolist(), max_tokens=1, temperature=0.0):
        stage = _held(model, plan)
        prepare(model, plan, prepare_weights, stage)
        terms = {}
        collect(model, plan, terms, stage)
        _keep(tag, terms)
    found: dict = {}
    for index, ranks in enumerate(stages.by_stage(in_workers(model, take, tag), model.stages)):
        if ranks[0] is None:
            raise RuntimeError(f"attribution: pipeline stage {index} kept no terms (its trace failed on the worker)")
        for key, value in pickle.loads(ranks[0]).items():  # each rank of a stage holds the same (gathered) terms
            if isinstance(value, dict):
                found.setdefault(key, {}).update(value)
            else:
                found[key] = value
    return found


def in_workers(model, function, *args) -> list:
    """`function(worker, *args)` run in every worker, its answers in vLLM's rank order: by name (`attnlens_call`), as
    vLLM's engine process takes no function as an argument."""
    return model.vllm_entrypoint.collective_rpc(
        "attnlens_call", args=(f"{function.__module__}:{function.__name__}", *args)
    )


def final_norm_held(module, plan) -> torch.nn.Module | None:
    """In the worker: vLLM's final norm of `module` (its model), or None on a pipeline stage that does not hold it."""
    from vllm.model_executor.models.utils import PPMissingLayer

    norm = module.get_submodule(plan.paths["final_norm"])
    return None if isinstance(norm, PPMissingLayer) else norm


def _held(model, plan) -> Held:
    """In the worker: what this pipeline stage holds."""
    from ..vllm.blocks import held

    return Held(frozenset(held(model.layers)), final_norm_held(model._module, plan) is not None)


#: Per tag, the terms a stage computed, until the client takes them (`take`).
_KEPT: dict[str, bytes] = {}


def _keep(tag: str, terms: dict) -> None:
    _KEPT[tag] = pickle.dumps(terms)


def take(worker, tag: str) -> bytes | None:
    """In each worker (`in_workers`): the terms kept under `tag`, dropped here."""
    return _KEPT.pop(tag, None)
