"""`model.positions` on images of several views: LLaVA-NeXT's base view and stitched tiles, laid out from the
processor's own output.

The tiny LLaVA-NeXT (`models.tiny("llava_next")`): a CLIP tower over 32 x 32 crops of 4 x 4 patches, tiles at the
pinpoints 32 x 64, 64 x 32 and 64 x 64; its processor built locally (`models.tiny_processor`, the PIL image
processor). Two images of different aspect ratios, both cut by the unpadding: a wide 24 x 80 one (the 32 x 64
pinpoint: two tiles side by side, a 4 x 8 grid of which rows 1 and 2 are kept) and a tall 60 x 20 one (64 x 32: two
tiles one above the other, an 8 x 4 grid of which columns 1 and 2 are kept).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import attnlens
from attnlens.families.llava import stitched_grid
from attnlens.parts.multimodal import KINDS

IMAGE = 129
TEXT = "ab<image>cd<image>e"


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("llava_next")


@pytest.fixture(scope="module")
def inputs():
    from PIL import Image

    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 255, (24, 80, 3), dtype=np.uint8))
    tall = Image.fromarray(rng.integers(0, 255, (60, 20, 3), dtype=np.uint8))
    return attnlens.models.tiny_processor("llava_next")(text=[TEXT], images=[wide, tall], return_tensors="pt")


def test_every_image_token_of_the_processors_input_ids_is_placed_on_a_view(model, inputs):
    """Each image is its 4 x 4 base view, then its stitched tiles unpadded (2 x 8 and 8 x 2), each row of them ended by
    a newline: every one of the processor's image tokens placed once, in that order."""
    ids = inputs["input_ids"][0]
    found = model.positions(inputs)
    assert inputs["image_sizes"].tolist() == [[24, 80], [60, 20]]
    assert found.views == ((((4, 4), (2, 8)), ((4, 4), (8, 2))),)
    assert found.grids == (((4, 4), (4, 4)),)  # the one-grid API: each image's base view
    is_image = ids == IMAGE
    assert int(is_image.sum()) == 16 + 2 * 9 + 16 + 8 * 3
    assert torch.equal(found.image[0] >= 0, is_image)
    spans = found.spans()
    newline = KINDS.index("newline")
    placed = sorted(spans["image 0"] + spans["image 1"] + spans["newline"])
    assert placed == is_image.nonzero().flatten().tolist()  # every image token: on a grid or a newline, once
    assert len(set(spans["image 0"]) | set(spans["image 1"])) == 16 + 16 + 16 + 16
    first = is_image.nonzero().flatten()[0].item()
    assert found.of_image(0).tolist() == list(range(first, first + 16))  # the base view first, row-major
    tiles = found.of_image(0, view=1)
    assert tiles.tolist() == [p for r in range(2) for p in range(first + 16 + 9 * r, first + 16 + 9 * r + 8)]
    assert (found.kind[0, first + 16 + 8 :: 9][:2] == newline).all()  # each row's ninth token
    assert found.row[0, spans["newline"]].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7]
    assert (found.col[0, spans["newline"]] == -1).all()
    values = torch.arange(ids.shape[0], dtype=torch.float32)
    assert found.on_grid(values, 1, view=1).shape == (8, 2)
    assert found.on_grid(values, 1).shape == (4, 4)
    assert set(found.frame()["view"]) == {-1, 0, 1}


def test_the_layout_is_transformers_packing_of_each_crops_features(model, inputs):
    """Can fail on any row, column, unpadding cut or tile order: features naming their crop and patch, packed by the
    model's own `pack_image_features` (newlines marked), land where the positions say: the base view at its own
    patches, a tile-grid token at the patch of the crop `1 + tile row * tiles across + tile column`, shifted by the
    cut (`stitched_grid`)."""
    config, side = model.config, 4
    crops = [3, 3]  # the base view and two tiles per image
    features = [torch.cartesian_prod(torch.arange(n), torch.arange(side * side)).view(n, side * side, 2) for n in crops]
    newline = torch.tensor([-1, -1])
    with torch.no_grad():
        packed, _ = model._module.model.pack_image_features(
            [f.float() for f in features], inputs["image_sizes"], "default", image_newline=newline.float()
        )
    found = model.positions(inputs)
    for image, (rows_of, size) in enumerate(zip(packed, inputs["image_sizes"])):
        at = (found.image[0] == image).nonzero().flatten()
        assert len(at) == len(rows_of)
        (_, cols), (top, left) = stitched_grid(config, size)
        across = (cols + 2 * left) // side
        for position, held in zip(at.tolist(), rows_of.long().tolist()):
            view, r, c = (int(t[0, position]) for t in (found.view, found.row, found.col))
            if c < 0:
                expected = [-1, -1]  # a newline
            elif view == 0:
                expected = [0, r * side + c]
            else:
                pr, pc = r + top, c + left  # in the padded grid
                expected = [1 + (pr // side) * across + pc // side, (pr % side) * side + pc % side]
            assert held == expected, (image, position)


def _embeddings(model, inputs, pixels):
    with torch.no_grad(), model.trace({**inputs, "pixel_values": pixels}):
        found = model.embeddings.save()
    return found[0]


@pytest.mark.parametrize(("image", "crop"), [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)])
def test_changing_one_crops_pixels_moves_the_embeddings_only_where_its_layout_covers(model, inputs, image, crop):
    """The language model's input at the image tokens (`model.embeddings`) moves, when one crop's pixels change,
    exactly at the positions the layout puts on that crop: the base view's 16 (crop 0), or the tile's rectangle of
    the stitched grid as the unpadding cut it (crop 1 + tile row * tiles across + tile column), nothing else (not the
    newlines, not the other image)."""
    pixels = inputs["pixel_values"].clone()
    before = _embeddings(model, inputs, pixels)
    pixels[image, crop] += 1.0
    moved = (_embeddings(model, inputs, pixels) != before).any(-1).nonzero().flatten().tolist()
    found = model.positions(inputs)
    if crop == 0:
        expected = found.of_image(image).tolist()
    else:
        side = 4
        (rows, cols), (top, left) = stitched_grid(model.config, inputs["image_sizes"][image])
        across = (cols + 2 * left) // side
        tile_row, tile_col = divmod(crop - 1, across)
        on = found.on_grid(torch.arange(before.shape[0]), image, view=1)  # the positions, on the tiles' grid
        r = torch.arange(rows)[:, None] + top
        c = torch.arange(cols)[None] + left
        inside = (r // side == tile_row) & (c // side == tile_col)
        expected = sorted(on[inside].tolist())
    assert expected and moved == expected


def test_bad_inputs_get_a_typed_error_naming_the_field(model, inputs):
    with pytest.raises(ValueError, match="image_sizes: a LLaVA-NeXT image's tiled grid"):
        model.positions(inputs["input_ids"])
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 39 image tokens"):
        model.positions(inputs["input_ids"][:, :-2], image_sizes=inputs["image_sizes"])
    with pytest.raises(ValueError, match="more images than image_sizes gives"):
        model.positions(inputs["input_ids"], image_sizes=inputs["image_sizes"][:1])


def test_gemma3_pan_and_scan_crops_are_images_of_their_own_in_pixel_values_order():
    """Gemma 3's processor with pan and scan puts a wide image's crops after it, each a 2 x 2 image of its own (the
    processor's output drops `num_crops`, so which crops belong to which original is not said): the positions number
    the original, its crops, then the next image, as the rows of `pixel_values`; changing one row's pixels moves the
    embeddings at that image's tokens only."""
    from PIL import Image

    model = attnlens.models.tiny("gemma3")
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 255, (32, 100, 3), dtype=np.uint8))
    square = Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8))
    processor = attnlens.models.tiny_processor("gemma3")
    inputs = processor(
        text=["a<start_of_image>b<start_of_image>"],
        images=[[wide, square]],
        do_pan_and_scan=True,
        pan_and_scan_min_crop_size=8,
        return_tensors="pt",
    )
    assert "num_crops" not in inputs
    found = model.positions(inputs)
    count = inputs["pixel_values"].shape[0]
    assert count == 5 and found.grids == (((2, 2),) * count,)  # the wide image, its 3 crops, the square one
    assert torch.equal(found.image[0] >= 0, inputs["input_ids"][0] == model.config.image_token_id)
    pixels = inputs["pixel_values"].clone()
    before = _embeddings(model, inputs, pixels)
    pixels[2] += 1.0
    moved = (_embeddings(model, inputs, pixels) != before).any(-1).nonzero().flatten().tolist()
    assert moved == found.of_image(2).tolist()


def test_llava_next_under_the_full_strategy_is_refused_with_the_reason():
    """The "full" strategy keeps each crop's class token, which transformers' packing cannot stitch (the model
    itself raises): positions refused by name."""
    model = attnlens.models.tiny("llava_next", vision_feature_select_strategy="full")
    with pytest.raises(attnlens.errors.Unavailable, match="'full' keeps each crop's class token"):
        model.positions(torch.tensor([[1, IMAGE, 2]]), image_sizes=torch.tensor([[32, 64]]))
