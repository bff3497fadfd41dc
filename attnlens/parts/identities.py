"""The identity oracle: how a family's blocks compute each value from the ones before it, with the model's own
modules, on the side the identities recompute (`attnlens.checks`). `Identities` is the common layout's arithmetic; a
family whose blocks compute a step otherwise (Granite's residual multiplier, Bloom's MLP that adds the residual
itself) overrides it in a nested class of its own, `class Identities(identities.Identities)`, which `Family` composes
with its bases' as it does the score function. `family.identities` is the oracle of one family.

Nothing here is read while serving values: it is what the tests, `attnlens.checks` and the analyses that recompute a
block (attribution, patching) take the model's arithmetic from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass(frozen=True)
class MLPArithmetic:
    """How an MLP forms its values from its input, step by step, with its own modules (`Identities.mlp_arithmetic`):

        mlp_activation = act(activation_input(mlp_input))
        mlp_neurons    = neurons(mlp_input, mlp_activation)   # what the down projection receives
        mlp_output     = output(mlp_neurons)                  # the down projection and what follows it (a multiplier)

    Each step is exactly the forward's arithmetic (a norm or a multiplier between two values belongs to the step that
    crosses it); a step left None is not recomputed, and the identities skip it. `says` spells the three steps for the
    identities' names."""

    output: Callable[[torch.Tensor], torch.Tensor]
    activation_input: Callable[[torch.Tensor], torch.Tensor] | None = None
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    neurons: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    says: tuple[str, str, str] = ("gate(mlp input)", "activation * up(mlp input)", "down projection(neurons)")


class IntermediateMLP:
    """A BERT-style block's MLP as the checks call it (`Identities.mlp_module`): `output.dense(intermediate(x))`, the
    block's two modules, before the norm that follows them (GIT, BERT)."""

    def __init__(self, block):
        self.block, self.dense = block, block.output.dense

    def __call__(self, hidden_states):
        return self.dense(self.block.intermediate(hidden_states))


def overrides(family, step: str) -> bool:
    """Whether `family`'s identity oracle computes `step` otherwise than the common layout's."""
    return getattr(family.Identities, step) is not getattr(Identities, step)


class Identities:
    """The block's arithmetic between the standardized values of `family`."""

    def __init__(self, family):  # (a Family: the layer above this one)
        self.family = family

    def project_output(self, module, premix: torch.Tensor) -> torch.Tensor:
        """The attention output from the premix, as the forward computes it (the tests' identity, rebuilds)."""
        return getattr(module, self.family.output_projection)(premix)

    def project_routed_output(self, module, premix: torch.Tensor, attention_input: torch.Tensor | None) -> torch.Tensor:
        """The attention output from the premix where the output path also depends on what the attention received
        (`attention_input`, the `attention_norm_output` read in the same forward; None where unread): JetMoE routes
        each token to its output experts by the attention's input. By default `project_output`, which ignores it."""
        return self.project_output(module, premix)

    def norm_gain(self, norm) -> torch.Tensor | None:
        """The gain a norm module multiplies by, or None where it has none: its `weight`, else its one parameter of
        one dimension (a norm that names its gain otherwise, `g`). The analyses that freeze a norm read it here."""
        weight = getattr(norm, "weight", None)
        if weight is not None:
            return weight
        own = [p for p in norm.parameters(recurse=False) if p.dim() == 1]
        return own[0] if len(own) == 1 else None

    def mlp_forward(self, mlp, mlp_input: torch.Tensor, **arguments) -> torch.Tensor:
        """The MLP's output from its input, as the forward computes it (the tests' identity): `mlp(mlp_input)`, unless
        the MLP module takes more than its input (Bloom's and MPT's add the residual themselves)."""
        out = mlp(mlp_input)
        return out[0] if isinstance(out, tuple) else out

    def mlp_arithmetic(self, mlp) -> MLPArithmetic:
        """How `mlp` (what `mlp_module` returns) forms `mlp_activation`, `mlp_neurons` and `mlp_output` from its input
        (`MLPArithmetic`): what the identities recompute. The common layout's: `down_proj(act_fn(gate_proj(x)) *
        up_proj(x))` where the MLP has `gate_proj` and `up_proj`; with a fused `gate_up_proj`, only the down projection;
        otherwise the activation is the neurons. Override where the MLP names its parts otherwise, or normalises or
        multiplies between them (BitNet's sub-norm, Falcon-H1's multipliers). A step looks its modules up only when it
        runs (an MoE layer's MLP has none of them)."""

        def down(neurons):
            return getattr(mlp, self.family.down_projection)(neurons)

        if hasattr(mlp, "up_proj") and hasattr(mlp, "gate_proj"):
            return MLPArithmetic(
                down,
                lambda x: mlp.gate_proj(x),
                lambda z: getattr(mlp, self.family.activation)(z),
                lambda x, activation: activation * mlp.up_proj(x),
            )
        if hasattr(mlp, "gate_up_proj"):  # fused: the first half is the gate (Phi-3's and GLM-4's chunk(2))
            return MLPArithmetic(
                down,
                lambda x: mlp.gate_up_proj(x).chunk(2, dim=-1)[0],
                lambda z: getattr(mlp, self.family.activation)(z),
                lambda x, activation: activation * mlp.gate_up_proj(x).chunk(2, dim=-1)[1],
            )
        return MLPArithmetic(
            down, neurons=lambda x, activation: activation, says=("", "activation", "down projection(neurons)")
        )

    def mlp_module(self, block) -> torch.nn.Module:
        """The module that runs the MLP in `block` (the checks call `mlp_forward` and the down projection on it): the
        MLP module, or the block itself where the block calls the MLP's parts inline (OPT)."""
        from ..locations import submodule

        return submodule(block, self.family.mlp)  # a dotted path where the block holds its sublayers in a list (T5)

    def residual_add(
        self, block, sublayer: str, stream: torch.Tensor, update: torch.Tensor, **arguments
    ) -> torch.Tensor:
        """The residual stream after `sublayer` ("attention" or "mlp") of `block` adds `update` (the sublayer's output,
        after any post-norm) to `stream`: their sum, unless the family scales the update (Granite's
        `residual_multiplier`) or the residual is several mixed streams (DeepSeek-V4's hyper-connections)."""
        return stream + update

    def post_norm(self, block, sublayer: str, name: str, output: torch.Tensor) -> torch.Tensor:
        """`output` of `sublayer` ("attention" or "mlp") through the norm after it (`name`, a path in `block`), as the
        block applies it: as it is, unless the family first casts it (Ergo's blocks norm it in float32)."""
        return block.get_submodule(name)(output)

    #: Arguments of a block's call (name -> position) that `residual_add` and `mlp_forward` also need, where the
    #: standardized values do not determine the residual or the MLP: none on most families (Gemma 3n's per-layer
    #: input, Zaya's router state carried from the previous block). `attnlens.checks` reads them from the block's
    #: inputs in the same trace and passes them to both as keyword arguments (a position, or a keyword's name where the
    #: block is called with it by keyword: Mllama's `full_text_row_masked_out_mask`).
    block_arguments: ClassVar[dict[str, int | str]] = {}

    def residual_read(self, owner, sublayer: str, stream: torch.Tensor) -> torch.Tensor:
        """What the norm in front of `sublayer` ("attention" or "mlp" of the block `owner`; "final" with the causal LM
        as `owner`) reads from the residual `stream`: the stream itself, unless several streams are collapsed first."""
        return stream

    def merge_heads(self, module, heads: torch.Tensor) -> torch.Tensor:
        """The premix from a prefill's head outputs [batch, seq, heads, head_dim] (times the gate where there is one):
        the heads concatenated, unless the family transforms each head's output first (DeepSeek-V4 rotates it back)."""
        return heads.reshape(*heads.shape[:2], -1)

    def position_bias(self, module, num_queries: int, num_keys: int) -> torch.Tensor | None:
        """The position bias `module` adds to its scores (`attention_position_bias`), computed as the forward does,
        or None where the block does not compute its own (T5's blocks after the first are handed the first's)."""
        return None

    def layer_position_bias(
        self, root, module, values: dict[str, torch.Tensor], num_queries: int, num_keys: int
    ) -> torch.Tensor | None:
        """`position_bias` where the block's bias also depends on the layer's values (read in the same forward, by
        name) or on modules outside the block (`root`, the wrapped model): DeBERTa's relative terms, from each layer's
        queries and keys and its encoder's relative embeddings. By default `position_bias(module, ...)`."""
        return self.position_bias(module, num_queries, num_keys)

    def score_bias_value(self, module, values: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        """That term on a prefill, [batch, heads, query, key], as the forward computes it from the attention `module`
        (transformers') and the layer's values read in the same forward (`values`, by name): the identities' side."""
        raise NotImplementedError(f"the {self.family.name} family declares a score bias but not how to compute it")
