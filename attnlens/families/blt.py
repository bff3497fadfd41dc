"""BLT (Byte Latent Transformer): bytes -> patches -> a global transformer over patches -> bytes.

On token ids (bytes) alone BLT runs four stacks: the patcher (a small byte LM whose entropies place patch boundaries,
`model.patcher`), the local encoder (`model.local_encoder.layers`, bytes, then cross-attention pooling bytes into
patches), the global transformer (`model.global_transformer.layers`, over patches: its sequence axis is patches, not
tokens) and the local decoder (`model.local_decoder.layers`, bytes, a cross-attention from the patches added to the
stream in front of its first block, or every block with `cross_attn_all_layers`). attnlens's values are per token,
so `layers` are the local decoder's blocks: the byte-level blocks that end in the LM head (`local_decoder.norm`, then
`lm_head`). They are the common layout (`BltTransformerLayer`; the rotary embedding rotates interleaved pairs), with
the local sliding window `local_attention_window_len` (transformers 5.24; 5.19 masks them causally). The patcher's,
the encoder's and the global transformer's blocks and the cross-attentions are not served: read them with nnsight.
"""

from __future__ import annotations

from ..family import Family, Tiny, VLLMLayout
from ..locations import ModuleOutput
from ..locations.views import snapshot
from ..parts import scoring
from ..parts.sizes import Sizes
from ..parts.vllm import backend_refuses

STREAM = (
    "the local decoder's blocks (bytes); layer 0's input is the local encoder's output plus the cross-attention "
    "from the global transformer's patches. The patcher's, the local encoder's and the global transformer's "
    "blocks (the last over patches, not tokens) are not served"
)


class Blt(Family):
    model_types = ("blt",)
    vllm = VLLMLayout(
        refusal=backend_refuses(
            "BLT",
            "Layer 0 dispatches attention from more than one module (model.local_encoder.layers.0.self_attn and "
            "model.local_encoder.cross_attn_layers.0), which one vLLM attention layer cannot serve.",
        )
    )
    tiny = Tiny(
        "BltConfig",
        "BltForCausalLM",
        {
            "use_cache": False,
            "encoder_hash_byte_group_vocab": 128,
            "local_attention_window_len": 6,
            **{
                part: {
                    "hidden_size": 64,
                    "num_attention_heads": 4,
                    "num_key_value_heads": 2,
                    "intermediate_size": 128,
                    "num_hidden_layers": layers,
                    "vocab_size": 128,
                    **({"hidden_size_global": 64, "cross_attn_all_layers": False} if local else {}),
                }
                for part, layers, local in (
                    ("patcher_config", 1, False),
                    ("encoder_config", 1, True),
                    ("decoder_config", 3, True),
                    ("global_config", 2, False),
                )
            },
        },
    )
    # The tiny decoder has its one cross-attention in front of the first block: BLT's own layout has one in front of
    # every block, where a block's input is not the previous block's output, which the shared identities assume
    # (tests/families/test_blt.py checks that layout).
    padding_changes_values = (
        "positions count from the padded start (BLT's rotary positions take no mask), and the "
        "patcher's entropies and the patches run over the padding"
    )
    layers = "model.local_decoder.layers"
    embed_tokens = "model.local_encoder.embed_tokens"
    final_norm = "model.local_decoder.norm"
    sizes = Sizes(num_heads=("num_heads",), num_kv_heads=("num_key_value_heads",))

    def locations(self):
        return {
            **super().locations(),
            "embeddings": snapshot(
                ModuleOutput(self.embed_tokens),
                "compute_hash_embeddings adds the hashed n-gram embeddings into "
                "embed_tokens' output in place, so attnlens hands out a copy taken before those adds",
            ),
        }

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            # transformers 5.24 masks the local blocks with encoder_config.sliding_window (local_attention_window_len);
            # earlier versions have neither and mask causally
            return getattr(config.encoder_config, "sliding_window", None)

    def notes(self, config, layer, engine="transformers"):
        stream = STREAM
        if config.decoder_config.cross_attn_all_layers and layer > 0:
            stream = (
                f"{STREAM}. With cross_attn_all_layers a cross-attention from the patches "
                f"(local_decoder.cross_attn_layers[{layer}]) is added in front of every block: this is "
                f"layers[{layer - 1}].layer_output plus it"
            )
        elif layer > 0:
            stream = f"{STREAM}. Here layers[{layer - 1}].layer_output"
        return {
            **super().notes(config, layer, engine),
            "layer_input": stream,
            "embeddings": "local_encoder.embed_tokens' output, a copy taken before compute_hash_embeddings adds "
            "the hashed n-gram embeddings into it in place (the local encoder reads that sum)",
        }
