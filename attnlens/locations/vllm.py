"""Where values live in vLLM's implementation of a family: the location kinds a family's
`vllm = VLLMLayout(locations=...)` uses.

They read and write through nnsight inside vLLM's worker, like the eager kinds in `attnlens/locations.py`, and give
values in the eager layouts, with a batch axis of one (each invoke is one request). Importing this module does not
import vLLM, so families can declare their vLLM locations anywhere.

- `ResidualPair`: vLLM carries the residual stream as a `(hidden, residual)` pair that its fused norms add.
- `KernelInput`: what the attention kernel receives, flat `[tokens, heads * dim]`; keys and values of a decode step
  span the whole context (the rows attnlens keeps, then this step's).
- `RebuiltPattern`: the scores or the pattern, rebuilt with the family's score function over the cached keys.
- `SampledLogits`: the logits vLLM samples from (the last position).
- `batched`, `copied`, `heads_of`: a module's input or output with the batch axis added, copied, or split in heads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import EditError
from ..geometry import HeadGeometry
from . import Derived, Location, ModuleArgument, child
from .views import (
    add_batch,
    copy_with_batch,
    drop_batch,
    merge_local,
    split_heads,
    tensor_parallel,
)


def worker_of(envoy):
    """The worker's attnlens state (`worker.WorkerValues`), which the engine's interleaver carries."""
    return envoy.interleaver.attnlens_worker


# --- the attention kernel's arguments, and heads across tensor-parallel ranks ------------------------------

#: The attention kernel's arguments, by position and by keyword.
KERNEL_ARGS = ("query", "key", "value")


def kernel_arg(args: tuple | list, kwargs: dict, which: int) -> torch.Tensor:
    """Query (0), key (1) or value (2) of the kernel's `(args, kwargs)`."""
    return args[which] if len(args) > which else kwargs[KERNEL_ARGS[which]]


def with_kernel_arg(args: tuple | list, kwargs: dict, which: int, new: torch.Tensor) -> tuple[tuple, dict]:
    args, kwargs = list(args), dict(kwargs)
    if len(args) > which:
        args[which] = new
    else:
        kwargs[KERNEL_ARGS[which]] = new
    return tuple(args), kwargs


def kernel_geometry(kernel: torch.nn.Module, config: Any) -> HeadGeometry:
    """The heads of vLLM's attention kernel module, across every tensor-parallel rank."""
    ranks, _ = tensor_parallel()
    if hasattr(kernel, "kv_lora_rank") and hasattr(kernel, "v_head_dim"):
        # an MLA kernel: keys and values are rebuilt for every query head (mla.py), values of v_head_dim
        heads = kernel.num_heads * ranks
        return HeadGeometry(heads, heads, kernel.v_head_dim, kernel.qk_head_dim, float(kernel.impl.scale))
    impl = kernel.impl
    num_heads = kernel.num_heads * ranks
    num_kv_heads = kernel.num_kv_heads * ranks
    if ranks > 1:  # kv heads fewer than ranks are replicated (a config with per-layer counts refuses this read)
        num_kv_heads = min(num_kv_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    head_dim = kernel.head_size
    return HeadGeometry(num_heads, num_kv_heads, head_dim, getattr(kernel, "qk_head_dim", head_dim), float(impl.scale))


@dataclass(frozen=True)
class ResidualPair(Location):
    """The sum of the `(hidden, residual)` pair a module receives (`side="input"`: the hidden state at argument
    `first`, the residual at `second`, by default the one after it) or returns (`side="output"`). Written as
    `(new, 0)`: the fused norm that adds them then gives `new`."""

    module: str = ""
    side: str = "input"
    first: int = 0
    second: int | None = None

    in_place = False
    note = (
        "vLLM carries the residual stream as a (hidden, residual) pair its fused norms add: this is their sum, "
        "a new tensor; assign it to edit (the pair becomes (new, 0))"
    )
    why_not = "it is the sum of vLLM's (hidden, residual) pair, a new tensor"

    @property
    def key(self) -> str:
        return f"{self.module}.{self.side}"

    def _pair(self, envoy):
        target = child(envoy, self.module)
        if self.side == "output":
            hidden, residual = target.output
            return hidden, residual
        args, kwargs = target.inputs
        hidden = args[self.first] if len(args) > self.first else kwargs["hidden_states"]
        residual = args[self.residual] if len(args) > self.residual else kwargs.get("residual")
        return hidden, residual

    @property
    def residual(self) -> int:
        return self.first + 1 if self.second is None else self.second

    def read(self, envoy):
        hidden, residual = self._pair(envoy)
        # with no residual yet, a copy: `hidden` may be a buffer vLLM's fused norms then add into in place (the
        # input embeddings of a multimodal model, which its runner writes into a persistent buffer)
        return (hidden.clone() if residual is None else hidden + residual)[None]

    def write(self, envoy, value):
        new = value[0]
        target = child(envoy, self.module)
        if self.side == "output":
            target.output = (new, torch.zeros_like(new))
            return
        args, kwargs = target.inputs
        args, kwargs = list(args), dict(kwargs)
        if len(args) > self.first:
            args[self.first] = new
        else:
            kwargs["hidden_states"] = new
        if len(args) > self.residual:
            args[self.residual] = None if args[self.residual] is None else torch.zeros_like(new)
        elif kwargs.get("residual") is not None:
            kwargs["residual"] = torch.zeros_like(new)
        target.inputs = (tuple(args), kwargs)


@dataclass(frozen=True)
class KernelInput(Location):
    """Query (0), key (1) or value (2) entering the attention kernel `kernel` (from the attention block), as
    `[1, heads, tokens, dim]` over every tensor-parallel rank. On a decode step keys and values span the whole
    context: the earlier rows, read from vLLM's paged KV cache (a new tensor), then this step's."""

    kernel: str
    which: int

    @property
    def note(self) -> str:
        if self.which == 0:
            return "what vLLM's attention kernel receives (after rotary embedding and any QK-norm)"
        return (
            "the kernel's; on a decode step the whole context: the earlier rows from vLLM's KV cache, then "
            "this step's (a new tensor there: assign it). Edits reach the forward for this step's rows only"
        )

    @property
    def key(self) -> str:
        return f"{self.kernel}.input"

    @property
    def name(self) -> str:
        return ("attention_queries", "attention_keys", "attention_values")[self.which]

    def read(self, envoy):
        worker = worker_of(envoy)
        heads, joined = worker.kernel_heads(envoy, self.kernel, self.which)
        if not joined:
            return heads
        return worker.access.guard(
            heads,
            self.name,
            worker.access.layer_of(envoy),
            "on a decode step it is a new tensor (the cached rows, then this step's)",
        )

    def write(self, envoy, value):
        worker = worker_of(envoy)
        layer = worker.access.layer_of(envoy)
        kernel = child(envoy, self.kernel)
        args, kwargs = kernel.inputs
        count = kernel_arg(args, kwargs, self.which).shape[0]
        if value.shape[2] > count:  # a decode step's whole context: only this step's rows reach the kernel
            earlier = worker.kernel_heads(envoy, self.kernel, self.which)[0][:, :, :-count]
            if not torch.equal(value[:, :, :-count], earlier.to(value.dtype)):
                raise EditError(
                    f"layers[{layer}].self_attn.{self.name}: only this step's rows can be edited on a decode step; "
                    f"earlier rows are in vLLM's KV cache already. Edit them on the step that computed them."
                )
            value = value[:, :, -count:]
        heads = worker.geometry[layer]
        total = heads.num_heads if self.which == 0 else heads.num_kv_heads
        kernel.inputs = with_kernel_arg(args, kwargs, self.which, merge_local(value, total))


@dataclass(frozen=True)
class SharedKernelInput(KernelInput):
    """Keys (1) or values (2) of a layer whose kernel reads another layer's (`attn(q, None, None)`; Gemma 3n, Gemma
    4): that layer's rows over the whole context, read-only (`vllm.shared_kv` finds the layer)."""

    in_place = False
    writable = False
    static_tap = False  # the kernel receives None here: no tap at the attention op holds them
    why_not = (
        "this layer's kernel computes no keys or values: it reads another layer's from vLLM's KV cache; edit "
        "them on the layer that computes them"
    )

    @property
    def note(self) -> str:
        return (
            "the keys and values of the layer this one shares them with (vLLM calls this layer's kernel as "
            "attn(q, None, None)): the rows attnlens kept for that layer, this step's included; read-only"
        )

    def write(self, envoy, value):
        raise EditError(f"{self.name}: {self.why_not}")


@dataclass(frozen=True)
class RebuiltPattern(Location):
    """`kind` "scores", "probabilities" or "sinks" of the request's queries against its cached keys, rebuilt in the
    worker with the family's score function and softmax (with the kernel's sink logits where it has them). Editing
    the scores or the pattern (in place or assigned) recomputes this layer's head outputs from the edited pattern and
    the cached values (`worker.WorkerValues.before_output_projection`); the sink share is read-only."""

    kernel: str
    kind: str

    @property
    def in_place(self) -> bool:
        return self.kind != "sinks"

    @property
    def writable(self) -> bool:
        return self.kind != "sinks"

    why_not = "it is the share of the softmax the sink column took, which nothing downstream reads"

    @property
    def note(self) -> str:
        if self.kind == "sinks":
            return "rebuilt in vLLM's worker: the softmax share of the kernel's sink logit, 1 - the pattern's row sum"
        if self.kind == "scores":
            return (
                "rebuilt in vLLM's worker with the family's score function over the cached keys; editing them "
                "recomputes this layer's head outputs from softmax(edited scores) and the cached values"
            )
        return (
            "rebuilt in vLLM's worker (softmax of the rebuilt scores); editing them recomputes this layer's head "
            "outputs as edited pattern @ cached values"
        )

    @property
    def key(self) -> str:
        return f"{self.kernel}.input"

    def read(self, envoy):
        return worker_of(envoy).pattern(envoy, self.kernel)[self.kind]

    def write(self, envoy, value):
        worker = worker_of(envoy)
        handed = worker.pattern(envoy, self.kernel)  # at the kernel's handoff, as a read would be
        layer = worker.access.layer_of(envoy)
        pattern = (
            value if self.kind == "probabilities" else worker.score_function.softmax(value, worker.sinks.get(layer))[0]
        )
        handed["assigned"] = pattern


class GatedPattern(RebuiltPattern):
    """The rebuilt pattern of a layer whose output gate vLLM applies after the kernel (Qwen3-Next, AFMoE, Laguna):
    read-only."""

    in_place = False
    writable = False
    why_not = (
        "attnlens's worker recomputes an edited pattern's head outputs at the output projection's input, which "
        "on this layer is past the output gate; edit the head outputs or the gate instead"
    )

    @property
    def note(self) -> str:
        how = "the softmax of the scores" if self.kind == "probabilities" else "with the family's score function"
        return f"rebuilt in vLLM's worker ({how}) from the kernel's queries and the kept keys; read-only"


@dataclass(frozen=True)
class SampledLogits(Location):
    """The logits vLLM samples from: the last position only, `[1, 1, vocab]` per step."""

    note = "the sampled position only: [1, 1, vocab] per step"

    @property
    def key(self) -> str:
        return "logits.output"

    def read(self, envoy):
        from nnsight.modeling.vllm import VLLM

        return VLLM.logits.__get__(envoy)[:, None]

    def write(self, envoy, value):
        from nnsight.modeling.vllm import VLLM

        VLLM.logits.__set__(envoy, value[:, -1])


def batched(source: Location) -> Derived:
    """`source`'s tensor with a batch axis of one; a view, so in-place edits land."""
    return Derived(source, add_batch, drop_batch)


def copied(source: Location) -> Derived:
    """`source`'s tensor with a batch axis, copied: vLLM's fused residual norm overwrites the buffer in place later."""
    return Derived(
        source,
        copy_with_batch,
        drop_batch,
        in_place=False,
        note="a copy (vLLM's fused residual norm overwrites the buffer later); assign it to edit",
        why_not="it is a copy (vLLM's fused residual norm overwrites the buffer in place later)",
    )


def _heads_with_batch(envoy, flat):
    return split_heads(envoy, flat)[None]


def _merged_without_batch(envoy, old, new):
    return new[0].flatten(-2)


def heads_of(source: Location) -> Derived:
    """`source`'s flat `[tokens, heads * head_dim]` (the output projection's input, whole across ranks) split in
    heads, `[1, tokens, heads, head_dim]`; a view, so in-place edits land."""
    return Derived(
        source, _heads_with_batch, _merged_without_batch, note="the output projection's input, split into heads"
    )


#: attnlens 0.1's name of `locations.ModuleArgument` (vLLM's blocks are called as `layer(positions, hidden_states)`).
HiddenArgument = ModuleArgument
