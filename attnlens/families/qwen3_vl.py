"""Qwen3-VL and Qwen3-VL-MoE (`Qwen3VLForConditionalGeneration`, `Qwen3VLMoeForConditionalGeneration`): Qwen3's
language model (Qwen3-MoE's for the MoE) under `model.language_model`, rotated by interleaved M-RoPE, beside Qwen3-VL's
ViT under `model.visual` (`model.vision`, `vision_qwen3_vl.Qwen3VLVisionTower`), with deepstack.

The language model (`Qwen3VLTextModel` on a "qwen3_vl_text" config) is Qwen3's: per-head RMSNorm on queries and keys
before the rotary embedding, the causal mask. transformers has no causal LM of the text model alone
(`AutoModelForCausalLM` maps neither type): the composite is served, on text prompts and with images.

Images are laid out as Qwen2-VL's and Qwen3.5's (`qwen3_5.Qwen3_5Images`, the tiny processor Qwen3-VL's own), and the
queries and keys are rotated by interleaved M-RoPE: each token's (temporal, row, column) ids
(`model.model.get_rope_index`, from `mm_token_type_ids` and `image_grid_thw`) rotate the rotary frequencies in turn
(frequency `f` by the row id where `f % 3 == 1`, the column id where `f % 3 == 2`, within `mrope_section`'s counts, the
temporal id otherwise). The queries and keys read are after the rotation, so the score function (scaled products,
causal mask) holds on image prompts.

Deepstack: the tower's deepstack mergers project the outputs of its blocks in `deepstack_visual_indexes`; the text
model adds merger `k`'s output to the image tokens' rows of the residual stream after its block `k`, in its own loop
(`Qwen3VLTextModel._deepstack_process`, outside any module). So on an image prompt `layers[k].layer_output` is the
block's output before the addition and `layers[k + 1].layer_input` the stream after it: they differ on the image rows
by the merger's output (`added_between_blocks`: handed to the language model as `deepstack_visual_embeds`, the rows
as `visual_pos_masks`; `attnlens.checks` checks the two with it). The addition is no value of attnlens's vocabulary:
read it as the merger's output (`model.model.visual.deepstack_merger_list[k].output`) or as the language model's
argument (`model.model.language_model.inputs[1]["deepstack_visual_embeds"][k]`). On text prompts nothing is added.

vLLM is not served: attnlens has not compared vLLM's Qwen3-VL classes (whose language model adds deepstack features in
its own loop) with transformers.
"""

from __future__ import annotations

from dataclasses import replace

from ..family import TINY_DEFAULTS, Tiny, VLLMLayout
from ..parts.moe import moe_absent
from ..parts.multimodal import AddedBetweenBlocks, LanguageModelOf, Tower, released_vllm
from .qwen2_vl import POSITIONS_NOTE, TOKENS
from .qwen3 import Qwen3
from .qwen3_5 import Qwen3_5Images
from .qwen3_moe import Qwen3Moe
from .vision_qwen3_vl import Qwen3VLVisionTower

#: A two-block tower projecting to the tiny text width, both blocks feeding a deepstack merger (added after language
#: layers 0 and 1; layer 2 gets none): patches of 16 pixels (two frames each), merged 2 x 2, learned positions on a
#: 48 x 48 grid resampled to each image's (the config's defaults but for the sizes).
VISION = {
    "depth": 2,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "out_hidden_size": 64,
    "deepstack_visual_indexes": [0, 1],
}
#: The tiny text config: the image tokens past the character tokenizer's 128 ids, 16-wide heads whose 8 rotary
#: frequencies take M-RoPE's sections [2, 3, 3] interleaved: frequencies 1, 4, 7 the row, 2, 5 the column (8 would be
#: past the head), 0, 3, 6 the temporal id (as released: 64 frequencies in sections 24, 20, 20).
TEXT = {
    **TINY_DEFAULTS,
    "vocab_size": 132,
    "head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
}
#: The tiny vLLM text config's M-RoPE (32-wide heads: 16 frequencies, interleaved in sections 4, 6, 6). vLLM
#: interleaves the sections only where the config says `mrope_interleaved` (released configs do; transformers'
#: Qwen3-VL always interleaves): without it vLLM's queries on a 2 x 2 image were 0.96 from transformers'.
VLLM_ROPE = {**TEXT["rope_parameters"], "mrope_section": [4, 6, 6], "mrope_interleaved": True}
VLLM_REFUSAL = (
    "attnlens has not compared vLLM's Qwen3-VL MoE class (whose language model adds the deepstack features in its own "
    "loop) with transformers, so it serves none of it there yet (Qwen3-VL's dense class is compared); the "
    "transformers engine serves it"
)
DEEPSTACK_NOTE = (
    "the block's output; after it, on an image prompt, the model adds deepstack merger {layer}'s output (the tower's "
    "block {block} projected) to the image tokens' rows, outside any module (Qwen3VLTextModel._deepstack_process), so "
    "layers[{after}].layer_input differs from this there by that (model.model.visual.deepstack_merger_list[{layer}]"
    ".output); on text prompts they are equal"
)


class Deepstack(LanguageModelOf):
    """Qwen3-VL's multimodal parts, before a text family: Qwen3-VL's ViT as `model.vision`, its merger's output in the
    image tokens' rows of what the first language-model layer reads, its deepstack mergers' outputs added to those
    rows after the first `len(deepstack_visual_indexes)` layers (`added_between_blocks`), which their
    `layer_output`'s note says."""

    towers = {"vision": Tower("model.visual", Qwen3VLVisionTower, inputs=("pixel_values",))}
    images = Qwen3_5Images()
    added_between_blocks = AddedBetweenBlocks(
        "model.language_model", features="deepstack_visual_embeds", rows="visual_pos_masks"
    )
    kind_notes = {"*": {"attention_key_positions": POSITIONS_NOTE}}

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        indexes = list(getattr(getattr(config, "vision_config", None), "deepstack_visual_indexes", None) or [])
        if engine == "transformers" and layer is not None and layer < len(indexes):
            notes["layer_output"] = DEEPSTACK_NOTE.format(layer=layer, block=indexes[layer], after=layer + 1)
        return notes


class Qwen3VL(Deepstack, Qwen3):
    """The composite (`Qwen3VLForConditionalGeneration`): Qwen3's language model with Qwen3-VL's tower, images and
    deepstack (`Deepstack`)."""

    model_types = ("qwen3_vl",)
    tiny = Tiny(
        "Qwen3VLConfig",
        "Qwen3VLForConditionalGeneration",
        {"text_config": {"model_type": "qwen3_vl_text", **TEXT}, **TOKENS, "vision_config": VISION},
    )
    #: vLLM's qwen3_vl: Qwen3's text class as `language_model`, adding the deepstack features in its own loop, after
    #: a block's output and before the next block reads it, as transformers does (tests_vllm/test_images_more.py);
    #: the tiny text config's 32-wide heads take M-RoPE's sections over their 16 frequencies (its width stays the
    #: tower's out_hidden_size)
    vllm = replace(
        released_vllm(Qwen3, "qwen3_vl", tiny),
        tiny={"text_config": {**tiny.kwargs["text_config"], "head_dim": 32, "rope_parameters": VLLM_ROPE}},
    )


class Qwen3VLMoe(Deepstack, Qwen3Moe):
    """Qwen3-VL-MoE (`Qwen3VLMoeForConditionalGeneration`): Qwen3-VL's tower, images and deepstack (`Deepstack`) with
    Qwen3-MoE's sparse MLP (`Qwen3VLMoeTextExperts`, one fused gate-up parameter per expert; no sliding window)."""

    model_types = ("qwen3_vl_moe",)
    absent = moe_absent("Qwen3VLMoeTextExperts")
    # layer 0 keeps a dense MLP, so both kinds of layer are tested
    tiny = Tiny(
        "Qwen3VLMoeConfig",
        "Qwen3VLMoeForConditionalGeneration",
        {
            "text_config": {
                "model_type": "qwen3_vl_moe_text",
                **TEXT,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "mlp_only_layers": [0],
            },
            **TOKENS,
            "vision_config": VISION,
        },
    )
    vllm = VLLMLayout(refusal=VLLM_REFUSAL)
