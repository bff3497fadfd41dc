"""T5Gemma: an encoder-decoder of Gemma 2's blocks (gemma2.py). Each block normalises before and after each sublayer
(`pre_self_attn_layernorm` / `post_self_attn_layernorm`, `pre_feedforward_layernorm` / `post_feedforward_layernorm`,
and in a decoder block `pre_cross_attn_layernorm` / `post_cross_attn_layernorm` around `cross_attn`), so a
sublayer's output is normalised before it joins the stream. The attention is Gemma 2's: rotary positions (each
stack's own `rotary_emb`; the queries and keys are read rotated), scores scaled by `query_pre_attn_scalar ** -0.5`,
soft-capped before the mask (`tanh(s / c) * c`, the cross-attention's too), and `layer_types` alternating sliding and
full layers. The encoder's sliding layers see keys on both sides, up to `sliding_window` positions away (|q - k| <=
sliding_window, transformers' bidirectional window); the decoder's see the last `sliding_window` keys. The sizes, the
window and the cap are each stack's (`config.encoder`, `config.decoder`); the logits are soft-capped too
(`config.decoder.final_logit_softcapping`).

The stacks' paths are from each stack's module (`model.encoder`, `model.decoder`); the logits are the head model's.
"""

from __future__ import annotations

import torch

from ..family import EncoderDecoder, Family, Note, Tiny
from ..locations import ModuleInput, ModuleOutput
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import NO_CACHE
from ..parts import identities, scoring
from .bart import DECODER_CACHE, interface_attention_locations, with_cross_attention
from .gemma2 import Gemma2

#: What both stacks' values are.
STACK_NOTES: dict[str, Note] = {
    "embeddings": "the token embedding's output; times sqrt(hidden_size) before layers[0]",
    "attention_queries": "rotated (rotary positions), unscaled: the scores scale by query_pre_attn_scalar ** -0.5",
}


class T5GemmaEncoder(Family):
    """T5Gemma's encoder: Gemma 2's blocks attending both ways (within the window on sliding layers)."""

    #: The stack's own config on the model's (`T5GemmaConfig.encoder`): its layer types, window and soft-cap.
    stack_config = "encoder"
    layers = "layers"
    embed_tokens = "embed_tokens"
    final_norm = "norm"
    attention_norm = "pre_self_attn_layernorm"
    attention_post_norm = "post_self_attn_layernorm"
    mlp_norm = Gemma2.mlp_norm
    mlp_post_norm = Gemma2.mlp_post_norm
    eager = Gemma2.eager

    def attention_locations(self, prefix: str = "") -> dict:
        """The values of `self_attn` (or, with `prefix="cross_"`, of `cross_attn`) in Gemma 2's eager function: the
        scores as the softmax receives them (soft-capped, then masked where a mask is given: an unpadded encoder's
        full layer and the cross-attention have none)."""
        return interface_attention_locations(self, prefix)

    def locations(self):
        found = super().locations()
        attention = self.attention_locations()
        ordered = {name: attention.get(name, location) for name, location in found.items()}
        ordered.pop("logits")
        return ordered

    class ScoreFunction(scoring.ScoreFunction):
        """Gemma 2's score function on the stack's own config; both ways in the encoder, within |q - k| <= window on
        its sliding layers."""

        def stack(self, config):
            return getattr(config, self.family.stack_config, config)

        def softcap(self, config, layer):
            return getattr(self.stack(config), "attn_logit_softcapping", None)

        def sliding_window(self, config, layer):
            """The keys back a query sees, itself included: the encoder's window reaches `sliding_window` keys each
            way, so one more back counting the query's own (and as many forward)."""
            window = super().sliding_window(self.stack(config), layer)
            return window if window is None or self.causal(config) else window + 1

        def causal(self, config):
            return False

        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            window = self.window(config, layer)
            if self.causal(config) or window is None:
                return super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            keys = torch.arange(num_keys, device=device)
            queries = keys[num_keys - num_queries :, None]
            visible = ((queries - keys[None, :]).abs() < window)[None, None]
            if key_mask is not None:
                visible = visible & key_mask[:, None, None, :].bool().to(visible.device)
            return torch.where(visible, torch.zeros((), dtype=dtype, device=visible.device), torch.finfo(dtype).min)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        score_function: scoring.ScoreFunction = self.score_function(engine)
        window = score_function.window(config, layer)
        notes["attention_probabilities"] = (
            "bidirectional: every query sees every key that is not padding"
            if window is None
            else f"sliding window both ways: each query sees the keys up to {window - 1} positions before or after it"
        )
        return notes

    kind_reasons = {"*": dict.fromkeys(CACHE_VALUES, NO_CACHE)}
    kind_notes = {"*": STACK_NOTES}


class T5GemmaDecoder(T5GemmaEncoder):
    """T5Gemma's decoder: Gemma 2's causal blocks with a cross-attention, normalised before and after, between the
    self-attention and the feed-forward."""

    stack_config = "decoder"
    cross_attention = "cross_attn"
    cross_attention_norm = "pre_cross_attn_layernorm"
    cross_attention_post_norm = "post_cross_attn_layernorm"

    def locations(self):
        return with_cross_attention(
            self,
            super().locations(),
            ModuleInput(self.cross_attention_norm),
            ModuleOutput(self.cross_attention_norm),
        )

    class ScoreFunction(scoring.Causal):
        def cross_scores(self, heads, config, queries, keys, layer, key_mask=None):
            """The cross-attention's scores soft-capped as its eager function caps them, before the source's mask."""
            scores = self.products(queries, keys).mul_(heads.scale)
            cap = self.softcap(config, layer)
            if cap is not None:
                scores = torch.tanh(scores / cap) * cap
            if key_mask is not None:
                scores = scores.masked_fill(~key_mask[:, None, None, :].bool(), torch.finfo(scores.dtype).min)
            return scores

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            if sublayer == "cross_attention":  # its post-norm: the checks name no norm after the cross-attention
                return stream + getattr(block, self.family.cross_attention_post_norm)(update)
            return stream + update

    def notes(self, config, layer, engine="transformers"):
        notes = Family.notes(self, config, layer, engine)  # the causal window's note, on a sliding layer
        notes.setdefault("attention_probabilities", "causal: each decoder position sees the positions up to its own")
        return notes

    kind_reasons = {"*": DECODER_CACHE}
    kind_notes = {
        "*": {
            **STACK_NOTES,
            "cross_attention_input": "layer_input + post_self_attn_layernorm(attention_output)",
            "cross_attention_scores": "queries @ keys^T * query_pre_attn_scalar ** -0.5, soft-capped as the "
            "self-attention's (tanh(s / c) * c), then the source's padding mask",
            "cross_attention_queries": "not rotated: the cross-attention has no positions",
            "layer_mid": "cross_attention_input + post_cross_attn_layernorm(cross_attention_output), what "
            "pre_feedforward_layernorm receives",
            "logits": "soft-capped: tanh(lm_head(final_norm_output) / c) * c, c = "
            "config.decoder.final_logit_softcapping",
        }
    }


#: A tiny Gemma 2-shaped stack: two blocks (the second slides: 3 keys each way in the encoder, the last 3 in the
#: decoder; the source and target are longer), four query heads on two key/value heads.
TINY_STACK = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    sliding_window=3,
    layer_types=["full_attention", "sliding_attention"],
    attn_logit_softcapping=2.0,
    final_logit_softcapping=30.0,
    query_pre_attn_scalar=16,
    max_position_embeddings=128,
    initializer_range=0.2,
)


class T5Gemma(EncoderDecoder):
    """T5Gemma: Gemma 2's blocks as an encoder (both ways) and a decoder with cross-attention."""

    model_types = ("t5gemma",)
    encoder = T5GemmaEncoder
    decoder = T5GemmaDecoder
    tiny = Tiny(
        "T5GemmaConfig",
        "T5GemmaForConditionalGeneration",
        dict(
            encoder=TINY_STACK,
            decoder=TINY_STACK,
            vocab_size=128,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
    )
