"""Qwen4-Exp: Qwen3-Next's hybrid (sigmoid-gated softmax attention beside Gated DeltaNet linear attention, a sparse
mixture of experts with a gated shared expert on every layer) with hyper-connections in place of a single residual
stream, an indexer that makes the softmax layers sparse (QSA), and hashed n-gram inputs (PLE) on some layers.

- Hyper-connections: the residual is `hc_count` streams, held flat as `[batch, seq, hc_count * hidden]`; attnlens
  serves `layer_input`, `layer_mid` and `layer_output` as views `[batch, seq, hc_count, hidden]` (in-place edits land,
  assignments are flattened back). There are no norm modules in the block: `attn_hyper_connection` (a
  `Qwen4ExpTextGatedResidual`) RMS-normalises each stream (`hc_norm`) and collapses them by learned sigmoid weights
  into what the attention reads (`attention_norm_output`), and writes back
  `streams + injection_weights * attention_output` (one weight per stream); `mlp_hyper_connection` does the same
  around the MoE, whose input is that collapse (`mlp_input`). The model collapses the last streams with
  `hyper_connection_mixer` (no other final norm): `final_norm_output` is its output, what `lm_head` reads.
- Softmax layers (`indexed_attention`) are Qwen3-Next's gated attention, made sparse by `self_attn.indexer`: each
  query sees only the keys of the `indexer_budget // indexer_compress_ratio` best-scored complete blocks of
  `indexer_compress_ratio` visible keys, plus the trailing incomplete block; the forward folds that choice into the
  mask it hands the attention function (the dtype's minimum elsewhere), so the scores and the pattern read are exact
  and sparse. The family's score function applies the causal mask only: it equals the scores on the chosen keys, and
  everywhere while a query sees at most `indexer_budget` keys.
- PLE layers (`ple_layer_ids`, 1-based, linear-attention layers only) add `ple(layer_input, token ids)` to the streams
  before the attention's hyper-connection: there `layer_mid` is formed from `layer_input + ple(...)`, a branch that is
  no standardized value.
- The rotary embedding is multimodal (mrope): on text, every section has the token's position, so it is the plain
  rotary embedding on the first `head_dim * partial_rotary_factor` dims.

A "qwen4_exp" checkpoint loaded through `AutoModelForCausalLM` (transformers maps the type to `Qwen4ExpForCausalLM`)
is built on its text config, model type "qwen4_exp_text", and served by the text family. A model of type "qwen4_exp"
is the composite `Qwen4ExpForConditionalGeneration` handed over as an object: its language model sits under
`model.language_model` (`multimodal.LanguageModelOf`), and on token ids alone it runs as the text model does.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import replace

import torch

from ..family import TINY_DEFAULTS, Tiny
from ..locations import Derived, ModuleInput, ModuleOutput
from ..parts import identities, scoring
from ..parts.multimodal import LanguageModelOf
from .deepseek_v32 import Indexed
from .qwen3_next import Qwen3Next

#: Two streams, a small indexer whose budget (32 keys) covers the test prompts, so the identities hold on the causal
#: mask (tests/families/test_qwen4_exp.py makes it bind); no PLE layers (their branch needs the token ids).
TINY = {
    "head_dim": 16,
    "layer_types": ["linear_attention", "indexed_attention", "linear_attention"],
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "hc_count": 2,
    "hc_lowrank": 16,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 32,
    "indexer_compress_ratio": 2,
    "ple_layer_ids": [],
}
STREAMS = "the {} hyper-connection streams [batch, seq, hc_count, hidden] (a view of the forward's flat tensor), {}"
NORM_REASON = (
    "Qwen4-Exp has no norm in front of the MLP: mlp_hyper_connection RMS-normalises each residual stream "
    "and collapses them by learned sigmoid weights, returning that collapse with the streams and the "
    "injection weights; the collapse is what the MLP receives, served as mlp_input"
)


@functools.cache
def sums_masks() -> bool:
    """Whether the installed transformers adds the indexer's mask to the causal mask (5.19: `attention_mask +
    selected_token_mask`, both the dtype's minimum where masked, so a key both mask overflows to -inf) rather than
    filling the keys the indexer skips with the minimum (5.24)."""
    from transformers.models.qwen4_exp import modeling_qwen4_exp

    return "attention_mask + selected_token_mask" in inspect.getsource(modeling_qwen4_exp.Qwen4ExpTextAttention)


def _streams(envoy, flat):
    return flat.unflatten(-1, (envoy._module.attn_hyper_connection.hc_count, -1))


def _flat(envoy, old, new):
    return new.flatten(-2)


#: Measured on both tiny checkpoints (Qwen4ExpForCausalLM, Qwen4ExpForConditionalGeneration); vLLM's classes are in
#: its vllm/models/qwen4_exp module.
QWEN4_EXP_REFUSAL = (
    "vLLM 0.32's Qwen4ExpForCausalLM reads config.output_gate_type, which transformers' Qwen4ExpTextConfig "
    'leaves None (the gate then takes hidden_act): vLLM stops with "AssertionError: unsupported '
    'output_gate_type=None"; attnlens has not checked its locations there; the transformers engine serves the '
    "family"
)


class Qwen4ExpText(Indexed, Qwen3Next):
    model_types = ("qwen4_exp_text",)
    tiny = Tiny("Qwen4ExpTextConfig", "Qwen4ExpForCausalLM", TINY)
    label = "Qwen4-Exp"
    final_norm = "model.hyper_connection_mixer"
    attention_norm = "attn_hyper_connection"
    mlp_norm = "mlp_hyper_connection"
    attention_streams, mlp_streams = "attn_hyper_connection", "mlp_hyper_connection"
    vllm = replace(Qwen3Next.vllm, model_types=(), tiny={}, refusal=QWEN4_EXP_REFUSAL)
    absent = {**Qwen3Next.absent, "mlp_norm_output": NORM_REASON}

    def locations(self):
        locations = super().locations()
        locations.pop("mlp_norm_output")
        locations["attention_norm_output"] = ModuleOutput(self.attention_streams, 0)
        for name, source in (
            ("layer_input", ModuleInput()),
            ("layer_mid", ModuleInput(self.mlp_streams)),
            ("layer_output", ModuleOutput()),
        ):
            locations[name] = Derived(source, _streams, _flat, label=name)
        return locations

    def moe_layer(self, config, layer):
        return True  # every layer's MLP is Qwen4ExpTextSparseMoeBlock

    def indexed(self, config, layer):
        return not self.is_mixer_layer(config, layer)

    def indexer_note(self, config, layer):
        text = self._text(config)
        return (
            f"sparse (QSA): each query sees only the keys self_attn.indexer chooses, the "
            f"{text.indexer_budget // text.indexer_compress_ratio} best-scored complete blocks of "
            f"{text.indexer_compress_ratio} visible keys (indexer_budget={text.indexer_budget}) and the trailing "
            f"incomplete block; a causal key it did not choose is masked (the dtype's minimum in the scores, "
            f"exactly 0 in the pattern). The family's score function applies the causal mask only, so it equals "
            f"these scores on the chosen keys, and everywhere while a query sees at most indexer_budget keys"
        )

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            """The causal mask; where transformers adds the indexer's mask to it (5.19), keys it masks hold -inf: the
            indexer never chooses a key the causal mask hides, so the dtype's minimum is added twice."""
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            if self.family.indexed(config, layer) and sums_masks():
                mask = mask.masked_fill(mask == torch.finfo(dtype).min, float("-inf"))
            return mask

    # --- the hyper-connection streams ---------------------------------------------------------------------------

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            """`stream` [batch, seq, hc_count, hidden] after `update` is injected into every stream by its weight."""
            hyper = getattr(
                block, self.family.attention_streams if sublayer == "attention" else self.family.mlp_streams
            )
            _, _, weights = hyper(stream.flatten(-2))
            return stream + update.unsqueeze(-2) * weights.unsqueeze(-1)

        def residual_read(self, owner, sublayer, stream):
            return stream.flatten(-2) if sublayer == "final" else stream

    # --- what is special --------------------------------------------------------------------------------------------

    kind_reasons = {"*": {"mlp_norm_output": NORM_REASON}}

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        text = self._text(config)
        count = text.hc_count
        ple = layer + 1 in (text.ple_layer_ids or [])
        entering = "entering the block" + (
            "; this is a PLE layer: the block first adds ple(layer_input, token "
            "ids), hashed n-gram features, to them, before attn_hyper_connection"
            if ple
            else ""
        )
        notes.update(
            {
                "layer_input": STREAMS.format(count, entering),
                "layer_mid": STREAMS.format(
                    count,
                    "after attention: "
                    + ("(layer_input + the PLE branch)" if ple else "layer_input")
                    + " + injection_weights * attention_output, one weight per stream and token "
                    "(attn_hyper_connection's); mlp_hyper_connection's input",
                ),
                "layer_output": STREAMS.format(
                    count, "leaving the block: layer_mid + injection_weights * mlp_output (mlp_hyper_connection's)"
                ),
                "attention_norm_output": (
                    f"attn_hyper_connection's collapse of the {count} streams: each RMS-normalised "
                    f"(hc_norm), weighted by learned sigmoid weights and averaged; no norm module "
                    f"reads the residual here"
                ),
                "mlp_input": "mlp_hyper_connection's collapse of the streams of layer_mid (as attention_norm_output)",
                "final_norm_output": "hyper_connection_mixer(last layer_output): the streams collapsed as in each "
                "block; "
                "there is no other final norm",
            }
        )
        if self.indexed(config, layer) and sums_masks():
            notes["attention_scores"] += (
                "; this transformers adds the indexer's mask to the causal mask, so a key "
                "the causal mask hides holds -inf (the dtype's minimum twice), a causal "
                "key the indexer skips the dtype's minimum"
            )
        if not self.is_mixer_layer(config, layer):
            notes["attention_queries"] += (
                "; the rotary embedding is mrope, whose sections all hold the token's position on text"
            )
        return notes


class Qwen4Exp(LanguageModelOf, Qwen4ExpText):
    model_types = ("qwen4_exp",)
    vllm = replace(Qwen4ExpText.vllm, refusal=QWEN4_EXP_REFUSAL)
    final_norm = "model.language_model.hyper_connection_mixer"
    tiny = Tiny(
        "Qwen4ExpConfig",
        "Qwen4ExpForConditionalGeneration",
        {
            "text_config": {"model_type": "qwen4_exp_text", **TINY_DEFAULTS, **TINY},
            "vision_config": {
                "depth": 1,
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_heads": 2,
                "out_hidden_size": 64,
            },
        },
    )

    def notes(self, config, layer, engine="transformers"):
        # Not LanguageModelOf's media note: Qwen4-Exp's language model builds its own causal mask, images included.
        text = config.get_text_config()
        notes = Qwen4ExpText.notes(self, text, layer, engine)
        notes["embeddings"] = (
            "the text embedding module's output; with images or video in the prompt, the language "
            "model's input is this with the placeholder tokens' rows replaced by the vision "
            "tower's features (layers[0].layer_input holds them, repeated per stream)"
        )
        if not self.is_mixer_layer(text, layer):
            notes["attention_queries"] += (
                " (with images or video, their tokens get 3D positions: time, height, "
                "width; the mask stays causal, so the family's score function still "
                "applies)"
            )
        return notes
