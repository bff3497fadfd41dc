"""Inkling 2 (text): Inkling's attention (a hidden-state relative-position bias in the scores, short convolutions) with
a sink logit per query and head, a gated output projection, block attention residuals in place of one residual
stream, and a sparse mixture of experts on every layer.

- Block attention residuals: the layers are grouped in blocks of `n_layers_per_attn_res_block`. A layer's input is the
  running sum of its block (`layer_input`); the model also hands it `block_states`, the sums that entered each earlier
  block's first layer. Before the attention and before the MLP the layer reads a learned softmax mix over depth of
  those sums and the running one (`attention_input`, `mlp_input`: `Inkling2BlockAttentionResidual`; the latter's
  envoy is `layers[i].E_mlp_input`, since `layers[i].mlp_input` is the catalogue's value); the model reads one more
  (`final_input`) before the final norm. So `layer_mid = [layer_input +] post_attention_convolution(attention_output)`,
  without `layer_input` on a block's first layer (the running sum restarts there), and `layer_output = layer_mid +
  post_mlp_convolution(mlp_output)`. The MLP's norm and the final norm read a depth mix, not `layer_mid` or the last
  `layer_output`: `mlp_norm_output` and `final_norm_output` are not served (see `absent`).
- Sliding layers (`layer_types` "hybrid_sliding") read `input_layernorm` of the attention mix; full layers ("hybrid")
  read three mixes, normed by `q_input_layernorm`, `k_input_layernorm` and `v_input_layernorm`: their
  `attention_norm_output` is the query side, the attention's own input. Queries are the projection L2-clipped after a
  learned scale (times a log scale of the position on full layers), keys a short convolution of the projection
  (dynamic taps on full layers) L2-clipped, values the convolved projection RMS-normalised.
- Scores: `queries @ keys^T * head_dim ** -0.5 + bias + mask`, the bias from the query-side hidden state as in
  Inkling (`score_bias`). The eager function appends each query's sink logit per head (`sink_proj` of the hidden
  state) as one more key column, takes the softmax and drops the column: `attention_sinks` is that column.
- The output projection is gated: `o_proj.linear((head outputs merged) * sigmoid(o_proj.gate_proj(x)))`;
  `attention_gate` is the sigmoid per head, `attention_premix` what `o_proj.linear` receives.
"""

from __future__ import annotations

import torch

from ..family import INTERFACE_CALL, Family, Tiny, VLLMLayout
from ..locations import Derived, ModuleArgument, ModuleInput, Operation
from ..locations.views import per_head
from ..parts import identities, scoring
from ..parts.moe import PER_EXPERT, SparseMoE
from ..parts.sinks import SINK_NOTE, eager_with_sinks, with_sinks
from ..parts.sizes import Sizes
from ..parts.vllm import not_in_transformers

MOE_REASON = (
    "a sparse mixture of experts on every layer: each routed expert applies its soft-capped SwiGLU only to "
    "the tokens routed to it, inside mlp.experts (one expert at a time over the flattened tokens), so no "
    "[batch, seq, intermediate] tensor exists; mlp_output is the routing-weighted sum"
)
MLP_NORM_REASON = (
    "not served: post_attention_layernorm normalises not layer_mid but the block's depth mix of it "
    "with the earlier blocks' sums (the mlp_input module, envoy layers[i].E_mlp_input, on "
    "(block_states, layer_mid)), which no standardized value holds, so attnlens cannot tie the norm's "
    "output to layer_mid; the MLP receives that output unchanged, as mlp_input"
)
FINAL_NORM_REASON = (
    "the final norm does not read the last layer_output: it reads model.final_input(block_states, "
    "last layer_output), a learned softmax mix over depth of every block's sum, which no "
    "standardized value holds"
)
FULL_NORM_NOTE = (
    "q_input_layernorm's output, the attention's own input: the query-side depth mix, normalised, from "
    "which it forms its queries, the bias, the sink logits and the output gate; its keys and values "
    "read k_input_layernorm's and v_input_layernorm's outputs, of two other depth mixes of the same "
    "states (attention_input's second and third), which no standardized value holds"
)
BIAS = (
    "a relative-position bias computed from each query's hidden state (relative_position_bias: per-head weights "
    "from the hidden state, L2-clipped, mix learned bias-vs-distance profiles)"
)


def _sliding(config, layer: int) -> bool:
    return config.layer_types[layer] == "hybrid_sliding"


class Inkling2(SparseMoE, Family):
    model_types = ("inkling2_text",)
    vllm = VLLMLayout(
        refusal=not_in_transformers("Inkling 2", "Inkling2ForCausalLM", "Inkling2TextConfig", "inkling2_text")
    )
    tiny = Tiny(
        "Inkling2TextConfig",
        "Inkling2ForCausalLM",
        {
            "head_dim": 16,
            "swa_num_attention_heads": 2,
            "swa_num_key_value_heads": 1,
            "swa_head_dim": 32,
            "sliding_window_size": 4,
            "d_rel": 8,
            "rel_extent": 8,
            "unpadded_vocab_size": 128,
            "eos_token_id": 2,
            # full layers log-scale past position 4; blocks of two layers: layers 0 and 2 start one
            "log_scaling_n_floor": 4,
            "log_scaling_alpha": 0.5,
            "n_layers_per_attn_res_block": 2,
            "layer_types": ["hybrid_sliding", "hybrid", "hybrid_sliding"],
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
        },
    )
    eager = eager_with_sinks(
        scores=("attn_weights_2", "+ attention_mask"), probabilities=("attn_weights_5", "dropout(")
    )
    attention_post_norm = "post_attention_convolution"
    mlp_post_norm = "post_mlp_convolution"
    output_projection = "o_proj.linear"
    absent = {
        **Family.absent,
        **dict.fromkeys(PER_EXPERT, MOE_REASON),
        "mlp_norm_output": MLP_NORM_REASON,
        "final_norm_output": FINAL_NORM_REASON,
    }
    padding_changes_values = (
        "full layers scale queries and the bias by each query's position counted from the "
        "padded start (log_scaling_n_floor)"
    )
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_key_value_heads",))

    def locations(self):
        sinks = Derived(
            Operation((INTERFACE_CALL, "F_softmax_0"), anchor="softmax("),
            view=lambda envoy, probs: probs[..., -1],
            label="attention_sinks",
            in_place=False,
            why_not="it is the softmax's sink column, which the forward drops right after the softmax, "
            "so nothing reads it; edit attention_scores or attention_probabilities instead",
        )
        gate = per_head(
            Operation(("torch_sigmoid_0",), anchor="torch.sigmoid(", module="o_proj"), label="attention_gate"
        )
        ordered = {}
        for name, location in with_sinks(super().locations(), sinks).items():
            if name in ("mlp_norm_output", "final_norm_output"):
                continue
            if name == "attention_premix":
                ordered["attention_gate"] = gate
            ordered[name] = location
        ordered["attention_norm_output"] = ModuleInput(self.attention)  # input_layernorm's or q_input_layernorm's
        ordered["layer_mid"] = ModuleArgument("E_mlp_input", 1)  # (block_states, layer_mid)
        return ordered

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return config.sliding_window_size if _sliding(config, layer) else None

        def score_bias(self, config, layer):
            return BIAS if _sliding(config, layer) else BIAS + ", times the query's log scale"

    class Identities(identities.Identities):
        def project_output(self, module, premix):
            return module.o_proj.linear(premix)

        def residual_add(self, block, sublayer, stream, update):
            if sublayer == "attention" and block.is_block_boundary:
                return update.float()  # a block's first layer: the running sum restarts at the attention's output
            return stream.float() + update

        def score_bias_value(self, module, values, layer):
            hidden = values["attention_norm_output"]  # the attention's own (query-side) input
            length = hidden.shape[1]
            positions = torch.arange(length, device=hidden.device)
            distance = positions[:, None] - positions[None, :]
            return module.relative_position_bias(hidden, distance, positions[None])  # log-scaled inside on full layers

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        reasons.update(dict.fromkeys(PER_EXPERT, MOE_REASON))
        reasons["mlp_norm_output"] = MLP_NORM_REASON
        reasons["final_norm_output"] = FINAL_NORM_REASON
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        sliding = _sliding(config, layer)
        first = layer % config.n_layers_per_attn_res_block == 0
        mix = "attention_input(block_states, layer_input)[0]" if layer else "layer_input (layer 0 has no depth mix)"
        conv = "a causal depthwise short convolution, plus its input, over sqrt(conv_kernel_size + 1), in float32"
        dynamic = (
            "a dynamic causal short convolution (taps: static weights plus per-token weights projected from "
            "the input, shared per key/value head), plus its input, over sqrt(2 * conv_kernel_size + 1), in "
            "float32"
        )
        notes.update(
            {
                "embeddings": "the embedding rows RMS-normalised by the embedding module (embed_tokens)",
                "layer_input": (
                    f"the running sum of this layer's attention-residual block (blocks of "
                    f"{config.n_layers_per_attn_res_block} layers); the earlier blocks' sums are block_states, "
                    f"the block's second input, which the depth mixes read"
                ),
                "attention_queries": (
                    "q_proj: the projection, L2-clipped after a learned scale"
                    + (
                        ""
                        if sliding
                        else ", times the log scale 1 + alpha * log(max((position + 1) / log_scaling_n_floor, 1))"
                    )
                ),
                "attention_keys": f"k_proj: {conv if sliding else dynamic} of the projection, L2-clipped",
                "attention_values": f"v_proj: {conv if sliding else dynamic} of the projection, RMS-normalised without "
                f"weights",
                "attention_sinks": SINK_NOTE.replace(
                    "the head's sink logit", "the query's sink logit for the head (sink_proj of its hidden state)"
                ),
                "attention_probabilities": "rows sum to 1 - attention_sinks: the sink column is dropped after the "
                "softmax" + (f"; sliding window of {config.sliding_window_size} keys" if sliding else ""),
                "attention_gate": "sigmoid(o_proj.gate_proj(x)) per head, x the attention's (query-side) input, as "
                "o_proj multiplies the merged heads by it (in float32); a view, so in-place edits land",
                "attention_premix": "what o_proj.linear receives: the merged head outputs times attention_gate",
                "attention_output": f"self_attn's output, before post_attention_convolution ({conv})",
                "layer_mid": (
                    (
                        "post_attention_convolution(attention_output): this layer starts a block, so the running "
                        "sum restarts (layer_input joins block_states)"
                    )
                    if first
                    else "layer_input + post_attention_convolution(attention_output)"
                )
                + "; the second input of the block's mlp_input module (a depth mix), in float32",
                "mlp_input": "post_attention_layernorm(mlp_input(block_states, layer_mid)[0]), mlp_input the block's "
                "depth mix (its envoy is layers[i].E_mlp_input): the MLP reads a depth mix, normalised",
                "layer_output": "layer_mid + post_mlp_convolution(mlp_output)",
                "logits": "soft-capped: tanh(l / c) * c with c = final_logit_softcapping",
            }
        )
        extent = config.sliding_window_size if sliding else config.rel_extent
        notes["attention_norm_output"] = (
            f"input_layernorm({mix}): what the attention reads" if sliding else FULL_NORM_NOTE
        )
        notes["attention_scores"] = (
            f"queries @ keys^T * head_dim ** -0.5 plus {BIAS}, zero {extent} keys back and "
            f"beyond"
            + ("" if sliding else ", its weights times the query's log scale")
            + ", then masked; the family's score function leaves the bias out"
        )
        return notes


#: Values read on the model, not on a block: a looped block keeps them.
MODEL_VALUES = ("embeddings", "final_norm_output", "logits")


class Inkling2Loop(Inkling2):
    """Inkling 2 with a looped core: the forward runs layers `loop_layer_index_start` to `loop_layer_index_end - 1`
    `loop_num_passes` times. Each pass after the first restarts from the states that entered the loop and gates each
    looped block's query, key, value and MLP inputs with messages from the previous pass (`message_input`,
    `*_message_gate`), keeping its keys and values in cache slots of its own. A looped block therefore computes
    `loop_num_passes` values of every block value per forward, each a different tensor: one value per block per forward
    is not defined there, and attnlens serves none of them. The blocks before and after the loop run once per forward
    and are served exactly as Inkling 2's (the first block after the loop reads the last pass's output)."""

    model_types = ("inkling2_loop_text",)
    vllm = VLLMLayout(
        refusal=not_in_transformers(
            "Inkling 2 Loop", "Inkling2LoopForCausalLM", "Inkling2LoopTextConfig", "inkling2_loop_text"
        )
    )
    tiny = Tiny(
        "Inkling2LoopTextConfig",
        "Inkling2LoopForCausalLM",
        {
            **Inkling2.tiny[2],
            "num_hidden_layers": 4,
            "n_layers_per_attn_res_block": 1,
            "layer_types": ["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid"],
            # layer 1 runs twice per forward; layers 0, 2 and 3 once
            "loop_layer_index_start": 1,
            "loop_layer_index_end": 2,
            "loop_num_passes": 2,
            "loop_gate_rank": 8,
        },
    )

    @staticmethod
    def looped(config, layer: int) -> bool:
        return config.loop_layer_index_start <= layer < config.loop_layer_index_end

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"looped"} if self.looped(config, layer) else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if "looped" in kind:
            locations = {name: location for name, location in locations.items() if name in MODEL_VALUES}
        return locations

    def unavailable(self, config, layer, engine="transformers"):
        reasons = super().unavailable(config, layer, engine)
        if self.looped(config, layer):
            start, end, passes = config.loop_layer_index_start, config.loop_layer_index_end, config.loop_num_passes
            why = (
                f"layer {layer} is in the looped core (layers {start} to {end - 1}), which the forward runs "
                f"loop_num_passes={passes} times: each pass calls this block again, the passes after the first "
                f"on the states that entered the loop with message gates from the previous pass, so the block "
                f"computes {passes} different values of this per forward, not one; attnlens serves one value per "
                f"block per forward. Read one pass through nnsight, which numbers a module's calls in a forward"
            )
            for name in reasons.keys() | {n for n in self.locations() if n not in MODEL_VALUES}:
                if name not in MODEL_VALUES:
                    reasons[name] = why
        return reasons

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if self.looped(config, layer):
            return {name: note for name, note in notes.items() if name in MODEL_VALUES}
        if layer == config.loop_layer_index_end:
            notes["layer_input"] += "; the last pass of the looped core's output"
        return notes
