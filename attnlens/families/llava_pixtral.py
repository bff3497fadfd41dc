"""LLaVA with a Pixtral tower ("llava" checkpoints whose `vision_config` is "pixtral": Pixtral-12B as transformers
converts it, `LlavaForConditionalGeneration`): Pixtral's tower (`PixtralTower`: every image at its own size, one
sequence of their patches, a 2-D rotary, a block-diagonal mask over images), LLaVA's two-layer projector on each
patch (no merge), a Mistral (Llama-layout) language model.

The model type is LLaVA's, whose registered family (`Llava`) serves the CLIP-towered checkpoints and refuses this
one at load by name; serve it with `family=attnlens.families.llava_pixtral.PixtralLlava`.

How a prompt holds an image: the Pixtral processor's layout (`PixtralImages`, merge 1): each image's patch grid
(`image_sizes` over `patch_size`) row by row, [IMG_BREAK] after each row but the last, [IMG_END] after the last. The
features are the tower's hidden states at `vision_feature_layer` (-1 in Pixtral-12B: the last block's output) under
the "full" strategy: every patch is a token (the "default" strategy would drop the first patch of the one sequence, a
patch and not a class token, and transformers' split by image would not add up). The image tokens attend causally.
"""

from __future__ import annotations

from ..errors import Miswired
from ..parts.multimodal import Tower
from ..parts.vllm import VLLMLayout
from .llava import Llava
from .vision_pixtral import PixtralImages, PixtralTower


class PixtralLlava(Llava):
    """LLaVA with Pixtral's tower as `model.vision`; `model.positions` places each image token on its image's patch
    grid, [IMG_BREAK] and [IMG_END] special. Not registered: "llava" is `Llava`'s; pass it as `family=`."""

    model_types = ()
    towers = {"vision": Tower("model.vision_tower", PixtralTower)}
    images = PixtralImages()
    vllm = VLLMLayout(refusal="attnlens has not compared LLaVA with a Pixtral tower on vLLM with transformers")

    def verify(self, model, layer, layer_module, attention_module):
        """The tower is Pixtral's, and every patch is a feature (the "full" strategy)."""
        config = model.config
        if config.vision_config.model_type != "pixtral":
            raise Miswired(
                f"family {self.name}: this LLaVA's tower is {config.vision_config.model_type!r}, not Pixtral's: "
                f"serve it with its registered family (attnlens.families.llava.Llava)"
            )
        if config.vision_feature_select_strategy != "full":
            raise Miswired(
                f"family {self.name}: vision_feature_select_strategy is {config.vision_feature_select_strategy!r}: "
                f"with Pixtral's tower it drops the first patch of the images' one sequence (no class token), which "
                f"attnlens does not lay out; Pixtral-12B's is 'full'"
            )
        super().verify(model, layer, layer_module, attention_module)
