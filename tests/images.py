"""Hand computations the vision-language tests share: a tower block run with uniform attention, and each image
token's embedding against the projector's image of its patch."""

from __future__ import annotations

import torch

from attnlens.parts.multimodal import KINDS

__all__ = ["image_tokens_hold_projected_features", "logits_with_uniform_tower_attention"]


def logits_with_uniform_tower_attention(model, block: int, prompt, **inputs):
    """By hand: the logits of `model`'s own module on `prompt` (with `inputs`) when block `block` of its CLIP or
    SigLIP tower (`model.vision_tower.encoder.layers`) attends uniformly, every position receiving the mean of the
    values through `out_proj`."""
    module = model._module.model.vision_tower.encoder.layers[block].self_attn

    def uniform(attention, hidden_states, attention_mask=None, **kwargs):
        b, n, _ = hidden_states.shape
        values = attention.v_proj(hidden_states).view(b, n, -1, attention.head_dim)
        mixed = values.mean(1, keepdim=True).expand(b, n, -1, -1).reshape(b, n, -1)
        return attention.out_proj(mixed), None

    original = module.forward
    module.forward = lambda *a, **k: uniform(module, *a, **k)
    try:
        with torch.no_grad():
            return model._module(input_ids=prompt, **inputs).logits
    finally:
        module.forward = original


def image_tokens_hold_projected_features(model, prompt, features, first_patch: int = 0, **inputs) -> list[int]:
    """Assert that the language model's input at each image token of `prompt` (row 0) is, within 1e-6, the
    projector's image of the tower's features (`features(model.vision)`: the value the projector reads, [image,
    place, width]) at the token's place: 0 for a class token (kind "class"), `first_patch + row * columns + col` for
    the patch of its grid row and column. Returns the positions checked, for the caller to hold against its own."""
    with torch.no_grad(), model.trace(prompt, **inputs):
        read = features(model.vision).save()
        first = model.layers[0].layer_input.save()
    found = model.positions(prompt, **inputs)
    projector = model._module.model.multi_modal_projector
    kinds = found.kind[0].tolist()
    checked = (found.image[0] >= 0).nonzero().flatten().tolist()
    with torch.no_grad():
        for at in checked:
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            columns = found.grids[0][image][1]
            place = 0 if kinds[at] == KINDS.index("class") else first_patch + r * columns + c
            assert torch.allclose(first[0, at], projector(read[image, place]), atol=1e-6)
    return checked
