"""TrOCR's text decoder, on text alone: XGLM's folded-head attention (pre-scaled queries, no clamp) in a post-norm
block, learned or sinusoidal positions, no final norm.

Each block normalises after each residual add: `n = self_attn_layer_norm(x + attn(x))`, then `layer_output =
final_layer_norm(n + mlp(n))`, so attention reads the block input itself (no `attention_norm_output`), `layer_mid` is
`x + attention_output` (what `self_attn_layer_norm` receives), `mlp_norm_output` its output (the MLP's input and the
stream its output is added to), and there is no final norm. Inside `VisionEncoderDecoderModel`, with
`encoder_hidden_states`, a cross-attention sublayer (`encoder_attn`, with its own post-norm) runs between attention and
the MLP; attnlens does not read it, and there the MLP's input is `encoder_attn_layer_norm`'s output.
"""

import torch

from ..family import Family, Tiny, VLLMLayout
from ..parts import identities, scoring
from ..parts.vllm import own_attention
from .xglm import XGLM, folded


class TrOCR(XGLM):
    model_types = ("trocr",)
    vllm = VLLMLayout(refusal=own_attention("TrOCR", "TrOCRForCausalLM", "TrOCRAttention"))
    tiny = Tiny(
        "TrOCRConfig",
        "TrOCRForCausalLM",
        {
            "decoder_layers": 3,
            "d_model": 64,
            "decoder_attention_heads": 4,
            "decoder_ffn_dim": 128,
            "cross_attention_hidden_size": 64,
            "num_hidden_layers": None,
            "hidden_size": None,
            "num_attention_heads": None,
            "num_key_value_heads": None,
            "intermediate_size": None,
            "max_position_embeddings": 128,
        },
        layouts={"learned_positions": {"use_learned_position_embeddings": True, "layernorm_embedding": True}},
    )
    padding_changes_values = "positions count from the padded start: TrOCR's position embeddings take no mask"
    layers = "model.decoder.layers"
    embed_tokens = "model.decoder.embed_tokens"
    final_norm = None
    attention_norm = None
    mlp_norm = "self_attn_layer_norm"
    absent = {
        **Family.absent,
        "attention_norm_output": "a post-norm block: attention reads the block input itself (layer_input); "
        "self_attn_layer_norm normalises layer_input + attention_output after it",
        "final_norm_output": "no final norm: each block ends in its own final_layer_norm, so the last layer_output "
        "is what the output projection reads",
    }

    def locations(self):
        locations = super().locations()
        del locations["attention_norm_output"], locations["final_norm_output"]
        return {
            **locations,
            "attention_scores": folded("attn_weights_2", "attn_weights.view(bsz * self.num_heads", "scores"),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            scores = torch.matmul(queries, keys.transpose(-1, -2))
            return scores + self.mask(
                queries.shape[2], keys.shape[2], config, layer, key_mask, scores.dtype, scores.device
            )

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update):
            if sublayer == "attention":
                return stream + update
            return block.final_layer_norm(block.self_attn_layer_norm(stream) + update)  # post-norm

    kind_notes = {
        "*": {
            "attention_scores": "queries @ keys^T + mask (the queries carry the scale)",
            "layer_mid": "layer_input + attention_output, what self_attn_layer_norm receives (post-norm)",
            "mlp_norm_output": "self_attn_layer_norm(layer_mid): the MLP's input and the stream its output joins",
            "layer_output": "final_layer_norm(mlp_norm_output + mlp_output): post-norm",
        }
    }
