"""DistilBERT: BERT's post-norm block under names of its own, an encoder only (transformers has no causal LM for it).

Each `TransformerBlock` (`distilbert.transformer.layer`, renamed `layers`) runs `attention` (a
`DistilBertSelfAttention`, renamed `self_attn`: `q_lin`, `k_lin`, `v_lin`, the shared attention interface with the
eager function BERT's is copied from, then `out_lin`), `sa_layer_norm(attention_output + layer_input)`, then `ffn`
(renamed `mlp`: `lin1`, `activation`, `lin2`, dropout) and `output_layer_norm(mlp_output + sa_layer_norm's output)`.
Unlike BERT, the attention module holds no norm and no residual add: its output is `out_lin`'s, and both norms are the
block's own. There is no final norm; the masked-LM head (`vocab_transform`, activation, `vocab_layer_norm`,
`vocab_projector`) reads the last block's output. Positions are learned (or sinusoidal, `sinusoidal_pos_embds`)
embeddings added before the blocks; there are no token types.
"""

from __future__ import annotations

from ..family import Family, Tiny
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import identities, scoring
from ..parts.sizes import Sizes
from ..parts.vllm import encoder_on_vllm
from .bert import POST_NORM, post_norm_locations


class DistilBert(Family):
    model_types = ("distilbert",)
    vllm = encoder_on_vllm("DistilBERT")
    tiny = Tiny("DistilBertConfig", "DistilBertForMaskedLM", {"hidden_dim": 128})
    layers = "distilbert.transformer.layer"
    embed_tokens = "distilbert.embeddings.word_embeddings"
    final_norm = None
    attention = "attention"
    attention_norm = None
    mlp_norm = "sa_layer_norm"
    mlp = "ffn"
    output_projection = "out_lin"
    activation = "activation"
    down_projection = "lin2"
    padding_changes_values = "positions count from the padded start: DistilBERT's position ids take no mask"
    sizes = Sizes(num_heads=("n_heads",), head_dim=("attention_head_size",), scale=("scaling",))

    def locations(self):
        return post_norm_locations(super().locations())

    ScoreFunction = scoring.Bidirectional

    class Identities(identities.Identities):
        def residual_add(self, block, sublayer, stream, update, **arguments):
            """Post-norm: the attention's update joins the block input before `sa_layer_norm` (`layer_mid`); the
            MLP's joins `sa_layer_norm`'s output, and `output_layer_norm` follows."""
            if sublayer == "attention":
                return stream + update
            return block.output_layer_norm(block.sa_layer_norm(stream) + update)

    kind_reasons = {
        "*": {
            "attention_norm_output": POST_NORM.format(what="the attention reads the block input itself").replace(
                "BERT", "DistilBERT"
            ),
            "final_norm_output": "DistilBERT has no final norm: its head reads the last block's output, which ends in "
            "that block's own output_layer_norm",
            **dict.fromkeys(
                CACHE_VALUES,
                "DistilBERT is an encoder only (transformers has no causal LM for it): it keeps no KV cache",
            ),
        }
    }

    kind_notes = {
        "*": {
            "attention_queries": "no rotary embedding: positions were added to the embeddings",
            "attention_probabilities": "bidirectional: every query sees every key that is not padding",
            "attention_output": "out_lin's output (the attention module holds no norm and no residual add)",
            "layer_mid": "layer_input + attention_output, what sa_layer_norm receives (post-norm)",
            "mlp_norm_output": "sa_layer_norm(layer_mid): the MLP's input and the stream its output joins",
            "mlp_output": "ffn's output: lin2's, then dropout (the identity in eval)",
            "layer_output": "output_layer_norm(mlp_norm_output + mlp_output): post-norm",
            "layer_input": lambda family, config, layer: (
                "LayerNorm(word + position embeddings): the embeddings module's output" if layer == 0 else None
            ),
        }
    }
