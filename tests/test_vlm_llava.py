"""LLaVA on the transformers engine: prompts with images, what each position is, the CLIP tower's own attention,
against transformers' own attention weights, a hand recomputation of the projector, and the identities.

The tiny LLaVA (`models.tiny("llava")`): a 2-block CLIP tower over 32 x 32 images (4 x 4 patches of 8 pixels and a
class token: 17 positions), its features read at `vision_feature_layer` -2 (block 0's output: block 1 runs, nothing
reads it), a 3-block Llama language model whose image tokens (id 129, nothing around them) attend causally. Under
"default" an image is its 16 patches; under "full" (`llava:full`) its class token's feature, then the 16 patches.
"""

from __future__ import annotations

import pytest
import torch
from images import image_tokens_hold_projected_features, logits_with_uniform_tower_attention, served_patterns

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.llava import Llava, LlavaImages

IMAGE = 129
#: Text, an image, text, a second image, text.
PROMPT = torch.tensor([[1, 40, *[IMAGE] * 16, 42, *[IMAGE] * 16, 43]])
FIRST, SECOND = list(range(2, 18)), list(range(19, 35))
#: The same under "full": each image one more token, its class token first.
FULL = torch.tensor([[1, 40, *[IMAGE] * 17, 42, *[IMAGE] * 17, 43]])


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("llava")


@pytest.fixture(scope="module")
def full():
    return attnlens.models.tiny("llava:full")


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("layout", ["default", "full"])
def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(
    layout, model, full, pixels
):
    """The language model's patterns (image rows causal, as text) and the CLIP tower's (one per image, its class
    token and 16 patches) are torch.equal to `output_attentions`; the logits equal the model's."""
    model, prompt = (model, PROMPT) if layout == "default" else (full, FULL)
    with torch.no_grad():
        own = model._module(input_ids=prompt, pixel_values=pixels, output_attentions=True)
        tower = model._module.model.vision_tower(pixels, output_attentions=True)
    vision, language, logits = served_patterns(model, prompt, pixel_values=pixels)
    assert len(vision) == len(tower.attentions) == 2 and len(language) == len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (2, 2, 17, 17)  # two images, two heads, the class token and 16 patches each way
    assert (vision[1] > 0).all()  # every position of an image sees every other
    first = language[1][0][:, 2:18, 2:18]
    seen = torch.ones(16, 16, dtype=torch.bool).tril()
    assert (first[:, ~seen] == 0).all() and (first[:, seen] > 0).all()  # an image's tokens: causal, as text


@pytest.mark.parametrize("layout", ["default", "full"])
def test_the_identities_hold_on_both_stacks_with_images(layout, model, full, pixels):
    """Every identity of every block of the tower and of the language model on the two-image prompt, the image rows
    held to the causal mask (LLaVA's mask is its text model's)."""
    model, prompt = (model, PROMPT) if layout == "default" else (full, FULL)
    saved = read_everything(model, prompt, pixel_values=pixels)
    assert [failures(model.vision, saved["vision"], i) for i in range(model.vision.num_layers)] == [[], []]
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    assert saved["vision"]["embeddings"].shape == (2, 17, 32)
    assert saved["vision"]["final_norm_output"].shape == (2, 32)  # post_layernorm of the class token alone


def test_a_mask_that_let_an_images_tokens_see_each_other_both_ways_would_fail(model, pixels, monkeypatch):
    """Can fail: were LLaVA's image tokens said to see each other both ways (as Gemma 3's do), the checks would find
    the entries above the diagonal of an image's rows zero where that mask makes them visible."""

    class BothWays(LlavaImages):
        bidirectional = True

    saved = read_everything(model, PROMPT, pixel_values=pixels)
    monkeypatch.setattr(model.family, "images", BothWays())
    assert "visible entries positive" in failures(model, saved, 0)


def test_positions_place_every_image_token_on_its_images_patch_grid(model, pixels):
    """Under "default" an image's 16 tokens are its 4 x 4 patches, row-major, the class token dropped; `on_grid`
    puts a row of a pattern onto an image's grid; a prompt cut inside an image is refused."""
    found = model.positions(PROMPT, pixel_values=pixels)
    assert found.spans() == {"text": [0, 1, 18, 35], "special": [], "image 0": FIRST, "image 1": SECOND}
    assert found.grids == (((4, 4), (4, 4)),)
    assert found.row[0, FIRST].tolist() == [r for r in range(4) for _ in range(4)]
    assert found.col[0, SECOND].tolist() == list(range(4)) * 4
    row = torch.arange(PROMPT.shape[1], dtype=torch.float32)
    assert found.on_grid(row, 1)[2].tolist() == [27.0, 28.0, 29.0, 30.0]
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 15 image tokens"):
        model.positions(PROMPT[:, :34])


def test_full_positions_give_the_class_token_its_own_kind_off_the_grid(full, pixels):
    """Under "full" each image's first token is the tower's class token: kind "class", its image's, on no grid
    (row and column -1); its 16 patches follow on the 4 x 4 grid."""
    found = full.positions(FULL, pixel_values=pixels)
    assert found.spans() == {
        "text": [0, 1, 19, 37],
        "special": [],
        "class": [2, 20],
        "image 0": list(range(3, 19)),
        "image 1": list(range(21, 37)),
    }
    assert found.image[0, [2, 20]].tolist() == [0, 1] and found.row[0, [2, 20]].tolist() == [-1, -1]
    assert found.frame().loc[2, "kind"] == "class"
    assert found.grids == (((4, 4), (4, 4)),)
    with pytest.raises(
        ValueError, match=r"image 0 of prompt 0 has 16 image tokens .* its class token and its grid need 1 \+ 4 x 4"
    ):
        full.positions(FULL[:, :18])


@pytest.mark.parametrize("layout", ["default", "full"])
def test_each_image_token_holds_the_projected_feature_of_its_place(layout, model, full, pixels):
    """By hand: the language model's input at an image token is the projector's image of the tower's block-0
    output (`vision_feature_layer` -2 of 2 blocks) at the class token (kind "class") or at the patch of its grid
    row and column (1 + row * 4 + col in the tower's sequence), within 1e-6."""
    model, prompt = (model, PROMPT) if layout == "default" else (full, FULL)
    checked = image_tokens_hold_projected_features(
        model, prompt, lambda vision: vision.layers[0].layer_output, first_patch=1, pixel_values=pixels
    )
    assert len(checked) == (34 if layout == "full" else 32)
    assert (model.positions(prompt, pixel_values=pixels).kind[0] == 3).sum() == (2 if layout == "full" else 0)


def test_an_edit_of_the_read_tower_block_moves_the_logits_and_of_the_unread_last_block_does_not(model, pixels):
    """Uniform attention in tower block 0 (whose output the projector reads): the logits equal a hand-run of the
    model with that block's attention replaced by the mean of its values (within 1e-5). The same edit in block 1,
    after `vision_feature_layer`, leaves the logits torch.equal: the block runs, nothing reads it; its support says
    so, and why the tower has no logits."""
    with torch.no_grad():
        plain = model._module(input_ids=PROMPT, pixel_values=pixels).logits
    edited = {}
    for i in range(2):
        with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
            pattern = model.vision.layers[i].self_attn.attention_probabilities
            model.vision.layers[i].self_attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
            logits = model.logits.save()
        edited[i] = logits
    expected = logits_with_uniform_tower_attention(model, 0, PROMPT, pixel_values=pixels)
    assert not torch.allclose(expected, plain, atol=1e-3)
    assert torch.allclose(edited[0], expected, atol=1e-5)
    assert torch.equal(edited[1], plain)
    support = model.vision.support(1)
    assert "vision_feature_layer" in support.notes["layer_output"] and "nothing reads" in support.notes["layer_output"]
    assert "no logits" in support["logits"]
    assert "pre_layrnorm" in support.notes["embeddings"] and "class token" in support.notes["final_norm_output"]
    assert "causally" in model.support(0).notes["self_attn.attention_probabilities"]


def test_the_towers_first_block_reads_pre_layrnorm_of_the_embeddings(model, pixels):
    """CLIP's `embeddings` are before `pre_layrnorm`: the first block's input is that norm of them (within 1e-6),
    and differs from them (the tiny model's norms are perturbed off the identity)."""
    with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
        embeddings = model.vision.embeddings.save()
        first = model.vision.layers[0].layer_input.save()
    with torch.no_grad():
        normed = model._module.model.vision_tower.pre_layrnorm(embeddings)
    assert torch.allclose(first, normed, atol=1e-6) and not torch.allclose(first, embeddings, atol=1e-2)


def test_the_sdpa_rebuild_of_the_image_rows_is_causal(pixels):
    """On sdpa with `rebuild_patterns`, the language model's pattern rebuilt from its queries and keys equals the
    eager pattern (image rows included) within 1e-6."""
    eager = attnlens.models.tiny("llava")
    sdpa = attnlens.models.tiny("llava", attn_implementation="sdpa", rebuild_patterns=True)

    def patterns(model):
        found = []
        with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
            for i in range(model.num_layers):
                found.append(model.layers[i].self_attn.attention_probabilities.save())
        return found

    for found, expected in zip(patterns(sdpa), patterns(eager)):
        assert torch.allclose(found, expected, atol=1e-6)
    assert "eager" in sdpa.vision.support(0)["self_attn.attention_probabilities"]  # the tower's is not rebuilt


def test_a_siglip_towered_llava_is_refused_at_load_with_the_reason():
    """Can fail: a LLaVA whose tower is SigLIP's (no class token, no pre_layrnorm) would be served with CLIP's
    notes and a class token that is a patch; it is refused by name at load."""
    siglip = {**Llava.tiny.kwargs["vision_config"], "model_type": "siglip_vision_model"}
    with pytest.raises(attnlens.errors.Miswired, match="SiglipVisionModel, no CLIP tower"):
        attnlens.models.tiny("llava", vision_config=siglip)


@pytest.fixture(scope="module")
def next_model():
    return attnlens.models.tiny("llava_next")


#: LLaVA-NeXT: one 32 x 64 image (height x width), tiled at the 32 x 64 pinpoint: its base view and two tiles (3
#: crops of 32 x 32); 16 base tokens, then the stitched 4 x 8 grid (nothing to unpad), each row ended by a newline.
SIZES = torch.tensor([[32, 64]])
NEXT = torch.tensor([[1, 40, *[IMAGE] * (16 + 4 * 9), 43]])


def test_llava_next_patterns_of_both_stacks_equal_transformers_attention_and_the_identities_hold(next_model):
    """Every pattern of the tower (over the 3 crops) and the language model torch.equal to `output_attentions`; the
    identities of every block of both stacks hold, the image rows causal."""
    pixels = torch.randn(1, 3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    inputs = {"pixel_values": pixels, "image_sizes": SIZES}
    with torch.no_grad():
        own = next_model._module(input_ids=NEXT, output_attentions=True, **inputs)
        tower = next_model._module.model.vision_tower(pixels[0], output_attentions=True)
    vision, language = [], []
    with torch.no_grad(), next_model.trace(NEXT, **inputs):
        for i in range(2):
            vision.append(next_model.vision.layers[i].self_attn.attention_probabilities.save())
        for i in range(3):
            language.append(next_model.layers[i].self_attn.attention_probabilities.save())
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert vision[0].shape == (3, 2, 17, 17)
    saved = read_everything(next_model, NEXT, **inputs)
    assert (saved["image_of"] >= 0).sum() == 16 + 4 * 9  # placed (tests/test_vlm_positions.py); held causal
    assert [failures(next_model.vision, saved["vision"], i) for i in range(2)] == [[], []]
    assert [failures(next_model, saved, i) for i in range(3)] == [[], [], []]


def test_llava_next_positions_place_the_base_view_then_the_tiles_with_newlines(next_model):
    """An image is two views: the base view's 4 x 4 patches, then the stitched 4 x 8 tiles (nothing cut), each row
    ended by a newline (tests/test_vlm_positions.py lays out images the unpadding cuts, from the processor)."""
    found = next_model.positions(NEXT, image_sizes=SIZES)
    assert found.views == ((((4, 4), (4, 8)),),)
    assert found.of_image(0).tolist() == list(range(2, 18))
    assert found.spans()["newline"] == [18 + 8 + 9 * r for r in range(4)]
    assert found.on_grid(torch.arange(NEXT.shape[1]), 0, view=1)[1].tolist() == list(range(27, 35))
