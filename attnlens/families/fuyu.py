"""Fuyu: Persimmon's decoder behind a linear patch embedding for images.

`FuyuForCausalLM` runs the Persimmon language model (`model.language_model`); on token ids alone (no
`image_patches`) the patch embedding is skipped and the forward is Persimmon's, so every value is read as on
Persimmon. With image patches, their embeddings replace the image-placeholder tokens' embeddings before the first
block: `embeddings` stays the token embedding module's output, and `layers[0].layer_input` holds the patches'.
"""

from ..family import Tiny, VLLMLayout
from .persimmon import Persimmon


class Fuyu(Persimmon):
    model_types = ("fuyu",)
    vllm = VLLMLayout(
        refusal='vLLM 0.32 runs Fuyu only as a multimodal model (its own FuyuForCausalLM "was supported in vLLM '
        'until v0.25.0"; its Transformers backend takes it as TransformersMultiModalForCausalLM), which builds '
        "Fuyu's processor: the tiny checkpoint has none (\"Can't load image processor\") and a processor with the "
        "tiny tokenizer lacks Fuyu's special tokens (\"KeyError: '|SPEAKER|'\"), so it was not measured; the "
        "transformers engine serves the family",
    )
    tiny = Tiny(
        "FuyuConfig",
        "FuyuForCausalLM",
        {
            "text_config": {
                "model_type": "persimmon",
                "num_hidden_layers": 3,
                "hidden_size": 64,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 128,
                "max_position_embeddings": 128,
                "pad_token_id": 0,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "initializer_range": 0.2,
            },
            "num_key_value_heads": None,
        },
    )
    layers = "model.language_model.layers"
    embed_tokens = "model.language_model.embed_tokens"
    final_norm = "model.language_model.final_layernorm"

    kind_notes = {
        "*": {
            "embeddings": "the token embedding's output; with image_patches, the patches' embeddings replace "
            "the image tokens' before layers[0]",
        }
    }
