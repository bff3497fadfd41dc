"""The vision towers of vision-language models: ViT encoders over an image's patches, served as the vision stack
`model.vision.layers[i]` of the multimodal model that holds them (`parts.multimodal.Tower`).

SigLIP (Gemma 3, PaliGemma, Idefics 3, SmolVLM, ...) and CLIP (LLaVA) build one block: pre-norm `layer_norm1`, the
attention (`q_proj`, `k_proj`, `v_proj`, transformers' attention interface, `out_proj`), the residual add, pre-norm
`layer_norm2`, the MLP (`fc1`, `activation_fn`, `fc2`), the residual add. Every patch attends to every patch (no
mask: an image's patches are all real). The tower's paths are from its own model (`SiglipVisionModel`: the blocks at
`encoder.layers`), which the multimodal model holds as its tower; `embeddings` is the patch embedding
with its positions added (what the first block reads, one row per patch, row-major over the patch grid), and
`final_norm_output` the tower's `post_layernorm`.
"""

from __future__ import annotations

from ..errors import Miswired
from ..family import Family
from ..locations import INTERFACE_CALL, ModuleOutput, softmax_argument
from ..locations.cache import NAMES as CACHE_VALUES
from ..parts import scoring
from ..parts.sizes import Sizes
from ..parts.vllm import VLLMLayout

TOWER_HAS_NO_LOGITS = "a vision tower has no logits: its last block's output (after final_norm_output) is what the "
TOWER_HAS_NO_LOGITS += "projector hands the language model"


class SiglipTower(Family):
    """SigLIP's vision tower (`SiglipVisionModel`), as a stack of a multimodal model."""

    layers = "encoder.layers"
    embed_tokens = "embeddings"
    final_norm = "post_layernorm"
    attention_norm = "layer_norm1"
    mlp_norm = "layer_norm2"
    output_projection = "out_proj"
    activation = "activation_fn"
    down_projection = "fc2"
    sizes = Sizes(num_heads=("num_heads",), head_dim=("head_dim",), scale=("scale",))
    vllm = VLLMLayout(refusal="attnlens reads vision towers on the transformers engine only")
    ScoreFunction = scoring.Bidirectional

    def locations(self):
        found = {
            **super().locations(),
            "attention_scores": softmax_argument(INTERFACE_CALL),  # its eager function adds no mask: none is passed
            "layer_output": ModuleOutput(""),  # a block returns its hidden states
        }
        del found["logits"]
        return found

    kind_notes = {
        "*": {
            "embeddings": "the patch embedding with its learned positions added: one row per patch, row-major over "
            "the image's patch grid",
            "attention_probabilities": "bidirectional: every patch sees every patch of its image",
        }
    }
    kind_reasons = {
        "*": {
            "logits": TOWER_HAS_NO_LOGITS,
            **dict.fromkeys(CACHE_VALUES, "a vision tower caches nothing: it runs once over each image"),
        }
    }


class ClipTower(SiglipTower):
    """CLIP's vision tower (`CLIPVisionModel`, LLaVA's): SigLIP's block, a class embedding before the patches, a norm
    before the first block (`pre_layrnorm`), and a final norm (`post_layernorm`) over the class token's row alone.

    A vision-language model reads one block's output (LLaVA's `vision_feature_layer`, the second-to-last by default),
    not the tower's end: the blocks after it run, but nothing reads what they compute."""

    kind_notes = {
        "*": {
            "embeddings": "the class embedding then the patch embeddings, learned positions added, before "
            "pre_layrnorm: row 0 is the class token, then one row per patch, row-major over the patch grid; "
            "layers[0].layer_input is pre_layrnorm(embeddings)",
            "attention_probabilities": "bidirectional: every position (the class token and every patch) sees every "
            "position of its image",
            "layer_output": "a vision-language model reads one block's output, not the tower's end: LLaVA's "
            "projector reads hidden_states[vision_feature_layer] (its config's; -2 by default: the second-to-last "
            "block's layer_output; 0 would be layers[0].layer_input), the class token's row dropped under "
            "vision_feature_select_strategy 'default'; the blocks after it run, but nothing reads their outputs (an "
            "edit there changes nothing downstream)",
            "final_norm_output": "post_layernorm of the class token's row alone: one row per image (images x hidden, "
            "no sequence axis: CLIP's pooled output); a vision-language model's projector does not read it",
        }
    }
    kind_reasons = {
        "*": {
            "logits": "a vision tower has no logits: one block's output (LLaVA's vision_feature_layer) is what the "
            "projector hands the language model",
        }
    }

    def verify(self, model, layer, layer_module, attention_module):
        """A CLIP tower: its class embedding and `pre_layrnorm` are there (a SigLIP tower, some LLaVA checkpoints', has
        neither, and LLaVA's "default" strategy would drop a patch of it, not a class token)."""
        if not hasattr(model, "pre_layrnorm") or not hasattr(getattr(model, "embeddings", None), "class_embedding"):
            raise Miswired(
                f"family {self.name}: the tower is a {type(model).__name__}, no CLIP tower (no class embedding, no "
                f"pre_layrnorm); attnlens serves this model's tower as CLIP's only (a SigLIP-towered LLaVA is not "
                f"laid out: its feature strategy drops or keeps a patch, not a class token)"
            )
        super().verify(model, layer, layer_module, attention_module)
