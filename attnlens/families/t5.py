"""T5 and the encoder-decoders built as it is (mT5, UMT5): pre-norm blocks of sublayers in a list (`layer`: the
self-attention, in a decoder block the cross-attention, then the feed-forward), RMS norms without a mean or bias, no
scaling of the scores, and a bucketed relative position bias added to them.

Each sublayer is a module of its own holding its norm (`layer.0.layer_norm`, `layer.0.SelfAttention`); the block is
`T5Block` (renamed `layers`), its attention `T5Attention` (`q`, `k`, `v`, `o`), which calls the shared attention
interface with T5's eager function: `q @ k^T` (scaling 1.0: T5 folds the scale into its initialisation) plus
`position_bias` plus the mask. The position bias (`attention_position_bias`, a value of its own, editable) is computed
from the buckets of each query-key distance by the first block's attention (`relative_attention_bias`, an embedding
of buckets by heads; bidirectional buckets in the encoder, causal in the decoder) and handed on to the other blocks of
the stack; UMT5 computes one in every block. The cross-attention's bias is zeros.
"""

from __future__ import annotations

from ..family import EncoderDecoder, Family, MLPArithmetic, Tiny
from ..locations import INTERFACE_CALL, ModuleInput, ModuleOutput, Operation, OutputField, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..locations.cache import NO_CACHE
from ..parts import identities, scoring
from ..parts.eager import EagerFunction
from ..parts.sizes import Sizes, same_as
from .bart import CROSS_NOTES, DECODER_CACHE

BIAS = "T5's bucketed relative position bias (attention_position_bias)"


class T5Encoder(Family):
    """T5's encoder: bidirectional self-attention with a relative position bias, then the feed-forward."""

    layers = "block"
    embed_tokens = "embed_tokens"
    final_norm = "final_layer_norm"
    attention = "layer.0.SelfAttention"
    attention_norm = "layer.0.layer_norm"
    mlp = "layer.1.DenseReluDense"
    mlp_norm = "layer.1.layer_norm"
    output_projection = "o"
    activation = "act"
    down_projection = "wo"
    eager = EagerFunction(probabilities=("attn_weights_4", "dropout("))
    sizes = Sizes(num_heads=("n_heads",), num_kv_heads=(same_as("num_heads"),), head_dim=("key_value_proj_dim",))

    def attention_locations(self, prefix: str = "") -> dict:
        """The values of `self_attn` (or, with `prefix="cross_"`, of `cross_attn`): the interface call's arguments
        and result, the position bias it is given, the softmax's argument, the pattern after dropout."""
        probabilities, anchor = self.eager.probabilities
        found = {
            f"{prefix}attention_queries": Operation((INTERFACE_CALL,), "arg", 1),
            f"{prefix}attention_keys": Operation((INTERFACE_CALL,), "arg", 2),
            f"{prefix}attention_values": Operation((INTERFACE_CALL,), "arg", 3),
            f"{prefix}attention_position_bias": Operation((INTERFACE_CALL,), "kwarg", "position_bias"),
            f"{prefix}attention_scores": softmax_argument(INTERFACE_CALL),
            f"{prefix}attention_probabilities": Operation((INTERFACE_CALL, probabilities), anchor=anchor),
            f"{prefix}attention_head_outputs": Operation((INTERFACE_CALL,), "output", 0),
            f"{prefix}attention_premix": ModuleInput(self.output_projection),
            f"{prefix}attention_output": ModuleOutput("", 0),
        }
        if prefix:  # the cross-attention's bias is zeros: not a value of the vocabulary
            found.pop(f"{prefix}attention_position_bias")
        return found

    def locations(self):
        feed_forward = self.mlp.rpartition(".")[0]
        return {
            "embeddings": ModuleOutput(self.embed_tokens),
            "layer_input": ModuleInput(),
            "attention_norm_output": ModuleOutput(self.attention_norm),
            **self.attention_locations(),
            **self.cross_attention_locations(),
            "layer_mid": ModuleInput(feed_forward),
            "mlp_norm_output": ModuleOutput(self.mlp_norm),
            "mlp_input": ModuleInput(self.mlp),
            "mlp_activation": ModuleOutput(self.activation),
            "mlp_neurons": ModuleInput(self.down_projection),
            "mlp_output": ModuleOutput(),
            "layer_output": ModuleOutput("", 0),
            "final_norm_output": ModuleOutput(self.final_norm),
        }

    def cross_attention_locations(self) -> dict:
        return {}

    class ScoreFunction(scoring.Bidirectional):
        def score_bias(self, config, layer):
            return BIAS

    class Identities(identities.Identities):
        def score_bias_value(self, module, values, layer):
            return values["attention_position_bias"]

        def position_bias(self, module, num_queries, num_keys):
            if not getattr(module, "has_relative_attention_bias", False):
                return None  # handed on from the first block
            return module.compute_bias(num_queries, num_keys)

        def mlp_arithmetic(self, mlp):
            down = mlp.wo
            if hasattr(mlp, "wi_0"):  # gated (mT5, T5 v1.1): act(wi_0(x)) * wi_1(x)
                return MLPArithmetic(
                    down, lambda x: mlp.wi_0(x), lambda z: mlp.act(z), lambda x, activation: activation * mlp.wi_1(x)
                )
            return MLPArithmetic(
                down,
                lambda x: mlp.wi(x),
                lambda z: mlp.act(z),
                lambda x, activation: activation,
                says=("wi(mlp input)", "activation", "wo(neurons)"),
            )

    kind_reasons = {"*": dict.fromkeys(CACHE_VALUES, NO_CACHE)}
    kind_notes = {
        "*": {
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_position_bias": "[1, num_heads, query, key]: one for the whole batch, from the buckets of "
            "each query-key distance (bidirectional); computed by the first block, handed on to the others",
            "attention_scores": "queries @ keys^T (T5 does not scale them) + attention_position_bias + the mask",
            "attention_queries": "unscaled: T5 folds 1/sqrt(head_dim) into its initialisation",
            "layer_mid": "layer_input + attention_output, what the feed-forward sublayer (layer[-1]) receives",
            "mlp_norm_output": "the feed-forward's RMS norm (no mean, no bias) of layer_mid",
        }
    }


class T5Decoder(T5Encoder):
    """T5's decoder: causal self-attention with a relative position bias, cross-attention, the feed-forward."""

    cross_attention = "layer.1.EncDecAttention"
    cross_attention_norm = "layer.1.layer_norm"
    mlp = "layer.2.DenseReluDense"
    mlp_norm = "layer.2.layer_norm"

    def cross_attention_locations(self):
        return {
            "cross_attention_input": ModuleInput("layer.1"),
            "cross_attention_norm_output": ModuleOutput(self.cross_attention_norm),
            **self.attention_locations("cross_"),
        }

    def locations(self):
        return {**super().locations(), "logits": OutputField("logits")}  # read on the model: the head's output

    ScoreFunction = scoring.Causal

    kind_reasons = {
        "*": {
            **DECODER_CACHE,
            "attention_cache_visible": "T5's attention takes its mask folded into position_bias, not as the "
            "attention_mask keyword through which attnlens masks a removed position; edit the cached keys and values",
        }
    }
    kind_notes = {
        "*": {
            "attention_probabilities": "causal: each decoder position sees the positions up to its own",
            "attention_position_bias": "[1, num_heads, query, key]: one for the whole batch, from the buckets of "
            "each query-key distance (causal: only keys before the query); computed by the first block, handed on",
            "cross_attention_input": "layer_input + attention_output, what the cross-attention sublayer (layer[1]) "
            "receives",
            "cross_attention_scores": "queries @ keys^T (unscaled) + the mask; the cross-attention's bias is zeros",
            "layer_mid": "cross_attention_input + cross_attention_output, what the feed-forward sublayer receives",
            **CROSS_NOTES,
        }
    }


class T5(EncoderDecoder):
    """T5, and mT5 (gated feed-forward), UMT5 (a position bias learned in every block)."""

    model_types = ("t5", "mt5", "umt5")
    encoder = T5Encoder
    decoder = T5Decoder
    stacks = {"encoder": "encoder", "decoder": "decoder"}
    tiny = Tiny(
        "T5Config",
        "T5ForConditionalGeneration",
        dict(
            d_model=64,
            d_kv=16,
            d_ff=128,
            num_layers=2,
            num_decoder_layers=2,
            num_heads=4,
            vocab_size=128,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            pad_token_id=0,
            eos_token_id=2,
            decoder_start_token_id=2,
        ),
    )
