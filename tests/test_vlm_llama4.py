"""Llama 4 with images on the transformers engine: both stacks against transformers' own attention weights, the
identities, the chunked mask over image tokens, the tower's 2-D rotary queries by hand, and image positions.

The tiny model (`models.tiny("llama4")`: the composite `Llama4ForConditionalGeneration`, the family's
`serves_composite`; a checkpoint loaded by name builds the text model alone): a 2-block vision tower over 32 x 32
tiles (4 x 4 patches of 8 pixels and a class token, the last of 17 rows; the pixel shuffle folds each 2 x 2 block of
patches into one of 2 x 2 image tokens), a 3-block language model whose rotary blocks 0 and 2 attend in chunks of 4
positions and whose block 1 is a NoPE block seeing every earlier key.
"""

from __future__ import annotations

import pytest
import torch
from images import served_patterns

import attnlens
from attnlens.checks import failures, read_everything
from attnlens.families.llama4 import TINY_TOKENS, Llama4
from attnlens.models import char_tokenizer, tiny_model, tiny_processor

START, END, PATCH, IMAGE, TILE_X, TILE_Y = TINY_TOKENS.values()
ONE_TILE = [START, IMAGE, *[PATCH] * 4, END]
#: Text, an image, text, a second image, text: 20 positions, so chunks of 4 cut both images' tokens.
PROMPT = torch.tensor([[1, 40, 41, *ONE_TILE, 42, *ONE_TILE, 43, 44]])
FIRST, SECOND = [5, 6, 7, 8], [13, 14, 15, 16]


def tiled(ratio_h, ratio_w):
    """Text, an image cut into `ratio_h` x `ratio_w` tiles and its global view, text: the ids Llama4Processor writes
    (transformers 5.25's processing_llama4.py, `_prompt_split_image`): <|image_start|>, row after row of tiles, each
    tile's 4 <|patch|> tokens followed by <|tile_x_separator|> but a row's last, <|tile_y_separator|> after each row,
    then <|image|>, the global view's 4 <|patch|> tokens, <|image_end|>. Written out here, not by the family's code."""
    ids = [1, 40, START]
    for _ in range(ratio_h):
        for x in range(ratio_w):
            ids += [PATCH] * 4 + ([TILE_X] if x < ratio_w - 1 else [])
        ids.append(TILE_Y)
    return torch.tensor([[*ids, IMAGE, *[PATCH] * 4, END, 41]])


#: An image cut into 1 x 2 tiles: each tile's tokens, a separator between them, one after the row, then <|image|> and
#: the global view's tokens (three tiles through the tower).
TILED = tiled(1, 2)
LAYOUTS = [(1, 2), (2, 1), (2, 2)]


@pytest.fixture(scope="module")
def model():
    model = attnlens.models.tiny("llama4")
    assert type(model._module).__name__ == "Llama4ForConditionalGeneration"
    return model


def _pixels(tiles, seed=0):
    """`tiles` tiles of pixel values, as Llama4ImageProcessor hands them (it needs torchvision, not installed here):
    [tiles, 3, 32, 32], normalised values drawn at random."""
    return torch.randn(tiles, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def test_every_pattern_of_both_stacks_equals_transformers_attention_on_a_prompt_with_two_images(model):
    """The language model's patterns (chunked blocks 0 and 2, the NoPE block 1) and the tower's (one batch row per
    tile) are torch.equal to `output_attentions`, the logits to the model's; the chunked blocks cut image 0's tokens
    at position 8 (a chunk boundary), the NoPE block does not."""
    pixels = _pixels(2)
    module = model._module
    with torch.no_grad():
        own = module(input_ids=PROMPT, pixel_values=pixels, output_attentions=True)
        # (transformers 5.19's tower indexes its output tuple as if hidden states were asked for: ask for them)
        tower = module.vision_model(pixels, output_attentions=True, output_hidden_states=True)
    vision, language, logits = served_patterns(model, PROMPT, pixel_values=pixels)
    assert len(vision) == len(tower.attentions) == 2 and len(language) == len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(vision, tower.attentions))
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    assert vision[0].shape == (2, 2, 17, 17)  # two tiles, two heads, 16 patches and the class token each way
    assert (vision[1] > 0).all()  # bidirectional within a tile
    chunked, nope = language[0][0], language[1][0]
    assert (chunked[:, 8, 5:8] == 0).all() and (chunked[:, 8, 8] > 0).all()  # position 8 starts a chunk
    assert (nope[:, 8, 5:8] > 0).all() and (nope[:, 7, 8:] == 0).all()  # causal, no chunks


def test_the_identities_hold_on_both_stacks_with_images(model):
    saved = read_everything(model, PROMPT, pixel_values=_pixels(2))
    assert [failures(model.vision, saved["vision"], i) for i in range(model.vision.num_layers)] == [[], []]
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]


def test_the_checks_fail_where_the_chunks_over_image_tokens_are_ignored(model, monkeypatch):
    """Can fail: with the family's chunks ignored (every block causal over all earlier keys), the chunked blocks'
    scores disagree with the model's, and the entries the model masks past a chunk boundary (image rows among them)
    would be visible yet are zero; the NoPE block, unchunked, still holds."""
    saved = read_everything(model, PROMPT, pixel_values=_pixels(2))
    monkeypatch.setattr(Llama4, "chunk", lambda self, config, layer: None)
    for layer in (0, 2):
        found = failures(model, saved, layer)
        assert "visible entries positive" in found and "scores == family score function" in found
    assert failures(model, saved, 1) == []


def test_the_chunked_scores_over_image_tokens_are_the_hand_computed_ones(model):
    """Block 0's scores equal queries @ keys^T / sqrt(head_dim) plus a mask written here: each query sees the earlier
    keys of its own chunk of `attention_chunk_size` positions (counted from position 0), image tokens as text."""
    with torch.no_grad(), model.trace(PROMPT, pixel_values=_pixels(2)):
        attn = model.layers[0].self_attn
        q, k, scores = attn.attention_queries.save(), attn.attention_keys.save(), attn.attention_scores.save()
    heads = model.layers[0].self_attn.heads
    size = model.config.text_config.attention_chunk_size
    assert size < PROMPT.shape[1]
    where = torch.arange(PROMPT.shape[1])
    seen = (where[None] <= where[:, None]) & (where[None] // size == where[:, None] // size)
    mask = torch.where(seen, 0.0, torch.finfo(torch.float32).min)
    repeated = k.repeat_interleave(heads.num_heads // heads.num_kv_heads, dim=1)
    expected = q @ repeated.transpose(-1, -2) * heads.head_dim**-0.5 + mask
    assert torch.allclose(scores, expected, atol=1e-5, rtol=1e-5)
    assert not seen[8, 5] and seen[8, 8] and seen[7, 5]  # image 0's tokens straddle a boundary


def test_the_towers_queries_are_read_after_its_2d_rotary_embedding_by_hand(model):
    """The tower's queries and keys are q_proj and k_proj of the block's norm output turned pair by pair: the first
    half of each head's adjacent channel pairs by (column + 1) * theta_j, the second half by (row + 1) * theta_j, over
    the tile's 4 x 4 patches (row-major); the class token (the last row) unturned. Within 1e-5."""
    with torch.no_grad(), model.trace(PROMPT, pixel_values=_pixels(2)):
        block = model.vision.layers[0]
        normed = block.attention_norm_output.save()
        q, k = block.self_attn.attention_queries.save(), block.self_attn.attention_keys.save()
    attention = model._module.vision_model.model.layers[0].self_attn
    heads, dim = attention.num_heads, attention.head_dim
    pairs = dim // 2
    theta = model.config.vision_config.rope_parameters["rope_theta"]
    frequencies = theta ** -(torch.arange(0, pairs, 2)[: pairs // 2].float() / pairs)
    place = torch.arange(16)
    row, col = torch.cat([place // 4, torch.tensor([-1])]), torch.cat([place % 4, torch.tensor([-1])])
    angles = torch.cat([(col + 1)[:, None] * frequencies, (row + 1)[:, None] * frequencies], dim=-1)  # [17, pairs]
    angles[-1] = 0  # the class token

    def turned(projection):
        x = projection(normed).view(2, 17, heads, pairs, 2)
        cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
        out = torch.stack((x[..., 0] * cos - x[..., 1] * sin, x[..., 0] * sin + x[..., 1] * cos), dim=-1)
        return out.flatten(-2).transpose(1, 2)  # [tiles, heads, rows, head_dim]

    assert torch.allclose(q, turned(attention.q_proj), atol=1e-5)
    assert torch.allclose(k, turned(attention.k_proj), atol=1e-5)
    plain = attention.q_proj(normed).view(2, 17, heads, dim).transpose(1, 2)
    assert torch.allclose(q[:, :, -1], plain[:, :, -1], atol=1e-6)  # the class token
    assert not torch.allclose(q[:, :, :-1], plain[:, :, :-1], atol=1e-2)  # the patches turned


def test_each_image_token_holds_the_projected_pixel_shuffle_of_its_2x2_patches(model):
    """What layers[0] reads at image token (row r, column c) of a tile is the projector's image of the adapter's
    output for that tile's token r * 2 + c, which the pixel shuffle built from patches (2r..2r+1, 2c..2c+1) of
    layernorm_post's output: changing one patch's row of it moves that one token only."""
    pixels = _pixels(2)
    with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
        after = model.vision.final_norm_output.save()
        first = model.layers[0].layer_input.save()
    vision = model._module.vision_model
    projector = model._module.multi_modal_projector
    with torch.no_grad():
        features = projector(vision.vision_adapter(after[:, :-1]))  # [tiles, 4, hidden]
        assert torch.allclose(first[0, FIRST], features[0], atol=1e-6)
        assert torch.allclose(first[0, SECOND], features[1], atol=1e-6)
        moved = after.clone()
        moved[0, 1 * 4 + 2] += 1.0  # patch (1, 2): the token at (0, 1)
        changed = (projector(vision.vision_adapter(moved[:, :-1])) - features).abs().amax(-1)
    assert (changed[0] > 0).tolist() == [False, True, False, False] and (changed[1] == 0).all()


def test_an_edit_of_the_towers_pattern_moves_the_logits_as_a_hook_on_plain_transformers_predicts(model):
    """Uniform attention in the tower's last block: the logits equal plain transformers' with that block's attention
    replaced (a forward hook) by o_proj of the mean of its values; the tower's support says why no logits."""
    pixels = _pixels(2)
    last = model.vision.layers[-1]
    with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
        pattern = last.self_attn.attention_probabilities
        last.self_attn.attention_probabilities = torch.full_like(pattern, 1 / pattern.shape[-1])
        edited = model.logits.save()
    module = model._module
    attention = module.vision_model.model.layers[-1].self_attn

    def uniform(attention, args, kwargs, output):
        hidden = args[0] if args else kwargs["hidden_states"]
        b, n, _ = hidden.shape
        values = attention.v_proj(hidden).view(b, n, -1, attention.head_dim)
        mixed = values.mean(1, keepdim=True).expand(b, n, -1, -1).reshape(b, n, -1)
        return attention.o_proj(mixed), None

    with torch.no_grad():
        plain = module(input_ids=PROMPT, pixel_values=pixels).logits
        hook = attention.register_forward_hook(uniform, with_kwargs=True)
        try:
            expected = module(input_ids=PROMPT, pixel_values=pixels).logits
        finally:
            hook.remove()
    assert torch.allclose(edited, expected, atol=2e-5)  # 6.9e-6 measured: fp32 through three blocks
    assert not torch.allclose(edited, plain, atol=1e-4)  # the edit moved them (by 1.5e-3: a tiny tower's share)
    support = model.vision.support(0)
    assert support["self_attn.attention_probabilities"] is None
    assert "no logits" in support["logits"]
    assert "2-D rotary" in support.notes["self_attn.attention_queries"]


def test_an_edit_of_a_chunked_pattern_over_image_tokens_moves_the_logits_as_a_hook_predicts(model):
    """Block 2's (chunked) pattern with every row put on its own chunk's first key: the logits equal plain
    transformers' with block 2's attention replaced (a forward hook) by o_proj of that key's values per head."""
    pixels = _pixels(2)
    size = model.config.text_config.attention_chunk_size
    first_of_chunk = torch.arange(PROMPT.shape[1]) // size * size
    with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
        attn = model.layers[2].self_attn
        edited_pattern = torch.zeros_like(attn.attention_probabilities)
        edited_pattern[..., torch.arange(PROMPT.shape[1]), first_of_chunk] = 1.0
        attn.attention_probabilities = edited_pattern
        edited = model.logits.save()
    module = model._module
    attention = module.language_model.model.layers[2].self_attn

    def on_chunk_start(attention, args, kwargs, output):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        b, n, _ = hidden.shape
        values = attention.v_proj(hidden).view(b, n, -1, attention.head_dim)[:, first_of_chunk]
        values = values.repeat_interleave(attention.num_key_value_groups, dim=2)
        return attention.o_proj(values.reshape(b, n, -1)), None

    with torch.no_grad():
        hook = attention.register_forward_hook(on_chunk_start, with_kwargs=True)
        try:
            expected = module(input_ids=PROMPT, pixel_values=pixels).logits
        finally:
            hook.remove()
        plain = module(input_ids=PROMPT, pixel_values=pixels).logits
    assert torch.allclose(edited, expected, atol=1e-5)
    assert not torch.allclose(edited, plain, atol=1e-3)


def test_temperature_tuning_binds_on_image_rows_and_every_value_still_equals_transformers():
    """With `floor_scale` 4 the NoPE block's temperature tuning scales queries from position 3 on (image tokens among
    them): its pattern still equals `output_attentions`, the identities hold, and its queries at image 1's tokens are
    the unscaled ones times 1 + attn_scale * log1p(floor((p + 1) / floor_scale))."""
    from attnlens.families.llama4 import Llama4Multimodal

    text = {**Llama4Multimodal.tiny.kwargs["text_config"], "floor_scale": 4, "attn_scale": 0.5}
    module = tiny_model("llama4", text_config=text)
    model = attnlens.StandardizedTransformer(module, tokenizer=char_tokenizer())
    pixels = _pixels(2)
    with torch.no_grad():
        own = module(input_ids=PROMPT, pixel_values=pixels, output_attentions=True)
    with torch.no_grad(), model.trace(PROMPT, pixel_values=pixels):
        normed = model.layers[1].attention_norm_output.save()
        queries = model.layers[1].self_attn.attention_queries.save()
        pattern = model.layers[1].self_attn.attention_probabilities.save()
    assert torch.equal(pattern, own.attentions[1])
    saved = read_everything(model, PROMPT, pixel_values=pixels)
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]
    attention = module.language_model.model.layers[1].self_attn
    plain = attention.q_proj(normed).view(1, PROMPT.shape[1], -1, attention.head_dim).transpose(1, 2)
    at = torch.tensor(SECOND, dtype=torch.float32)
    scale = 1 + 0.5 * torch.log1p(torch.floor((at + 1) / 4))
    assert torch.allclose(queries[0, :, SECOND], plain[0, :, SECOND] * scale[:, None], atol=1e-6)
    assert (scale > 1).all()


def test_the_sdpa_rebuild_keeps_the_chunks_over_image_tokens():
    """On sdpa with `rebuild_patterns`, the language model's patterns rebuilt from the queries and keys with the
    family's mask (chunks on blocks 0 and 2) equal the eager ones within 1e-5, the boundary inside image 0 kept."""
    pixels = _pixels(2)

    def patterns(implementation, rebuild):
        module = tiny_model("llama4", checkpoint=True, attn_implementation=implementation)
        served = attnlens.StandardizedTransformer(
            module, tokenizer=char_tokenizer(), attn_implementation=implementation, rebuild_patterns=rebuild
        )
        found = []
        with torch.no_grad(), served.trace(PROMPT, pixel_values=pixels):
            for i in range(3):
                found.append(served.layers[i].self_attn.attention_probabilities.save())
        return found

    for found, expected in zip(patterns("sdpa", True), patterns("eager", False)):
        assert torch.allclose(found, expected, atol=1e-5)
    assert (found[0, :, 8, 5:8] == 0).all()  # block 2: position 8 starts a chunk


def test_positions_place_each_one_tile_images_tokens_on_its_grid(model):
    """Each position's kind, image, row and column: <|image_start|>, <|image|> and <|image_end|> special, the
    <|patch|> tokens on the tile's 2 x 2 grid; `on_grid` lays a row of a pattern over an image."""
    found = model.positions(PROMPT, pixel_values=_pixels(2))
    spans = {"text": [0, 1, 2, 10, 18, 19], "special": [3, 4, 9, 11, 12, 17], "image 0": FIRST, "image 1": SECOND}
    assert found.spans() == spans
    assert found.grids == (((2, 2), (2, 2)),)
    assert found.row[0, FIRST].tolist() == [0, 0, 1, 1] and found.col[0, SECOND].tolist() == [0, 1, 0, 1]
    row = torch.arange(PROMPT.shape[1], dtype=torch.float32)
    assert found.on_grid(row, 1).tolist() == [[13.0, 14.0], [15.0, 16.0]]
    with pytest.raises(ValueError, match="image 1 of prompt 0 has 3 <\\|patch\\|> tokens"):
        model.positions(torch.cat([PROMPT[:, :16], PROMPT[:, 17:]], dim=1))
    with pytest.raises(ValueError, match="not in pairs"):
        model.positions(PROMPT[:, :12])


@pytest.mark.parametrize("ratio", LAYOUTS)
def test_an_image_of_several_tiles_equals_transformers_attention(model, ratio):
    """An image cut into tiles and its global view (`ratio_h * ratio_w + 1` tiles through the tower, in the image
    processor's order: the tiles row-major, then the global view): every pattern of the language model equal to
    `output_attentions`, the logits to the model's, the identities hold."""
    prompt, pixels = tiled(*ratio), _pixels(ratio[0] * ratio[1] + 1)
    with torch.no_grad():
        own = model._module(input_ids=prompt, pixel_values=pixels, output_attentions=True)
    language = []
    with torch.no_grad(), model.trace(prompt, pixel_values=pixels):
        tower = model.vision.layers[0].self_attn.attention_probabilities.save()
        for i in range(3):
            language.append(model.layers[i].self_attn.attention_probabilities.save())
        logits = model.logits.save()
    assert tower.shape[0] == ratio[0] * ratio[1] + 1
    assert len(own.attentions) == 3
    assert all(torch.equal(found, expected) for found, expected in zip(language, own.attentions))
    assert torch.equal(logits, own.logits)
    saved = read_everything(model, prompt, pixel_values=pixels)
    assert [failures(model, saved, i) for i in range(model.num_layers)] == [[], [], []]


@pytest.mark.parametrize("ratio", LAYOUTS)
def test_positions_place_a_tiled_images_tokens_on_its_tiles_stitched_and_its_global_view(model, ratio):
    """View 0 stitches the tiles into one grid (tile (y, x)'s 2 x 2 tokens at rows 2y.., columns 2x..), view 1 is the
    global view's 2 x 2 grid; the separators and <|image|> are special; every <|patch|> token is placed once."""
    ratio_h, ratio_w = ratio
    prompt = tiled(*ratio)
    found = model.positions(prompt, pixel_values=_pixels(ratio_h * ratio_w + 1))
    assert found.views == ((((2 * ratio_h, 2 * ratio_w), (2, 2)),),)
    assert found.grids == (((2 * ratio_h, 2 * ratio_w),),)
    patches = (prompt[0] == PATCH).nonzero().flatten()
    assert sorted(found.spans()["image 0"]) == patches.tolist()
    assert (found.kind[0, patches] == 1).all() and (found.row[0, patches] >= 0).all()
    assert found.kind[0].tolist() == [0, 0] + [1 if t == PATCH else 2 for t in prompt[0, 2:-1].tolist()] + [0]
    # the i-th tile's tokens are the i-th run of 4 <|patch|> tokens; the global view's the last run
    runs = patches.view(-1, 4)
    stitched = found.on_grid(torch.arange(prompt.shape[1]), 0)
    for tile in range(ratio_h * ratio_w):
        y, x = divmod(tile, ratio_w)
        assert stitched[2 * y : 2 * y + 2, 2 * x : 2 * x + 2].flatten().tolist() == runs[tile].tolist()
    assert found.on_grid(torch.arange(prompt.shape[1]), 0, view=1).flatten().tolist() == runs[-1].tolist()
    assert found.view[0, runs[-1]].tolist() == [1] * 4 and (found.view[0, runs[:-1].flatten()] == 0).all()


@pytest.mark.parametrize("ratio", LAYOUTS)
def test_each_tiles_pixels_move_what_layers_0_reads_exactly_where_positions_put_that_tile(model, ratio):
    """By perturbation: changing tile t's pixels (the image processor's t-th tile, row-major) moves `embeddings`
    (what layers[0] reads) at exactly the positions view 0 puts on that tile (rows 2y.., columns 2x..); changing the
    global view's pixels moves exactly view 1's tokens. The tower runs each tile alone, so nothing else moves."""
    ratio_h, ratio_w = ratio
    prompt, pixels = tiled(*ratio), _pixels(ratio_h * ratio_w + 1)
    found = model.positions(prompt, pixel_values=pixels)

    def embeddings(pixels):
        with torch.no_grad(), model.trace(prompt, pixel_values=pixels):
            saved = model.embeddings.save()
        return saved[0]

    plain = embeddings(pixels)
    placed = found.of_image(0, view=0)
    tile_of = found.row[0, placed] // 2 * ratio_w + found.col[0, placed] // 2
    for tile in range(ratio_h * ratio_w + 1):
        changed = pixels.clone()
        changed[tile] += torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(tile + 10))
        moved = (embeddings(changed) - plain).abs().amax(-1) > 0
        expected = placed[tile_of == tile] if tile < ratio_h * ratio_w else found.of_image(0, view=1)
        assert moved.nonzero().flatten().tolist() == sorted(expected.tolist())


def test_aspect_ratios_that_disagree_with_the_tokens_are_refused_by_name(model):
    """Where the inputs give the image processor's `aspect_ratios`, they must be the tiles the tokens hold; a prompt
    whose tokens are not the processor's layout is refused (naming input_ids)."""
    pixels = _pixels(3)
    agreed = model.positions(TILED, pixel_values=pixels, aspect_ratios=torch.tensor([[1, 2]]))
    assert agreed.views == ((((2, 4), (2, 2)),),)
    with pytest.raises(ValueError, match="aspect_ratios: image 0 of prompt 0 is 2 x 1 tiles there, 1 x 2"):
        model.positions(TILED, pixel_values=pixels, aspect_ratios=torch.tensor([[2, 1]]))
    with pytest.raises(ValueError, match="aspect_ratios: gives 2 images where input_ids hold 1"):
        model.positions(TILED, pixel_values=pixels, aspect_ratios=[[1, 2], [1, 1]])
    one_short = torch.cat([TILED[:, :5], TILED[:, 6:]], dim=1)  # a tile of 3 tokens
    with pytest.raises(ValueError, match="input_ids: image 0 of prompt 0 has 11 <\\|patch\\|> tokens"):
        model.positions(one_short)
    no_global = TILED[:, : TILED.shape[1] - 7]  # the tiles without <|image|> and the global view
    with pytest.raises(ValueError, match="not in pairs"):
        model.positions(no_global)
    swapped = TILED.clone()
    swapped[0, 7] = IMAGE  # <|image|> between the row's two tiles
    with pytest.raises(ValueError, match="not Llama4Processor's layout"):
        model.positions(swapped)


def test_the_tiny_processor_expands_an_image_into_one_tile_as_llama4processor_does():
    """`models.tiny_processor("llama4")`: transformers' Llama4Processor (its own expansion of <|image|>) with the
    character tokenizer and a one-tile stand-in image processor (Llama4ImageProcessor needs torchvision): an image
    becomes <|image_start|> <|image|> 4 x <|patch|> <|image_end|> and one 32 x 32 tile."""
    from PIL import Image

    processor = tiny_processor("llama4")
    picture = Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    inputs = processor(text="ab<|image|>cd", images=[picture], return_tensors="pt")
    assert inputs["input_ids"].tolist() == [[68, 69, *ONE_TILE, 70, 71]]
    assert inputs["pixel_values"].shape == (1, 3, 32, 32)
    assert type(processor).__name__ == "Llama4Processor"


@pytest.mark.parametrize("ratio", LAYOUTS)
def test_llama4processor_writes_the_hand_built_tiled_layout(ratio):
    """Llama4Processor itself, its image processor made to answer `ratio` tiles (`aspect_ratios`, as
    Llama4ImageProcessor does for a wide or tall image; it needs torchvision, not installed here) and that many tiles
    plus the global view as pixel values, expands <|image|> into exactly `tiled(ratio)`'s image tokens; it drops
    `aspect_ratios` from its output, so positions read the tiles from the tokens."""
    from PIL import Image

    processor = tiny_processor("llama4")
    images = processor.image_processor
    one_tile = type(images).preprocess

    def cut(*args, **kwargs):
        found = one_tile(images, *args, **kwargs)
        found["pixel_values"] = torch.as_tensor(found["pixel_values"]).repeat(ratio[0] * ratio[1] + 1, 1, 1, 1)
        found["aspect_ratios"] = [list(ratio)]
        return found

    images.preprocess = cut
    picture = Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    inputs = processor(text="ab<|image|>cd", images=[picture], return_tensors="pt")
    assert inputs["input_ids"][0, 2:-2].tolist() == tiled(*ratio)[0, 2:-1].tolist()
    assert inputs["pixel_values"].shape == (ratio[0] * ratio[1] + 1, 3, 32, 32) and "aspect_ratios" not in inputs


def test_the_viewer_lays_a_processed_images_tokens_on_its_grid(model):
    """`attnlens.show`'s patterns of the processor's inputs: the image on its 2 x 2 grid at the <|patch|> positions,
    named by grid place (what `attnlens show tiny:llama4 --image FILE` draws)."""
    from PIL import Image

    from attnlens.show import patterns

    processor = tiny_processor("llama4")
    picture = Image.fromarray((torch.rand(24, 40, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy())
    inputs = dict(processor(text="ab<|image|>cd", images=[picture], return_tensors="pt"))
    shown = patterns(model, inputs, [0])
    assert len(shown.images) == 1 and shown.images[0].positions == [4, 5, 6, 7]
    assert shown.tokens[5] == "<image 0 0,1>"


def test_the_viewer_draws_a_tiled_image_given_as_a_picture_and_refuses_its_tiles_as_one(model):
    """`attnlens.show` lays a tiled image's two views over the picture given as `images=`: view 0 (its tiles stitched,
    2 x 4 for 1 x 2 tiles) and view 1 (the global view, 2 x 2); without it, the pixel values (three tiles for one
    image) are not a picture per image."""
    from attnlens.show import patterns

    inputs = {"input_ids": TILED, "pixel_values": _pixels(3)}
    picture = (torch.rand(32, 64, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    shown = patterns(model, inputs, [0], images=[picture])
    positions = model.positions(inputs)
    assert [(one.view, one.grid) for one in shown.images] == [(0, (2, 4)), (1, (2, 2))]
    assert [one.positions for one in shown.images] == [positions.of_image(0, view=v).tolist() for v in (0, 1)]
    with pytest.raises(ValueError, match="one per image"):
        patterns(model, inputs, [0])


def test_a_tiled_image_then_a_one_tile_image_are_numbered_and_fed_in_order(model):
    """A prompt with an image of 1 x 2 tiles then an image of one tile: four tiles through the tower (the first image's
    two tiles and its global view, then the second image's tile); the second image is one view, and changing its
    pixels (the fourth tile) moves `embeddings` exactly at its tokens; `aspect_ratios` count images in prompt order."""
    prompt = torch.cat([TILED[:, :-1], torch.tensor([[*ONE_TILE, 41]])], dim=1)
    pixels = _pixels(4)
    found = model.positions(prompt, pixel_values=pixels, aspect_ratios=[[1, 2], [1, 1]])
    assert found.views == ((((2, 4), (2, 2)), ((2, 2),)),)
    with pytest.raises(ValueError, match="aspect_ratios: image 0 of prompt 0 is 1 x 1 tiles there, 1 x 2"):
        model.positions(prompt, pixel_values=pixels, aspect_ratios=[[1, 1], [1, 2]])
    with torch.no_grad(), model.trace(prompt, pixel_values=pixels):
        plain = model.embeddings.save()
    changed = pixels.clone()
    changed[3] += 1.0
    with torch.no_grad(), model.trace(prompt, pixel_values=changed):
        moved = model.embeddings.save()
    assert ((moved - plain)[0].abs().amax(-1) > 0).nonzero().flatten().tolist() == found.of_image(1).tolist()
