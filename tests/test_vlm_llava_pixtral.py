"""LLaVA with a Pixtral tower (Pixtral-12B's layout) on the transformers engine, served by
`attnlens.families.llava_pixtral.PixtralLlava` (passed as `family=`: "llava" is CLIP-towered LLaVA's): a prompt with
two images of different sizes, against transformers' own attention weights, a hand computation of each image token's
feature, the identities, and the refusals that point to it.

The tiny model: the tiny LLaVA (`models.tiny_model("llava")`, a 3-block Llama language model, image token 129) with
Mistral 3's tiny Pixtral tower (2 blocks, patches of 4 pixels), `vision_feature_layer` -1 and the "full" strategy as
Pixtral-12B has them; its processor the Pixtral processor with no merge: a 32 x 32 image is 8 x 8 tokens, a 16 x 24
image 4 x 6, each row ended by [IMG_BREAK] (130), the last by [IMG_END] (131).
"""

from __future__ import annotations

import pytest
import torch
from images import patterns_beside_output_attentions, processor_prompt

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.llava_pixtral import PixtralLlava
from attnlens.families.mistral3 import TOWER

PIXTRAL = {"vision_config": TOWER, "vision_feature_layer": -1, "vision_feature_select_strategy": "full"}
PATCHES = (64, 24)


@pytest.fixture(scope="module")
def model():
    built = attnlens.models.tiny_model("llava", **PIXTRAL)
    return attnlens.StandardizedTransformer(built, tokenizer=attnlens.models.char_tokenizer(), family=PixtralLlava)


@pytest.fixture(scope="module")
def prompt(model):
    processor = PixtralLlava.images.tiny_processor(model.config, attnlens.models.char_tokenizer)
    return processor_prompt(processor, "A[IMG]B[IMG]C", (32, 32), (16, 24))


def _inputs(prompt):
    return {"pixel_values": prompt["pixel_values"], "image_sizes": prompt["image_sizes"]}


def test_every_pattern_of_both_stacks_equals_transformers_attention_and_the_identities_hold(model, prompt):
    """The tower's patterns ([1, heads, 88, 88], zero between the images) and the language model's torch.equal to
    `output_attentions`, the logits equal; every identity of both stacks holds, and fails without the tower's
    segments (images seeing each other)."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    (vision, language, logits), own = patterns_beside_output_attentions(
        model, model._module.model.vision_tower, ids, **inputs
    )
    assert all(torch.equal(found, expected) for found, expected in zip(vision, own.vision))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.language))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (1, 2, 88, 88) and (vision[0][..., :64, 64:] == 0).all()
    saved = read_everything(model, ids, **inputs)
    assert [failures(model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]
    for i in range(2):
        del saved["vision"][(i, "segments")]
    assert "visible entries positive" in failures(model.vision, saved["vision"], 0)


def test_each_image_token_holds_the_projected_feature_of_its_patch(model, prompt):
    """Positions on each image's patch grid (8 x 8, 4 x 6; no merge), the break and end tokens special; by hand, the
    language model's input at the token of (row, col) is the projector of the tower's last block output at that
    patch of the tower's sequence (within 1e-5)."""
    ids, inputs = prompt["input_ids"], _inputs(prompt)
    found = model.positions(ids, **inputs)
    assert found.grids == (((8, 8), (4, 6)),)
    assert ids[0, found.spans()["special"]].tolist() == [130] * 7 + [131] + [130] * 3 + [131]
    with torch.no_grad(), model.trace(ids, **inputs):
        last = model.vision.layers[-1].layer_output.save()
        first = model.layers[0].layer_input.save()
    projector = model._module.model.multi_modal_projector
    starts, widths = (0, PATCHES[0]), (8, 6)
    checked = (found.image[0] >= 0).nonzero().flatten().tolist()
    with torch.no_grad():
        for at in checked:
            image, r, c = (int(t[0, at]) for t in (found.image, found.row, found.col))
            assert torch.allclose(first[0, at], projector(last[0, starts[image] + r * widths[image] + c]), atol=1e-5)
    assert len(checked) == sum(PATCHES)


def test_the_llava_family_refuses_a_pixtral_tower_naming_this_one_and_this_one_refuses_what_it_does_not_lay_out():
    """Can fail: served by `Llava` (CLIP's paths) the tower has no blocks; refused at load, naming PixtralLlava.
    PixtralLlava refuses a CLIP tower and the "default" strategy (which drops a patch, not a class token)."""
    char = attnlens.models.char_tokenizer()
    with pytest.raises(attnlens.errors.Miswired, match=r"PixtralVisionModel.*family=attnlens\.families\.llava_pixtral"):
        attnlens.StandardizedTransformer(attnlens.models.tiny_model("llava", **PIXTRAL), tokenizer=char)
    with pytest.raises(attnlens.errors.Miswired, match="vision_feature_select_strategy is 'default'"):
        built = attnlens.models.tiny_model("llava", **{**PIXTRAL, "vision_feature_select_strategy": "default"})
        attnlens.StandardizedTransformer(built, tokenizer=char, family=PixtralLlava)
    with pytest.raises(attnlens.errors.Miswired):  # a CLIP tower: no transformer.layers
        attnlens.StandardizedTransformer(attnlens.models.tiny_model("llava"), tokenizer=char, family=PixtralLlava)
