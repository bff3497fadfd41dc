"""Encoders built from Llama's modules with a bidirectional mask: EuroBERT, UltraBERT and ESM C.

Each block is Llama's pre-norm block (`input_layernorm`, `self_attn` calling the shared attention interface with
rotated queries and keys, `post_attention_layernorm`, a gated MLP `down_proj(act_fn(gate_proj(x)) * up_proj(x))`), a
final norm `<base>.norm`, and no causal mask: the model builds transformers' bidirectional mask (`None` on an unpadded
batch, the padded keys masked otherwise) and, on UltraBERT's local layers, a band of keys on both sides of each query
(`modernbert.BidirectionalWindow`). `LlamaEncoder` is that layout; the types differ in what they add:

- EuroBERT: nothing (grouped heads, one rotary theta); the logits are `lm_head(final_norm_output)`.
- UltraBERT: ModernBERT's alternation of local and global layers (`config.layer_types`, a band of
  `config.sliding_window` keys each side), each kind with its rotary theta; the logits are a two-layer prediction
  head's output.
- ESM C: the queries and keys pass a LayerNorm over the whole projection (`q_norm`, `k_norm`) before the heads split,
  each residual branch is divided by `sqrt(num_hidden_layers / 36)` before it joins the stream, and the logits are
  the masked-LM head's (dense, GELU, LayerNorm, decoder).
"""

from __future__ import annotations

from ..family import Family, Tiny
from ..locations import INTERFACE_CALL, softmax_argument
from ..parts import identities
from ..parts.vllm import encoder_on_vllm
from .modernbert import BidirectionalWindow, band_note, rotary_note


class LlamaEncoder(Family):
    """Llama's pre-norm block on a bidirectional encoder: the common layout's paths, a bidirectional score function
    (with a band on the layers `config.layer_types` calls local, where it names any), the scores read where the
    softmax receives them."""

    def locations(self):
        return {
            **super().locations(),
            "attention_scores": softmax_argument(INTERFACE_CALL),
        }

    class ScoreFunction(BidirectionalWindow):
        def half_window(self, config, layer):
            if getattr(config, "layer_types", None) is None:
                return None
            return super().half_window(config, layer)

    kind_notes = {
        "*": {
            "attention_queries": rotary_note,
            "attention_keys": rotary_note,
            "attention_probabilities": band_note,
            "final_norm_output": "what the masked-LM head reads",
        }
    }


class EuroBert(LlamaEncoder):
    """EuroBERT: the layout with nothing added."""

    model_types = ("eurobert",)
    vllm = encoder_on_vllm("EuroBERT")
    tiny = Tiny(
        "EuroBertConfig",
        "EuroBertForMaskedLM",
        {"num_key_value_heads": 2, "bos_token_id": 1, "eos_token_id": 2, "mask_token_id": 3},
    )
    kind_notes = {"*": {"logits": "lm_head(final_norm_output)"}}


class Ultrabert(LlamaEncoder):
    """UltraBERT: Llama's block with ModernBERT's local and global layers, each kind with its own rotary theta."""

    model_types = ("ultrabert",)
    vllm = encoder_on_vllm("UltraBERT")
    tiny = Tiny(
        "UltrabertConfig",
        "UltrabertForMaskedLM",
        # three layers: local, local, global (every third layer global); a band of 2 keys each side
        {"num_hidden_layers": 3, "num_key_value_heads": 2, "sliding_window": 2, "prediction_head_size": 32},
    )
    kind_notes = {
        "*": {
            "logits": "decoder(act(linear2(act(linear1(final_norm_output))))), head's two-layer prediction head "
            "(act: tanh-approximated GELU)",
        }
    }


class Esmc(LlamaEncoder):
    """ESM C: Llama's block with LayerNorms on the whole query and key projections and residual branches scaled by
    `1 / sqrt(num_hidden_layers / 36)`."""

    model_types = ("esmc",)
    vllm = encoder_on_vllm("ESM C")
    tiny = Tiny("EsmcConfig", "EsmcForMaskedLM", {"num_key_value_heads": None, "bos_token_id": 1, "mask_token_id": 3})
    layers = "esmc.layers"
    embed_tokens = "esmc.embed_tokens"
    final_norm = "esmc.norm"

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Each branch divided by the block's `scaling_factor`, sqrt(num_hidden_layers / 36), before the add."""
            return stream + update / block.scaling_factor

    kind_notes = {
        "*": {
            "attention_queries": "q_norm(q_proj(x)), a LayerNorm over all heads at once, split into heads and rotated "
            "(theta {config.rope_parameters[rope_theta]:g})",
            "attention_keys": "k_norm(k_proj(x)), a LayerNorm over all heads at once, split into heads and rotated "
            "(theta {config.rope_parameters[rope_theta]:g})",
            "layer_mid": "layer_input + attention_output / sqrt(num_hidden_layers / 36): ESM C scales each residual "
            "branch",
            "layer_output": "layer_mid + mlp_output / sqrt(num_hidden_layers / 36)",
            "logits": "lm_head.decoder(layer_norm(gelu(dense(final_norm_output)))): the masked-LM head",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding (a sequence_id "
            "argument masks across chains instead, where it is given)",
        }
    }
