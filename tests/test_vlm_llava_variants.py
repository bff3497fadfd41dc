"""LLaVA's variants on the transformers engine, with images: VipLLaVA (features from several tower layers) and
LLaVA-OneVision (anyres over a SigLIP tower, a Qwen2 language model), against transformers' own attention weights, a
hand recomputation of VipLLaVA's features, and the identities.

The tiny VipLLaVA (`models.tiny("vipllava")`): LLaVA's tiny CLIP tower (4 x 4 patches of 8 pixels and a class token),
read at `vision_feature_layers` [0, -1] (the first block's input after pre_layrnorm, the last block's output), a
3-block Llama language model, image token 129. The tiny LLaVA-OneVision (`models.tiny("llava_onevision")`): a 2-block
SigLIP tower (4 x 4 patches of 32 x 32 crops), pinpoints 32 x 64, 64 x 32, 64 x 64, a 3-block Qwen2 language model;
one 32 x 64 image is its base view and two tiles (3 crops): 16 base tokens, then the stitched 4 x 8 grid, each row
ended by a newline (4 x 9 tokens).
"""

from __future__ import annotations

import pytest
import torch
from images import served_patterns

import attnlens
from attnlens.checks import failures, read_everything

IMAGE = 129
VIP = torch.tensor([[1, 40, *[IMAGE] * 16, 42, *[IMAGE] * 16, 43]])
ONEVISION = torch.tensor([[1, 40, *[IMAGE] * (16 + 4 * 9), 43]])
SIZES = torch.tensor([[32, 64]])


@pytest.fixture(scope="module")
def vip():
    return attnlens.models.tiny("vipllava")


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def test_vipllava_patterns_of_both_stacks_equal_transformers_attention_and_the_identities_hold(vip, pixels):
    """Two images: every pattern of the CLIP tower and of the language model torch.equal to `output_attentions`, the
    logits equal; every identity of both stacks holds, image rows causal."""
    with torch.no_grad():
        own = vip._module(input_ids=VIP, pixel_values=pixels, output_attentions=True)
        tower = vip._module.model.vision_tower(pixels, output_attentions=True)
    vision, language, logits = served_patterns(vip, VIP, pixel_values=pixels)
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits) and vision[0].shape == (2, 2, 17, 17)
    saved = read_everything(vip, VIP, pixel_values=pixels)
    assert [failures(vip.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(vip, saved, i) for i in range(3)] == [[], [], []]


def test_vipllava_image_tokens_hold_the_projected_concatenation_of_the_read_layers(vip, pixels):
    """Positions: each image its 4 x 4 patch grid, the class token dropped. By hand: the language model's input at
    the token of (row, col) is the projector of the tower's first block input and last block output at patch
    1 + row * 4 + col, concatenated along the width in `vision_feature_layers`' order (within 1e-5: one row through
    the projector against the batch, 1.9e-6 apart at most); in the other order it is not."""
    found = vip.positions(VIP, pixel_values=pixels)
    assert found.grids == (((4, 4), (4, 4)),) and found.spans()["image 1"] == list(range(19, 35))
    assert vip.config.vision_feature_layers == [0, -1]
    with torch.no_grad(), vip.trace(VIP, pixel_values=pixels):
        read = torch.cat([vip.vision.layers[0].layer_input, vip.vision.layers[-1].layer_output], -1).save()
        first = vip.layers[0].layer_input.save()
    projector = vip._module.model.multi_modal_projector
    checked = (found.image[0] >= 0).nonzero().flatten().tolist()
    with torch.no_grad():
        for at in checked:
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            assert torch.allclose(first[0, at], projector(read[image, 1 + r * 4 + c]), atol=1e-5)
        swapped = projector(read[0, 1].roll(32))
    assert len(checked) == 32 and not torch.allclose(first[0, 2], swapped, atol=1e-2)
    support = vip.vision.support(0)
    assert "vision_feature_layers" in support.notes["layer_output"] and "no logits" in support["logits"]


def test_llava_onevision_patterns_of_both_stacks_equal_transformers_attention_and_the_identities_hold():
    """One 32 x 64 image over its 3 crops: every pattern of the SigLIP tower and of the Qwen2 language model
    torch.equal to `output_attentions`; every identity of both stacks holds; its positions are refused by name."""
    model = attnlens.models.tiny("llava_onevision")
    pixels = torch.randn(1, 3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    inputs = {"pixel_values": pixels, "image_sizes": SIZES}
    with torch.no_grad():
        own = model._module(input_ids=ONEVISION, output_attentions=True, **inputs)
        tower = model._module.model.vision_tower(pixels[0], output_attentions=True)
    vision, language, logits = served_patterns(model, ONEVISION, **inputs)
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits) and vision[0].shape == (3, 2, 16, 16)
    saved = read_everything(model, ONEVISION, **inputs)
    assert "image_of" not in saved  # positions refused: the image rows are held to the causal mask
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    with pytest.raises(attnlens.errors.Unavailable, match=r"two grids .* bilinear .* image_newline"):
        model.positions(ONEVISION, **inputs)
