"""PaliGemma on the transformers engine: prompts with images under its prefix-LM mask, what each position is, the
SigLIP tower's own attention, against transformers' own attention weights, a hand run, and the identities.

The tiny PaliGemma (`models.tiny("paligemma")`): a 2-block SigLIP tower over 32 x 32 images (4 x 4 patches of 8
pixels: 16 image tokens per image, nothing pooled), a one-layer projector, a 3-block Gemma language model. Its mask
is a prefix-LM's: where `token_type_ids` are 0 (the images and the prompt) every token sees every other both ways;
where they are 1 (the suffix) tokens attend causally.
"""

from __future__ import annotations

import pytest
import torch
from images import image_tokens_hold_projected_features, logits_with_uniform_tower_attention, served_patterns

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.paligemma import PaliGemma2

IMAGE = 129
#: Two images, BOS and the prompt (the prefix), then a suffix of three tokens.
PROMPT = torch.tensor([[*[IMAGE] * 32, 1, 40, 41, 42, 50, 51, 52]])
FIRST, SECOND = list(range(16)), list(range(16, 32))
PREFIX, SUFFIX = list(range(36)), [36, 37, 38]
TYPES = (torch.arange(PROMPT.shape[1]) >= 36).long()[None]


@pytest.fixture(scope="module")
def model():
    return attnlens.models.tiny("paligemma")


@pytest.fixture(scope="module")
def pixels():
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _inputs(pixels):
    return {"pixel_values": pixels, "token_type_ids": TYPES}


def test_every_pattern_of_both_stacks_equals_transformers_attention_under_the_prefix_mask(model, pixels):
    """The language model's patterns and the SigLIP tower's (one per image) are torch.equal to `output_attentions`,
    the logits to the model's; the prefix (two images, the prompt) sees itself both ways, sees no suffix token, and
    the suffix attends causally."""
    with torch.no_grad():
        own = model._module(input_ids=PROMPT, output_attentions=True, **_inputs(pixels))
        tower = model._module.model.vision_tower(pixels, output_attentions=True)
    vision, language, logits = served_patterns(model, PROMPT, **_inputs(pixels))
    assert len(vision) == len(tower.attentions) == 2 and len(language) == len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (2, 2, 16, 16)
    pattern = language[1][0]
    assert (pattern[:, PREFIX][..., PREFIX] > 0).all()  # above the diagonal too: image 0 reads image 1 and the text
    assert (pattern[:, PREFIX][..., SUFFIX] == 0).all()
    seen = torch.ones(3, 3, dtype=torch.bool).tril()
    suffix = pattern[:, SUFFIX][..., SUFFIX]
    assert (suffix[:, ~seen] == 0).all() and (suffix[:, seen] > 0).all()
    assert (pattern[:, SUFFIX][..., PREFIX] > 0).all()


def test_the_identities_hold_on_both_stacks_with_the_prefix(model, pixels):
    """Every identity of every block of the tower and of the language model on the two-image prompt with a suffix:
    the masked entries exactly zero where the prefix-LM mask masks, the scores the family's score function's with
    the prefix (`saved["prefix"]`, from `token_type_ids`)."""
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    assert [failures(model.vision, saved["vision"], i) for i in range(model.vision.num_layers)] == [[], []]
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    assert saved["prefix"].tolist() == [[True] * 36 + [False] * 3]
    assert saved["vision"]["embeddings"].shape == (2, 16, 32)


def test_the_checks_fail_without_the_prefix_and_with_one_the_model_was_not_given(model, pixels):
    """Can fail: without the prefix the checks hold the prefix rows to the causal mask (their entries above the
    diagonal are not zero, the score function masks them); and a prefix the model never got (no `token_type_ids`:
    transformers' mask is causal) makes entries the checks call visible zero."""
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    del saved["prefix"]
    found = failures(model, saved, 0)
    assert "masked entries exactly zero" in found and "scores == family score function" in found
    causal = read_everything(model, PROMPT, pixel_values=pixels)
    assert "prefix" not in causal and failures(model, causal, 0) == []
    causal["prefix"] = TYPES == 0
    assert "visible entries positive" in failures(model, causal, 0)


def test_positions_place_every_image_token_on_its_images_patch_grid(model, pixels):
    """An image's 16 tokens are its 4 x 4 patches, row-major, nothing around them; `on_grid` puts a row of a pattern
    onto an image's grid; a prompt cut inside an image is refused."""
    found = model.positions(PROMPT, **_inputs(pixels))
    assert found.spans() == {"text": [32, 33, 34, 35, 36, 37, 38], "special": [], "image 0": FIRST, "image 1": SECOND}
    assert found.grids == (((4, 4), (4, 4)),)
    assert found.row[0, SECOND].tolist() == [r for r in range(4) for _ in range(4)]
    assert found.col[0, FIRST].tolist() == list(range(4)) * 4
    row = torch.arange(PROMPT.shape[1], dtype=torch.float32)
    assert found.on_grid(row, 1)[2].tolist() == [24.0, 25.0, 26.0, 27.0]
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 15 image tokens"):
        model.positions(PROMPT[:, :31])


def test_each_image_token_holds_the_projected_feature_of_its_patch(model, pixels):
    """By hand: the language model's input at an image token is the projector's image of the tower's output (its
    last block through `post_layernorm`) at the patch of its grid row and column, within 1e-6."""
    checked = image_tokens_hold_projected_features(
        model, PROMPT, lambda vision: vision.final_norm_output, **_inputs(pixels)
    )
    assert checked == FIRST + SECOND


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_recomputing_by_hand_predicts(model, pixels):
    """Uniform attention in the tower's last block: the logits equal a hand-run of the model with that block's
    attention replaced by the mean of its values (within 1e-5), and differ from the plain logits."""
    last = model.vision.layers[-1]
    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        pattern = last.self_attn.attention_probabilities
        last.self_attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
        edited = model.logits.save()
    expected = logits_with_uniform_tower_attention(model, -1, PROMPT, **_inputs(pixels))
    with torch.no_grad():
        plain = model._module(input_ids=PROMPT, **_inputs(pixels)).logits
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)
    assert "prefix-LM" in model.support(0).notes["self_attn.attention_probabilities"]


def test_the_sdpa_rebuild_sees_the_prefix_both_ways(pixels):
    """On sdpa with `rebuild_patterns`, every language-model pattern rebuilt from its queries and keys with the
    prefix equals the eager pattern within 5e-6 (measured 1.5e-6: sdpa's and eager's float32 rounding), the prefix
    rows above the diagonal included."""
    eager = attnlens.models.tiny("paligemma")
    sdpa = attnlens.models.tiny("paligemma", attn_implementation="sdpa", rebuild_patterns=True)
    _, found, _ = served_patterns(sdpa, PROMPT, tower=False, **_inputs(pixels))  # sdpa: tower patterns not rebuilt
    _, expected, _ = served_patterns(eager, PROMPT, **_inputs(pixels))
    for rebuilt, pattern in zip(found, expected):
        assert torch.allclose(rebuilt, pattern, atol=5e-6)
        assert (rebuilt[0, :, FIRST[0], SECOND[-1]] > 0).all()
    assert "eager" in sdpa.vision.support(0)["self_attn.attention_probabilities"]  # the tower's is not rebuilt


def test_transformers_sdpa_without_token_types_attends_both_ways_as_the_note_says(pixels):
    """transformers 5.25 builds PaliGemma's Gemma attention `is_causal=False` (`use_bidirectional_attention`): on
    sdpa, without `token_type_ids` it passes no mask and attends both ways over the whole prompt, as eager does given
    every token in the prefix (logits within 1e-5), not causally as eager does without them. The family's note says
    so (its rebuilt patterns there are the causal ones)."""
    eager = attnlens.models.tiny("paligemma")
    sdpa = attnlens.models.tiny("paligemma", attn_implementation="sdpa")
    with torch.no_grad():
        unmasked = sdpa._module(input_ids=PROMPT, pixel_values=pixels).logits
        causal = eager._module(input_ids=PROMPT, pixel_values=pixels).logits
        prefix = eager._module(input_ids=PROMPT, pixel_values=pixels, token_type_ids=torch.zeros_like(PROMPT)).logits
    assert torch.allclose(unmasked, prefix, atol=1e-5) and not torch.allclose(unmasked, causal, atol=1e-3)
    assert "is_causal=False" in eager.support(0).notes["self_attn.attention_probabilities"]


def test_paligemma_2_is_served_as_family_paligemma2_and_refused_by_the_registered_family():
    """PaliGemma 2 (the same model type, a Gemma 2 language model: sliding layers, soft-capped scores, post-norms):
    the registered family refuses it at load with the reason; `family=PaliGemma2` serves it, its patterns torch.equal
    to `output_attentions` and its identities holding, prefix rows of the sliding layer seeing past the window."""
    text = PaliGemma2.tiny.kwargs["text_config"]
    with pytest.raises(attnlens.errors.Miswired, match=r"'gemma2', not 'gemma'; pass family=.*PaliGemma2"):
        attnlens.models.tiny("paligemma", text_config=text)
    raw = attnlens.models.tiny_model("paligemma", text_config=text)
    model = attnlens.StandardizedTransformer(raw, tokenizer=attnlens.models.char_tokenizer(), family=PaliGemma2)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        own = raw(input_ids=PROMPT, output_attentions=True, **_inputs(pixels))
    _, language, logits = served_patterns(model, PROMPT, **_inputs(pixels))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert model.family.score_function().sliding_window(raw.config, 0) == 4
    assert (language[0][0, :, 35, :36] > 0).all()  # a prefix row sees all 36 prefix keys, past its window of 4
    assert (language[0][0, :, 38, :35] == 0).all()  # a suffix row: its window only
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    assert [failures(model, saved, i) for i in range(3)] == [[], [], []]


def test_attnlens_show_with_an_image_writes_the_page_through_the_models_processor(tmp_path):
    """`attnlens show tiny:paligemma PROMPT --image FILE`: the tiny processor (built locally: the character
    tokenizer with `<image>` at id 129, SigLIP's image processor at 32 x 32) puts the image's 16 tokens before BOS
    and the prompt; the page carries the image on its 4 x 4 grid."""
    import cli_run
    from PIL import Image
    from test_show import page_data

    picture = tmp_path / "picture.png"
    Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()).save(
        picture
    )
    processor = attnlens.models.tiny_processor("paligemma")
    inputs = processor(text="<image>Hi", images=[Image.open(picture)], return_tensors="pt")
    assert inputs["input_ids"].tolist() == [[IMAGE] * 16 + [1, 43, 76, 0]]  # "\n" is no character of the tokenizer
    assert inputs["token_type_ids"].tolist() == [[0] * 20] and inputs["pixel_values"].shape == (1, 3, 32, 32)
    page = tmp_path / "page.html"
    run = cli_run.attnlens(
        "show", "tiny:paligemma", "Describe this.", "--image", str(picture), "--layer", "0,1", "--out", str(page)
    )
    assert run.returncode == 0, run.stderr
    data = page_data(page.read_text())
    assert len(data["images"]) == 1 and (data["images"][0]["rows"], data["images"][0]["cols"]) == (4, 4)
    assert data["images"][0]["positions"] == list(range(16))


def test_key_positions_are_sequence_indices_and_the_rotary_ids_count_from_one(model, pixels):
    """`attention_key_positions` is each key's index in the sequence (0..38); the keys are rotated at those plus one
    (transformers numbers PaliGemma's positions from 1): by hand from the block's normed input, within 1e-5, and
    not at the indices themselves. The note says so."""
    from transformers.models.gemma.modeling_gemma import apply_rotary_pos_emb

    with torch.no_grad(), model.trace(PROMPT, **_inputs(pixels)):
        normed = model.layers[0].attention_norm_output.save()
        positions = model.layers[0].self_attn.attention_key_positions.save()
        keys = model.layers[0].self_attn.attention_keys.save()
    assert positions.tolist() == [list(range(39))]
    language = model._module.model.language_model
    attention = language.layers[0].self_attn
    with torch.no_grad():
        raw = attention.k_proj(normed).view(1, 39, -1, attention.head_dim).transpose(1, 2)

        def rotated(ids):
            cos, sin = language.rotary_emb(normed, ids)
            return apply_rotary_pos_emb(raw, raw, cos, sin)[0]

        assert torch.allclose(rotated(positions + 1), keys, atol=1e-5)
        assert not torch.allclose(rotated(positions), keys, atol=1e-3)
    assert "plus one" in model.support(0).notes["self_attn.attention_key_positions"]


def test_paligemma_2s_logits_cap_is_the_one_transformers_applies_and_the_checks_and_attribution_know_it(monkeypatch):
    """transformers 5.19's PaliGemma returns lm_head's output, never capping it by the Gemma 2 text config's
    final_logit_softcapping; 5.25's caps it. With a cap of 5 (where capping moves the tiny logits by 0.1 and more)
    the logits identity holds and attribution adds up to the logit transformers returns; holding the model to the
    other reading fails the identity."""
    import inspect

    from transformers import PaliGemmaForConditionalGeneration

    from attnlens.verification import unembedding_failures

    text = {**PaliGemma2.tiny.kwargs["text_config"], "final_logit_softcapping": 5.0}
    raw = attnlens.models.tiny_model("paligemma", text_config=text)
    model = attnlens.StandardizedTransformer(raw, tokenizer=attnlens.models.char_tokenizer(), family=PaliGemma2)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        own = raw(input_ids=PROMPT, **_inputs(pixels)).logits
    capped = "final_logit_softcapping" in inspect.getsource(PaliGemmaForConditionalGeneration.forward)
    assert (float(own.abs().max()) < 5.0) == capped  # uncapped, the tiny logits reach 6.8
    assert (attnlens.family.final_softcap(model) is None) == (not capped)
    saved = read_everything(model, PROMPT, **_inputs(pixels))
    assert unembedding_failures(model, saved) == []
    found = attnlens.attribution(model, {"input_ids": PROMPT, **_inputs(pixels)}, target=5)
    split = 5.0 * torch.atanh(own[:, -1, 5] / 5.0) if capped else own[:, -1, 5]  # attribution splits before the cap
    torch.testing.assert_close(found.value, split, atol=1e-5, rtol=1e-5)
    assert torch.allclose(found.total, found.value, atol=1e-4)
    monkeypatch.setattr(PaliGemma2, "uncapped_logits", lambda self, model: capped)  # the other reading: it fails
    assert unembedding_failures(model, saved) != []
