"""A family: where each standardized value lives in one architecture, its sizes, its score function, its limits.

A family is mostly data (module names and the operations where values live) plus the few functions that truly
differ. `Family` itself describes the common case, a transformers decoder whose attention calls the shared attention
interface (`attention_interface_1`) with the eager function defined in the model's own file (Llama and most
families since). A new family subclasses it, states how it differs, and registers:

    @attnlens.register
    class MyFamily(attnlens.Family):
        model_types = ("my_model",)
        mlp_norm = "pre_mlp_norm"
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from .errors import LocationDrift, UnknownFamily
from .geometry import HeadGeometry
from .locations import Location, ModuleInput, ModuleOutput, Operation, OutputField, with_key_positions
from .values import ALL_VALUES, BY_NAME

#: The engines a family describes, and what each runs: transformers' own modules (`StandardizedTransformer`, whatever
#: its attention implementation), and vLLM's (`StandardizedVLLM`).
ENGINES = {"eager": "transformers", "vllm": "vllm"}

if TYPE_CHECKING:
    from .fused import FusedQKV

INTERFACE_CALL = "attention_interface_1"

#: The sizes every tiny model shares: grouped heads (4 query, 2 key/value), three blocks, a wide initialisation so
#: patterns are far from uniform.
TINY_DEFAULTS = dict(
    num_hidden_layers=3, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    vocab_size=128, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    initializer_range=0.2,
)


def operation_lines(function: Callable) -> dict[str, str]:
    """The operations nnsight names inside `function` (decorators peeled), each with its source line."""
    from nnsight.intervention.source import compiled, decorator_chain

    innermost, _ = decorator_chain(function)
    code = compiled(innermost)
    lines = code.source.split("\n")
    return {name: lines[code.lines[name] - 1].strip() for name in code.names}


@dataclass(frozen=True)
class MLPArithmetic:
    """How an MLP forms its values from its input, step by step, with its own modules (`Family.mlp_arithmetic`):

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


class Family:
    """The common transformers decoder layout. Override attributes and methods to describe another."""

    #: `config.model_type` values this family serves.
    model_types: ClassVar[tuple[str, ...]] = ()

    # Module paths: from the wrapped model, from a block, from its attention, from its MLP.
    layers = "model.layers"
    embed_tokens = "model.embed_tokens"
    final_norm = "model.norm"
    attention = "self_attn"
    mlp = "mlp"
    attention_norm = "input_layernorm"
    mlp_norm = "post_attention_layernorm"
    output_projection = "o_proj"
    activation = "act_fn"
    down_projection = "down_proj"

    #: Norms applied to the attention and MLP outputs before the residual add (Gemma 2 and 3), or None; without
    #: them `layer_input + attention_output == layer_mid` and `layer_mid + mlp_output == layer_output`.
    attention_post_norm: str | None = None
    mlp_post_norm: str | None = None
    #: Values that exist only inside transformers' eager attention function.
    eager_only: ClassVar[tuple[str, ...]] = ("attention_scores", "attention_probabilities")
    #: The assignment in the eager function holding the masked scores, and the line it must be on.
    scores_operation = ("attn_weights_1", "+ attention_mask")
    #: The assignment holding the pattern after softmax and dropout.
    probabilities_operation = ("attn_weights_3", "dropout(")
    #: Values that are views of a fused projection's split: torch refuses in-place edits of them, assignment works.
    fused_views: ClassVar[tuple[str, ...]] = ()
    #: The fused query/key/value projection and its output's layout (`attnlens.fused.FusedQKV`), or None where
    #: queries, keys and values have projections of their own. `attnlens.split_fused_qkv` splits with it.
    fused_qkv: ClassVar[FusedQKV | None] = None
    #: Why a value missing from `locations()` is missing, where the generic "has no ..." would not say enough.
    absent: ClassVar[dict[str, str]] = {
        "attention_sinks": "no sink logit: every row of the pattern sums to one",
        "attention_gate": "no output gate: the merged head outputs are the premix",
    }

    #: How to build a small random model of the family: (config class, model class, config keyword arguments),
    #: the classes named in `transformers`. `attnlens.models.tiny` merges `TINY_DEFAULTS` under the arguments.
    tiny: ClassVar[tuple[str, str, dict] | None] = None
    #: Other layouts of the family worth testing: name -> config overrides on top of `tiny` (`"falcon:alibi"`).
    tiny_layouts: ClassVar[dict[str, dict]] = {}

    @property
    def name(self) -> str:
        return type(self).__name__

    # --- where each value lives ---------------------------------------------------------------------------

    def locations(self) -> dict[str, Location]:
        """Value name -> location, in forward order. Values missing here are unavailable on the family."""
        scores, scores_anchor = self.scores_operation
        probabilities, probabilities_anchor = self.probabilities_operation
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            "attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
            "attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
            "attention_values": Operation((INTERFACE_CALL,), "arg", 3),
            "attention_scores": Operation((INTERFACE_CALL, scores), anchor=scores_anchor),
            "attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=probabilities_anchor),
            "attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
            "attention_premix": ModuleInput(self.output_projection),
            "attention_output": ModuleOutput("", 0),
            **self.after_attention(),
        }

    def after_attention(self, **replaced: Location) -> dict[str, Location]:
        """The locations from `layer_mid` to `logits` in the common block, some `replaced`: families that spell out
        their own attention locations end with these."""
        tail = {
            "layer_mid": ModuleInput(self.mlp_norm),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),
            "layer_output": ModuleOutput("", 0),
            "final_norm_output": ModuleOutput(self.final_norm),
            "logits": OutputField("logits"),  # after any final soft-cap, as the caller receives them
        }
        return {**tail, **replaced}

    # --- layers of different kinds ---------------------------------------------------------------------------

    def layer_kind(self, config, layer: int) -> frozenset[str]:
        """Tags that set `layer`'s locations apart from another layer's: a hybrid's linear-attention layers, MoE
        layers, a config's block layout. Layers of one kind share their locations (and their load-time check)."""
        return frozenset()

    def kind_locations(self, kind: frozenset[str], config, engine: str) -> dict[str, Location]:
        """The locations of a layer of `kind` on `engine`, in forward order. Override to adjust per kind (call
        super first); `kind` must determine the result, `config` only supplies what `kind` names."""
        return self.locations() if engine == "eager" else self.vllm_locations()

    def locations_for(self, config, layer: int | None, engine: str = "eager") -> dict[str, Location]:
        """Value name -> location on `layer` (None: the model's own values, as on layer 0), in forward order.
        Values missing here are unavailable there."""
        kind = self.layer_kind(config, 0 if layer is None else layer)
        cache = self.__dict__.setdefault("_by_kind", {})
        if (kind, engine) not in cache:
            cache[kind, engine] = with_key_positions(self.kind_locations(kind, config, engine))
        return cache[kind, engine]

    def location(self, name: str, config=None, layer: int | None = None, engine: str = "eager") -> Location | None:
        return self.locations_for(config, layer, engine).get(name)

    def path(self, role: str, engine: str = "eager") -> str:
        """The module path of `role` ("layers", "attention", "mlp", "output_projection", ...) on `engine`: the
        attribute above, or its `vllm_names` entry in vLLM's implementation."""
        return self.vllm_names.get(role, getattr(self, role)) if engine == "vllm" else getattr(self, role)

    def renames(self, engine: str = "eager") -> dict[str, str]:
        """nnsight's `rename=`: module names -> the standardized `layers`, `self_attn` and `mlp`."""
        renames = {self.path("layers", engine): "layers"}
        for role, standard in (("attention", "self_attn"), ("mlp", "mlp")):
            name = self.path(role, engine)
            if name and name != standard:
                renames[name] = standard
        return renames

    def project_output(self, module, premix: torch.Tensor) -> torch.Tensor:
        """The attention output from the premix, as the forward computes it (the tests' identity, rebuilds)."""
        return getattr(module, self.output_projection)(premix)

    def project_routed_output(self, module, premix: torch.Tensor, attention_input: torch.Tensor | None) -> torch.Tensor:
        """The attention output from the premix where the output path also depends on what the attention received
        (`attention_input`, the `attention_norm_output` read in the same forward; None where unread): JetMoE routes
        each token to its output experts by the attention's input. By default `project_output`, which ignores it."""
        return self.project_output(module, premix)

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
            return getattr(mlp, self.down_projection)(neurons)

        if hasattr(mlp, "up_proj") and hasattr(mlp, "gate_proj"):
            return MLPArithmetic(down, lambda x: mlp.gate_proj(x), lambda z: getattr(mlp, self.activation)(z),
                                 lambda x, activation: activation * mlp.up_proj(x))
        if hasattr(mlp, "gate_up_proj"):  # fused: the first half is the gate (Phi-3's and GLM-4's chunk(2))
            return MLPArithmetic(down, lambda x: mlp.gate_up_proj(x).chunk(2, dim=-1)[0],
                                 lambda z: getattr(mlp, self.activation)(z),
                                 lambda x, activation: activation * mlp.gate_up_proj(x).chunk(2, dim=-1)[1])
        return MLPArithmetic(down, neurons=lambda x, activation: activation,
                             says=("", "activation", "down projection(neurons)"))

    def mlp_module(self, block) -> torch.nn.Module:
        """The module that runs the MLP in `block` (the checks call `mlp_forward` and the down projection on it): the
        MLP module, or the block itself where the block calls the MLP's parts inline (OPT)."""
        return getattr(block, self.mlp)

    def residual_add(self, block, sublayer: str, stream: torch.Tensor, update: torch.Tensor,
                     **arguments) -> torch.Tensor:
        """The residual stream after `sublayer` ("attention" or "mlp") of `block` adds `update` (the sublayer's output,
        after any post-norm) to `stream`: their sum, unless the family scales the update (Granite's
        `residual_multiplier`) or the residual is several mixed streams (DeepSeek-V4's hyper-connections)."""
        return stream + update

    #: Arguments of a block's call (name -> position) that `residual_add` and `mlp_forward` also need, where the
    #: standardized values do not determine the residual or the MLP: none on most families (Gemma 3n's per-layer
    #: input, Zaya's router state carried from the previous block). `attnlens.checks` reads them from the block's
    #: inputs in the same trace and passes them to both as keyword arguments.
    block_arguments: ClassVar[dict[str, int]] = {}

    def residual_read(self, owner, sublayer: str, stream: torch.Tensor) -> torch.Tensor:
        """What the norm in front of `sublayer` ("attention" or "mlp" of the block `owner`; "final" with the causal LM
        as `owner`) reads from the residual `stream`: the stream itself, unless several streams are collapsed first."""
        return stream

    def merge_heads(self, module, heads: torch.Tensor) -> torch.Tensor:
        """The premix from a prefill's head outputs [batch, seq, heads, head_dim] (times the gate where there is one):
        the heads concatenated, unless the family transforms each head's output first (DeepSeek-V4 rotates it back)."""
        return heads.reshape(*heads.shape[:2], -1)

    def notes(self, config, layer: int, engine: str = "eager") -> dict[str, str]:
        """Value name -> what is special about it on this family and layer (shown by `support()`, which adds what
        the value's location says about it on `engine`)."""
        notes = {}
        if engine == "eager":
            notes = dict.fromkeys(self.fused_views, "a view of the fused projection: assign it, in-place edits fail")
        window = self.window(config, layer, engine)
        if window is not None:
            kept = ("under generate the cache keeps only the window" if engine == "eager" else
                    "rebuilt over the whole context (zeros outside the window)")
            notes["attention_probabilities"] = f"sliding window: each query sees its last {window} keys; {kept}"
        cap = self.softcap(config, layer)
        if cap is not None:
            notes["attention_scores"] = f"soft-capped before the mask: tanh(s / {cap}) * {cap}"
        if self.attention_post_norm is not None:
            notes["layer_mid"] = f"layer_input + {self.attention_post_norm}(attention_output): a norm follows attention"
        return notes

    def drilled_functions(self, attention_module: torch.nn.Module) -> dict[str, Callable]:
        """The functions the attention forward's calls run under eager, by call name, for load-time checks."""
        module = sys.modules[type(attention_module).__module__]
        return {INTERFACE_CALL: module.eager_attention_forward}

    # --- sizes, read off the attention module and its config -----------------------------------------------

    def num_heads(self, module) -> int:
        return module.config.num_attention_heads

    def num_kv_heads(self, module) -> int:
        return getattr(module.config, "num_key_value_heads", None) or self.num_heads(module)

    def head_dim(self, module) -> int:
        return module.head_dim

    def qk_head_dim(self, module) -> int:
        return self.head_dim(module)

    def scale(self, module) -> float:
        return module.scaling

    def geometry(self, module) -> HeadGeometry:
        """The heads of the attention `module` (transformers'), read with the size methods above."""
        return HeadGeometry(self.num_heads(module), self.num_kv_heads(module), self.head_dim(module),
                            self.qk_head_dim(module), self.scale(module))

    def alibi_slopes(self, config, layer: int) -> torch.Tensor | None:
        """The per-head ALiBi slopes vLLM's kernel holds for `layer` (float32), or None where it adds no ALiBi: checked
        against the kernel at load."""
        return None

    def softcap(self, config, layer: int) -> float | None:
        """The score soft-cap (`tanh(s / c) * c`) applied before the mask, or None."""
        return None

    def score_bias(self, config, layer: int) -> str | None:
        """What `layer`'s scores add that the queries and keys cannot give (Inkling's relative-position bias, computed
        from each query's hidden state), in words, or None (the default): the score function gives the scores. Where
        there is one, `scores()` leaves it out, patterns are neither rebuilt nor summarised from the queries and keys
        on that layer, and the identities add `score_bias_value` to the score function."""
        return None

    def beyond_queries_and_keys(self, config, layer: int) -> str | None:
        """Why the score function on queries and keys alone does not give `layer`'s pattern (what rebuilt patterns
        and head summaries compute it from), or None: a sink logit, scores that depend on the values, a score bias."""
        if self.scores_need_values:
            return f"the {self.name} family's scores depend on the values ({self.scores_need_values})"
        if "attention_sinks" in self.locations_for(config, layer):
            return "the softmax also takes each head's sink logit"
        bias = self.score_bias(config, layer)
        if bias is not None:
            return f"the scores add {bias}, which the queries and keys cannot give"
        return None

    def score_bias_value(self, module, values: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        """That term on a prefill, [batch, heads, query, key], as the forward computes it from the attention `module`
        (transformers') and the layer's values read in the same forward (`values`, by name): the identities' side."""
        raise NotImplementedError(f"the {self.name} family declares a score bias but not how to compute it")

    def sliding_window(self, config, layer: int) -> int | None:
        """How many keys back a query of `layer` sees (itself included) in transformers, or None for full causal
        attention."""
        layer_types = getattr(config, "layer_types", None)
        window = getattr(config, "sliding_window", None)
        if layer_types is not None:
            return window if layer_types[layer] == "sliding_attention" else None
        return window

    def vllm_sliding_window(self, config, layer: int) -> int | None:
        """The window vLLM's implementation gives `layer`'s kernel (checked against the kernel at load): transformers'
        unless the family says vLLM differs."""
        return self.sliding_window(config, layer)

    def window(self, config, layer: int, engine: str = "eager") -> int | None:
        """The sliding window `engine` applies to `layer`."""
        return self.vllm_sliding_window(config, layer) if engine == "vllm" else self.sliding_window(config, layer)

    # --- the score function ----------------------------------------------------------------------------------

    #: Why the score function also needs the layer's values (`scores(..., values=)`), or None where the queries and
    #: keys determine the scores: Doge adds a dynamic mask computed from the values. The identity suite passes them;
    #: head summaries and patterns rebuilt on sdpa, which read only the queries and keys, refuse such a family.
    scores_need_values: ClassVar[str | None] = None

    def scores(
        self,
        heads: HeadGeometry,
        config,
        queries: torch.Tensor,
        keys: torch.Tensor,
        layer: int,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The scores entering the softmax, computed the way the family computes them.

        `queries` [batch, num_heads, query, qk_head_dim], `keys` [batch, num_kv_heads, key, qk_head_dim] as read;
        the queries are the last `query` positions of the keys (a prefill, or decode steps against a cache).
        `key_mask` [batch, key] is 1 for real tokens, 0 for padding. Masked entries hold the dtype's minimum. Every
        tensor made here is made on the queries' device.
        """
        keys = self.repeat_kv(keys, queries.shape[1] // keys.shape[1])
        scores = torch.matmul(queries, keys.transpose(2, 3)) * heads.scale
        cap = self.softcap(config, layer)
        if cap is not None:
            scores = torch.tanh(scores / cap) * cap
        return scores + self.mask(queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype,
                                  scores.device, engine=heads.engine)

    def repeat_kv(self, tensor: torch.Tensor, groups: int) -> torch.Tensor:
        """Keys or values `[batch, num_kv_heads, ...]` repeated to one per query head, paired the way the family's
        attention pairs them: each key/value head's `groups` query heads in a row (`repeat_interleave`, transformers'
        `repeat_kv`), unless the family tiles them (JetMoE's `repeat(1, top_k, 1, 1)`)."""
        return tensor.repeat_interleave(groups, dim=1)

    def softmax(self, scores: torch.Tensor, sinks: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pattern from the scores, in float32 as the eager functions compute it, and each query's sink share
        where the layer's heads have sink logits (`sinks` [heads]; None without): the softmax over the keys and one
        sink column, the column dropped (GPT-OSS's eager function), so each row sums to one less the share."""
        if sinks is None:
            return scores.softmax(-1, dtype=torch.float32).to(scores.dtype), None
        column = sinks.to(scores)[None, :, None, None].expand(*scores.shape[:-1], 1)
        joined = torch.cat([scores, column], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values
        probabilities = joined.softmax(-1, dtype=joined.dtype)
        return probabilities[..., :-1], probabilities[..., -1]

    def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32,
             device=None, engine="eager") -> torch.Tensor:
        """The additive mask `engine` applies: 0 where a query sees a key, the dtype's minimum elsewhere.
        [batch or 1, 1, q, k]."""
        key_positions = torch.arange(num_keys, device=device)
        query_positions = key_positions[num_keys - num_queries:, None]
        visible = key_positions[None, :] <= query_positions
        window = self.window(config, layer, engine)
        if window is not None:
            visible &= query_positions - key_positions[None, :] < window
        visible = visible[None, None]
        if key_mask is not None:
            visible = visible & key_mask[:, None, None, :].bool().to(visible.device)
        return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)

    # --- what cannot be read, and why --------------------------------------------------------------------------

    def unavailable(self, config, layer: int, engine: str = "eager") -> dict[str, str]:
        """Value name -> why `layer` cannot serve it on `engine`, for a model of `config`. Called before anything
        runs. A value missing from the layer's locations gets the family's `absent` reason; one the family has but
        vLLM's implementation lacks gets `vllm_absent`'s."""
        reasons = {}
        implementation = getattr(config, "_attn_implementation", "eager")
        if engine == "eager" and implementation != "eager":
            for name in self.eager_only:
                reasons[name] = (
                    f"read inside transformers' eager attention function, but this model runs "
                    f"{implementation!r}, which never forms it; load with attn_implementation='eager'"
                )
        family_has = self.locations_for(config, layer)
        here = self.locations_for(config, layer, engine)
        for value in ALL_VALUES:
            if value.name in reasons:
                continue
            if value.name not in family_has:
                reasons[value.name] = self.absent.get(value.name) or Family.absent.get(value.name) or \
                    f"the {self.name} family has no {value.name.replace('_', ' ')}"
            elif value.name not in here:
                reasons[value.name] = self.vllm_absent.get(value.name) or \
                    "not read by attnlens's vLLM backend on this family"
        return reasons

    # --- load-time checks ----------------------------------------------------------------------------------------

    def verify(self, model, layer: int, layer_module, attention_module) -> None:
        """Check every recorded operation of `layer` against the installed transformers; raise `LocationDrift` if one
        moved."""
        from transformers import __version__

        scopes = {"attention": attention_module}
        for name, location in self.locations_for(model.config, layer).items():
            while hasattr(location, "source") and isinstance(location.source, Location):
                location = location.source
            if not isinstance(location, Operation):
                continue
            scope = BY_NAME[name].scope if name in BY_NAME else "attention"
            if scope == "mlp":  # read on the MLP's envoy, so relative to the MLP module
                scopes.setdefault("mlp", layer_module.get_submodule(self.mlp))
            host = scopes.get(scope, layer_module)
            for part in filter(None, location.module.split(".")):
                host = getattr(host, part)
            function = type(host).forward
            where = f"{type(host).__name__}.forward"
            for depth, op_name in enumerate(location.path):
                lines = operation_lines(function)
                if op_name not in lines or (location.anchor and depth == len(location.path) - 1 \
                        and location.anchor not in lines[op_name]):
                    stem = op_name.rsplit("_", 1)[0]
                    similar = {n: line for n, line in lines.items() if n.rsplit("_", 1)[0] == stem}
                    found = "; ".join(f"{n}: `{line}`" for n, line in similar.items()) or "no operation of that name"
                    expected = f"operation {op_name!r}" + (f" on a line containing {location.anchor!r}"
                                                           if location.anchor else "")
                    raise LocationDrift(
                        f"family {self.name}, value {name}: expected {expected} in {where} "
                        f"(transformers {__version__}), found {found}. The installed transformers moved this value; "
                        f"update the family's location (see docs/extending.md)."
                    )
                if depth < len(location.path) - 1:
                    drilled = self.drilled_functions(attention_module)
                    if op_name not in drilled:
                        break  # resolved only at run time; the identities in the test suite check it
                    function = drilled[op_name]
                    where = f"{getattr(function, '__qualname__', function)}"

    # --- vLLM ---
    # Where the values live in vLLM's implementation of the family (vllm/model_executor/models/*.py). vLLM keeps
    # transformers' module names for the common layout, so the defaults reuse the names above.

    #: The model types whose vLLM implementation these locations were checked against; `StandardizedVLLM` refuses
    #: the others rather than guess. Not inherited in effect: a subclass serves other model types, so it lists its own.
    vllm_model_types: ClassVar[tuple[str, ...]] = ()
    #: Module names (role -> path, as the attributes above) where vLLM's implementation names them otherwise.
    vllm_names: ClassVar[dict[str, str]] = {}
    #: Why vLLM cannot run the family at all (vLLM's own reason), where it cannot.
    vllm_refusal: ClassVar[str | None] = None

    def vllm_reason(self, model_type: str) -> str | None:
        """Why `StandardizedVLLM` does not serve `model_type` on this family (None: it does)."""
        if model_type in self.vllm_model_types:
            return None
        return self.vllm_refusal or (f"the {self.name} family's vLLM locations are not checked for model type "
                                     f"{model_type!r}; check them against vLLM's implementation, override "
                                     f"Family.vllm_locations if they differ, and add the type to vllm_model_types")
    #: vLLM's attention kernel module inside the attention block: it receives q, k, v flat, `[tokens, heads * dim]`,
    #: after rotary embedding and any QK-norm.
    vllm_kernel = "attn"
    #: Config overrides on top of `tiny` for a checkpoint vLLM's CPU kernels accept (head sizes of 32 and up), and
    #: the dtype vLLM runs the family in on CPU: what tests_vllm builds for every family with `vllm_model_types`.
    vllm_tiny: ClassVar[dict] = {"head_dim": 32}
    vllm_dtype: ClassVar[str] = "float32"
    #: Why left padding changes this family's values (positions counted from the padded start, a recurrence run over
    #: the padding), or None: batched runs then put only prompts of one length in a forward.
    padding_changes_values: ClassVar[str | None] = None
    #: How far (relative) vLLM's values may be from the eager engine's on the same weights, where vLLM computes a
    #: part of the model otherwise (Bloom's exact GELU); None: the dtype's rounding.
    vllm_tolerance: ClassVar[float | None] = None
    #: Why a value the family has is missing from `vllm_locations()`.
    vllm_absent: ClassVar[dict[str, str]] = {
        "mlp_activation": "vLLM fuses the activation with the up projection (act_and_mul on gate_up_proj), so the "
                          "activation alone is never formed; mlp_neurons is its output",
    }

    def vllm_locations(self) -> dict[str, Location]:
        """Value name -> location in vLLM's implementation of the common layout, in forward order."""
        from .vllm.locations import KernelInput, RebuiltPattern, ResidualPair, SampledLogits, batched, copied, heads_of

        kernel, path = self.vllm_kernel, lambda role: self.path(role, "vllm")
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


def block_list(model: torch.nn.Module, *, any_depth: bool = False) -> str | None:
    """The path of the model's list of blocks: a ModuleList as long as the text config's `num_hidden_layers` (the
    decoder's where several are); where the config gives no depth (Blt's), or `any_depth` and no list has it (the
    survey's look at blocks that hold several sub-layers each: HRM, LongCat-Flash), the first list of two or more
    blocks of one class, the decoder's first. None where there is none."""
    depth = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    try:
        decoder = {id(m) for m in model.get_decoder().modules()}
    except Exception:  # noqa: BLE001  (no decoder to prefer)
        decoder = set()
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
    uniform = [(name, m) for name, m in lists if len(m) >= 2 and len({type(block) for block in m}) == 1]
    fit = [(name, m) for name, m in lists if len(m) == depth] if depth is not None else uniform
    if not fit and any_depth:
        fit = uniform
    ranked = [name for name, m in fit if id(m) in decoder] + [name for name, _ in fit]
    return ranked[0] if ranked else None


class UnknownLayout(Family):
    """What attnlens serves on a model whose family it does not know: the block inputs and outputs, the embeddings
    and the logits, found from the model's structure. Every other value is unavailable with a reason saying how to
    add the family (and, where given, why the common layout was refused: `refusal`)."""

    def __init__(self, model: torch.nn.Module, refusal: str = ""):
        self.model_type = model.config.model_type
        self.refusal = refusal
        depth = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
        names = {id(m): n for n, m in model.named_modules()}
        self.layers = block_list(model)
        if self.layers is None:
            raise UnknownFamily(f"attnlens has no family for model type {self.model_type!r} and found no list of "
                                f"{depth or 'several'} blocks in it; add the family (docs/extending.md)")
        self.depth_given = depth is not None
        self.embed_tokens = names.get(id(model.get_input_embeddings()))
        #: Why the blocks may not run once each per forward (None: they do, or nothing says otherwise).
        self.blocks_not_once: str | None = None
        #: What kind of model it is where it is no plain decoder with attention (an encoder, attention-free), or None.
        self.kind: str | None = None

    @property
    def name(self) -> str:
        return f"unknown ({self.model_type})"

    def locations(self):
        found = {"embeddings": ModuleOutput(self.embed_tokens)} if self.embed_tokens else {}
        if self.blocks_not_once is None:
            found.update(layer_input=ModuleInput(), layer_output=ModuleOutput("", 0))
        return {**found, "logits": OutputField("logits")}

    def notes(self, config, layer, engine="eager"):
        if self.depth_given:
            return {}
        return {"layer_input": f"the blocks of {self.layers}: the config gives no num_hidden_layers, so these are the "
                               f"first list of blocks of one class"}

    def unavailable(self, config, layer, engine="eager"):
        reason = (f"attnlens has no family for model type {self.model_type!r}"
                  + (f" ({self.kind})" if self.kind else "")
                  + (f", and the common layout was refused ({self.refusal})" if self.refusal else "")
                  + "; subclass attnlens.Family with this model's module names and register it (docs/extending.md)")
        blocks = dict.fromkeys(("layer_input", "layer_output"), self.blocks_not_once) if self.blocks_not_once else {}
        return {**{value.name: reason for value in ALL_VALUES if value.name not in self.locations()}, **blocks}

    def verify(self, model, layer, layer_module, attention_module):
        pass
