"""Llama 4: chunked attention on rotary layers, NoPE layers with temperature-tuned queries, an L2 QK-norm, and MoE
feed-forwards (a shared expert beside routed experts) interleaved with dense ones.

- Layer kinds by `config.no_rope_layers` (1: the layer applies the rotary embedding, 0: it is a NoPE layer) and
  `config.layer_types`: rotary layers are `chunked_attention` when `attention_chunk_size` is set, each query seeing
  only the earlier keys of its own chunk of `attention_chunk_size` positions (counted from the first real token);
  NoPE layers attend to every earlier key. The score function reproduces the chunks on a prefill.
- Rotary layers apply the rotary embedding as complex multiplication of adjacent channel pairs, then (with
  `use_qk_norm`) an L2 norm without weights (`qk_norm`) to queries and keys: both are read after it.
- NoPE layers with `attn_temperature_tuning` multiply each query by `1 + attn_scale * log1p(floor((p + 1) /
  floor_scale))` at its position p; the queries are read after that scaling, as the attention function receives them.
- The block's MLP is `feed_forward` (renamed `mlp`). Dense layers' activation is `activation_fn`. MoE layers
  (`config.moe_layers`) run every routed expert on every token (inputs pre-multiplied by the router's sigmoid score,
  zero for experts not chosen) and add the shared expert; the block returns `(output, router logits)` with the output
  flat, `[batch * seq, hidden]`: `mlp_output` is that output viewed as `[batch, seq, hidden]`.
"""

from dataclasses import dataclass

import torch

from ..family import Family, Tiny, VLLMLayout, released_tiny
from ..locations import Derived, ModuleOutput, child
from ..locations.cache import with_cache
from ..parts import identities, scoring
from ..parts.moe import SparseMoE
from ..parts.multimodal import VLLM_LANGUAGE_MODEL, ImageTokens, LanguageModelOf, Positions, Tower, released_vllm
from .vision_llama4 import Llama4VisionTower

MOE_REASON = (
    "a mixture-of-experts layer: mlp.experts forms act(gate) * up for every expert over every token, "
    "[num_experts, batch * seq, intermediate], on inputs pre-multiplied by the router's sigmoid score (zero "
    "for experts not chosen), and the shared expert (mlp.shared_expert) forms its own; no single [batch, "
    "seq, intermediate] tensor exists. The dense layers (not in config.moe_layers) serve it"
)


@dataclass(frozen=True)
class TokensOutput(ModuleOutput):
    """A module's output flattened to `[batch * seq, hidden]` (an item of a tuple), viewed as its input's layout."""

    def read(self, envoy):
        shape = child(envoy, self.module).input.shape
        return super().read(envoy).view(shape)

    def write(self, envoy, value):
        super().write(envoy, value.flatten(0, -2))


def _interleaved(envoy, heads):
    """vLLM's query or key channels per head (even ones, then odd ones) in transformers' order (adjacent pairs)."""
    half = heads.shape[-1] // 2
    return torch.stack((heads[..., :half], heads[..., half:]), dim=-1).flatten(-2)


def _deinterleaved(envoy, old, new):
    return torch.cat((new[..., 0::2], new[..., 1::2]), dim=-1)


def _in_transformers_order(source):
    return Derived(
        source,
        _interleaved,
        _deinterleaved,
        in_place=False,
        note="vLLM permutes each head's query and key channels at load (even ones, then odd ones: its "
        "rotary kernel rotates halves); served in transformers' order (adjacent pairs), a copy: assign "
        "it to edit",
        why_not="it is a copy in transformers' channel order (vLLM holds the channels permuted)",
    )


def _llama4_vllm_locations(family):
    locations = with_cache(Family.vllm.locations(family))  # vLLM caches the keys permuted, too
    permuted = ("attention_cache_keys", "attention_queries", "attention_keys")
    return {name: _in_transformers_order(found) if name in permuted else found for name, found in locations.items()}


class Llama4(SparseMoE, Family):
    model_types = ("llama4_text",)
    tiny = (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            "head_dim": 16,
            "intermediate_size_mlp": 128,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "moe_layers": [0, 1],
            "no_rope_layers": [1, 0, 1],
            # chunks of 4 positions, so the 18-token test prompt crosses four chunk boundaries
            "attention_chunk_size": 4,
            "layer_types": ["chunked_attention", "full_attention", "chunked_attention"],
        },
    )
    # The NoPE layers' temperature tuning binds only past floor_scale (8192) positions; test_flagships.py makes it bind
    # on the test prompt. (It counts padded positions, so left padding changes it: the padded-batch tests can't use it.)
    mlp = "feed_forward"
    activation = "activation_fn"
    absent = {"mlp_activation": MOE_REASON, "mlp_neurons": MOE_REASON}
    # vLLM (llama4.py): Llama's locations under the same names. It places MoE layers by interleave_moe_layer_step
    # (every step-th layer) and ignores moe_layers, so the checkpoint states both alike; its chunked layers run
    # ChunkedLocalAttention, whose chunk must be a multiple of the KV cache's block size (tests_vllm sets 32).
    vllm = VLLMLayout(
        model_types=("llama4_text",),
        tiny={
            "head_dim": 32,
            "moe_layers": [1],
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 32,
            "num_experts_per_tok": 1,
        },  # vLLM applies the router weight on the input for top-1 only
        locations=_llama4_vllm_locations,
    )

    def moe_layer(self, config, layer):
        return layer in config.moe_layers

    def kind_locations(self, kind, config, engine):
        locations = super().kind_locations(kind, config, engine)
        if (
            "moe" in kind and engine == "transformers"
        ):  # vLLM's MoE block returns its flat output alone, as its MLP does
            locations["mlp_output"] = TokensOutput("", 0)
        return locations

    class Identities(identities.Identities):
        def mlp_forward(self, mlp, mlp_input):
            return super().mlp_forward(mlp, mlp_input).view(mlp_input.shape)

    @staticmethod
    def rotary(config, layer: int) -> bool:
        return bool(config.no_rope_layers[layer])

    def chunk(self, config, layer: int) -> int | None:
        """The chunk size of `layer`'s attention, or None where it sees every earlier key."""
        return config.attention_chunk_size if config.layer_types[layer] == "chunked_attention" else None

    class ScoreFunction(scoring.ScoreFunction):
        def mask(self, num_queries, num_keys, config, layer, key_mask=None, dtype=torch.float32, device=None):
            mask = super().mask(num_queries, num_keys, config, layer, key_mask, dtype, device)
            size = self.family.chunk(config, layer)
            if size is None:
                return mask
            # chunks count from each row's first real token (transformers' chunked_overlay, with left padding)
            keys = torch.arange(num_keys, device=mask.device)
            start = (
                torch.zeros(1, dtype=torch.long, device=mask.device)
                if key_mask is None
                else (key_mask.to(mask.device).long().cumsum(-1) == 0).sum(-1)
            )
            chunks = (keys[None] - start[:, None]).div(size, rounding_mode="floor")  # [batch or 1, key]
            same = chunks[:, None, num_keys - num_queries :, None] == chunks[:, None, None, :]
            return torch.where(same, mask, torch.finfo(dtype).min)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(config, layer, engine)
        size = self.chunk(config, layer)
        if size is not None:
            notes["attention_probabilities"] = (
                f"chunked attention: each query sees only the earlier keys of its own chunk of {size} positions; "
                f"under generate the cache keeps only the last {size} keys, and the family's score function, which "
                f"places keys from position 0, matches the decode steps only within the first chunk"
            )
        if self.rotary(config, layer):
            rotated = "after the rotary embedding (complex multiplication of adjacent channel pairs)"
            if config.use_qk_norm:
                rotated += " and qk_norm (an L2 norm without weights)"
            notes["attention_queries"] = notes["attention_keys"] = rotated
        else:
            notes["attention_keys"] = "a NoPE layer: no rotary embedding and no QK-norm"
            notes["attention_queries"] = notes["attention_keys"]
            if config.attn_temperature_tuning:
                notes["attention_queries"] += (
                    f"; temperature-tuned: each query times 1 + {config.attn_scale:g} * log1p(floor((p + 1) / "
                    f"{config.floor_scale})) at its position p, as the attention function receives it; p counts "
                    f"the batch's positions, left padding included (transformers' arange), so padding changes it"
                )
        return notes

    kind_notes = {
        "moe": {
            "mlp_output": "the MoE block's output (routed experts plus the shared expert), flat [batch * seq, hidden] "
            "in the forward, viewed as [batch, seq, hidden]; in-place edits land",
        }
    }


#: The tiny model's image tokens, past the character tokenizer's 128 ids (so no text prompt holds one), in id order.
TINY_TOKENS = {
    "<|image_start|>": 128,  # boi_token_index
    "<|image_end|>": 129,  # eoi_token_index
    "<|patch|>": 130,  # image_token_index: each holds one feature of the image
    "<|image|>": 131,  # before the global view (an image of one tile: before its tile)
    "<|tile_x_separator|>": 132,
    "<|tile_y_separator|>": 133,
}


def _expanded(ratio: tuple[int, int], per_tile: int, tokens: dict[str, int]) -> list[int]:
    """The ids Llama4Processor writes for an image of `ratio` (rows, columns) tiles of `per_tile` `<|patch|>` tokens
    each (transformers' processing_llama4.py, `_prompt_split_image`), by `tokens`' ids."""
    ratio_h, ratio_w = ratio
    ids = [tokens["start"]]
    if ratio_h * ratio_w > 1:
        for _ in range(ratio_h):
            for x in range(ratio_w):
                ids += [tokens["patch"]] * per_tile + ([tokens["tile_x"]] if x < ratio_w - 1 else [])
            ids.append(tokens["tile_y"])
    return ids + [tokens["image"]] + [tokens["patch"]] * per_tile + [tokens["end"]]


class Llama4Images(ImageTokens):
    """An image of one tile is `<|image_start|>`, `<|image|>`, its tile's grid of `<|patch|>` tokens (one per 2 x 2
    block of the tile's patches, row-major), `<|image_end|>`; an image of several tiles has its tiles' grids before
    `<|image|>` and a global view's grid after it, laid out as two views (its tiles stitched into one grid over the
    image, then the global view). Image tokens attend causally, as text does.

    The processor expands each `<|image|>` of the text by the image's aspect ratio in tiles (`aspect_ratios`, which
    the model does not read and the processor drops from its output): one tile (1 x 1) gives the layout above; more
    give `ratio_h * ratio_w` tiles, each `(tile / patch_size)^2 * pixel_shuffle_ratio^2` tokens, row after row of
    tiles, `<|tile_x_separator|>` after each tile but a row's last, `<|tile_y_separator|>` after each row, then
    `<|image|>` and the global view (the whole image resized to one tile, the last of its `pixel_values`). The
    features fill the `<|patch|>` tokens (`image_token_index`) in order; the language model's mask (causal, chunked on
    rotary layers) is built from positions alone, so image tokens see what text at their positions would.

    `model.positions` gives an image of several tiles two views: view 0 its tiles stitched into one grid of `ratio_h *
    rows` x `ratio_w * cols` (a tile's grid is `rows` x `cols`), over the canvas the processor cut (the image resized
    keeping its aspect, padded to whole tiles), and view 1 the global view's grid; separators and `<|image|>` are
    special. An image of one tile is one view, its tile. The tiles are read from the token pattern, checked against
    `aspect_ratios` where the inputs give them (the image processor's output)."""

    around = ("boi_token_index", "eoi_token_index")

    def grid(self, config, inputs, image):
        """(rows, columns) of one tile's tokens (every tile has the tower's size)."""
        vision = config.vision_config
        pixels = inputs.get("pixel_values")
        height, width = pixels.shape[-2:] if pixels is not None else (vision.image_size, vision.image_size)
        fold = round(1 / vision.pixel_shuffle_ratio)  # the pixel shuffle folds fold x fold patches into a token
        return height // vision.patch_size // fold, width // vision.patch_size // fold

    def positions(self, config, input_ids, inputs):
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        start, end, patch = config.boi_token_index, config.eoi_token_index, config.image_token_id
        is_patch = ids == patch
        kind = is_patch.long()
        image, view, row, col = (torch.full_like(ids, -1) for _ in range(4))
        rows, cols = self.grid(config, inputs, 0)
        ratios = inputs.get("aspect_ratios")
        ratios = None if ratios is None else [tuple(int(n) for n in ratio) for ratio in ratios]
        counted = 0
        views = []
        for b in range(ids.shape[0]):
            starts, ends = ((ids[b] == token).nonzero().flatten().tolist() for token in (start, end))
            if len(starts) != len(ends) or any(not s < e for s, e in zip(starts, ends)):
                raise ValueError(
                    f"input_ids: prompt {b} has {len(starts)} <|image_start|> ({start}) and {len(ends)} <|image_end|> "
                    f"({end}) tokens, not in pairs: pass the processor's input_ids unchanged"
                )
            own: list[tuple[tuple[int, int], ...]] = []
            for s, e in zip(starts, ends):
                span = ids[b, s : e + 1]
                inside = span == patch
                tiles = self._tiles(span, patch, rows * cols, f"image {len(own)} of prompt {b}")
                if ratios is not None:
                    if counted >= len(ratios):
                        raise ValueError(
                            f"aspect_ratios: gives {len(ratios)} images where input_ids hold more: pass the image "
                            f"processor's aspect_ratios for the images of input_ids"
                        )
                    if ratios[counted] != tiles:
                        raise ValueError(
                            f"aspect_ratios: image {len(own)} of prompt {b} is {ratios[counted][0]} x "
                            f"{ratios[counted][1]} tiles there, {tiles[0]} x {tiles[1]} in input_ids' tokens: pass "
                            f"the processor's input_ids and the image processor's aspect_ratios of the same images"
                        )
                places = inside.nonzero().flatten() + s
                kind[b, s : e + 1] = torch.where(inside, 1, 2)  # start, separators, <|image|>, end: special
                image[b, places] = len(own)
                place = torch.arange(rows * cols)
                tile_row, tile_col = place // cols, place % cols
                if tiles == (1, 1):
                    view[b, places], row[b, places], col[b, places] = 0, tile_row, tile_col
                    own.append(((rows, cols),))
                else:
                    ratio_h, ratio_w = tiles
                    stitched, whole = places[: -rows * cols], places[-rows * cols :]
                    which = torch.arange(ratio_h * ratio_w).repeat_interleave(rows * cols)  # each token's tile
                    view[b, stitched], view[b, whole] = 0, 1
                    row[b, stitched] = which // ratio_w * rows + tile_row.repeat(ratio_h * ratio_w)
                    col[b, stitched] = which % ratio_w * cols + tile_col.repeat(ratio_h * ratio_w)
                    row[b, whole], col[b, whole] = tile_row, tile_col
                    own.append(((ratio_h * rows, ratio_w * cols), (rows, cols)))
                counted += 1
            if int((image[b] >= 0).sum()) != int(is_patch[b].sum()):
                raise ValueError(
                    f"input_ids: prompt {b} has <|patch|> tokens ({patch}) outside <|image_start|> ... <|image_end|>: "
                    f"pass the processor's input_ids unchanged"
                )
            views.append(tuple(own))
        if ratios is not None and counted != len(ratios):
            raise ValueError(
                f"aspect_ratios: gives {len(ratios)} images where input_ids hold {counted}: pass the image "
                f"processor's aspect_ratios for the images of input_ids"
            )
        grids = tuple(tuple(image_views[0] for image_views in own) for own in views)
        return Positions(kind, image, row, col, grids, view, tuple(views))

    @staticmethod
    def _tiles(span: torch.Tensor, patch: int, per_tile: int, name: str) -> tuple[int, int]:
        """The (rows, columns) of tiles of the image whose tokens, `<|image_start|>` to `<|image_end|>`, are `span`
        (`patch`: `<|patch|>`'s id), read from its separators: the config names neither separator nor
        `<|image|>`, so their ids are taken from their places (`<|image|>` just before the last run of `<|patch|>`
        tokens, `<|tile_y_separator|>` just before it, `<|tile_x_separator|>` just after the first tile) and the whole
        span checked against Llama4Processor's expansion of those tiles."""
        inside = span == patch
        runs = ((inside[1:] & ~inside[:-1]).nonzero().flatten() + 1).tolist()  # where each run of <|patch|> starts
        first, last = (runs[0], runs[-1]) if runs else (1, 1)
        tokens = {"start": int(span[0]), "end": int(span[-1]), "patch": patch, "image": int(span[last - 1])}
        tokens["tile_y"] = int(span[last - 2]) if last >= 2 else -1
        tokens["tile_x"] = int(span[first + per_tile]) if first + per_tile < len(span) else -1
        count = max(len(runs) - 1, 0)  # the runs before the global view's: the tiles (none for an image of one tile)
        rows = int((span == tokens["tile_y"]).sum()) if count else 1
        tiles = (rows, count // rows) if count and count % rows == 0 else (1, 1)
        # the separators the layout holds (one tile: none; one column of tiles: no x separator), unlike the rest
        used = ["start", "end", "patch", "image"] + ["tile_y"] * (count > 0) + ["tile_x"] * (tiles[1] > 1)
        distinct = len({tokens[name] for name in used}) == len(used)
        if not distinct or span.tolist() != _expanded(tiles, per_tile, tokens):
            raise ValueError(
                f"input_ids: {name} has {int(inside.sum())} <|patch|> tokens (image_token_index = {tokens['patch']}) "
                f"in {len(runs)} runs, not Llama4Processor's layout of whole tiles of {per_tile} tokens (each tile's "
                f"tokens, <|tile_x_separator|> between a row's tiles, <|tile_y_separator|> after each row, then "
                f"<|image|> and the global view's, or <|image|> and one tile's): pass the processor's input_ids "
                f"unchanged"
            )
        return tiles

    def tiny_processor(self, config, char_tokenizer):
        from transformers import Llama4Processor

        vision = config.vision_config
        tokenizer = char_tokenizer(min(TINY_TOKENS.values()), extra=TINY_TOKENS, named={"image_token": "<|image|>"})
        return Llama4Processor(
            image_processor=_one_tile_image_processor(vision.image_size),
            tokenizer=tokenizer,
            patch_size=vision.patch_size,
            pixel_shuffle_ratio=vision.pixel_shuffle_ratio,
        )


def _one_tile_image_processor(side: int):
    """A stand-in for `Llama4ImageProcessor`, which needs torchvision (not installed here): each image resized to one
    `side` x `side` tile (bilinear, its aspect not kept), scaled to [0, 1] and normalised with Llama 4's mean and std
    (0.5), in float32; `aspect_ratios` (1, 1) for every image, so the processor lays each out as one tile. Llama 4's
    own keeps the aspect (padding the rest), normalises in bfloat16 and cuts a large image into tiles."""
    from transformers import SiglipImageProcessorPil
    from transformers.image_utils import PILImageResampling

    class OneTileImageProcessor(SiglipImageProcessorPil):
        def preprocess(self, images, **kwargs):
            found = super().preprocess(images, **kwargs)
            found["aspect_ratios"] = [[1, 1]] * len(found["pixel_values"])
            return found

    return OneTileImageProcessor(
        size={"height": side, "width": side},
        resample=PILImageResampling.BILINEAR,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )


#: The tiny model's tower: 4 x 4 patches of 8 pixels per tile (2 x 2 image tokens after the pixel shuffle), 2 blocks
#: 32 wide; its MLP 4 times as wide, as the adapter reads the pixel-shuffled [4 * hidden] tokens at that width.
TINY_TOWER = {
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 128,
    "image_size": 32,
    "patch_size": 8,
    "vision_output_dim": 64,
    "projector_input_dim": 64,
    "projector_output_dim": 64,
}
_RELEASED = released_tiny("Llama4Config", "Llama4ForConditionalGeneration", Llama4, TINY_TOWER)


class Llama4Multimodal(LanguageModelOf, Llama4):
    """Released Llama 4 checkpoints ("llama4", `Llama4ForConditionalGeneration`: Scout, Maverick) as a composite
    object, and on vLLM (its mllama4.py, the text class as `language_model`): the text model under `language_model`,
    the vision tower `vision_model` (`Llama4VisionTower`) as `model.vision`, the multimodal projector between them.
    Loaded from the checkpoint by name, transformers builds the text model (`Llama4ForCausalLM` on the text config),
    served by `Llama4` on text; to read images, pass the `Llama4ForConditionalGeneration` built yourself (the tiny
    model is that composite: `serves_composite`).

    With an image the language model's attention is the text model's: its mask (causal on NoPE layers, chunked on
    rotary layers: a query sees only the earlier keys of its own chunk of `attention_chunk_size` positions) is built
    from positions alone, so an image's tokens are split by chunk boundaries as text is, and NoPE layers' temperature
    tuning scales them by position as it does text."""

    # transformers' Llama4ForConditionalGeneration holds its Llama4ForCausalLM whole as `language_model`, as vLLM does
    layers, embed_tokens, final_norm = (VLLM_LANGUAGE_MODEL[part] for part in ("layers", "embed_tokens", "final_norm"))
    model_types = ("llama4",)
    towers = {"vision": Tower("vision_model", Llama4VisionTower)}
    images = Llama4Images()
    # the tiny model is the composite (what the tower and image tests read), not the text model a checkpoint loads as
    serves_composite = True
    tiny = Tiny(
        _RELEASED.config,
        _RELEASED.model,
        {
            **_RELEASED.kwargs,
            "text_config": {**_RELEASED.kwargs["text_config"], "vocab_size": 128 + len(TINY_TOKENS)},
            "boi_token_index": TINY_TOKENS["<|image_start|>"],
            "eoi_token_index": TINY_TOKENS["<|image_end|>"],
            "image_token_index": TINY_TOKENS["<|patch|>"],
        },
    )
    vllm = released_vllm(Llama4, "llama4", tiny)  # vLLM's mllama4
