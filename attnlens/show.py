"""Pictures of attention patterns: `show(...)` gives a self-contained HTML viewer (a notebook displays it; `.save`
writes a page that needs no network), `attnlens.plot` a PNG for papers. Both read their input through `patterns()`.

The page draws on `<canvas>`: a grid of every head of a layer and one head large, tokens on both axes, a tooltip with
the query token, the key token and the weight under the pointer. Weights travel as one byte each on a square-root
scale (base64, per head), each row only up to its last non-zero weight (so a causal pattern ships its lower triangle).

With `attribution=` (an `attnlens.attribution` result of the same prompt), each layer also carries its direct
attribution map: every shown head's contribution at the attribution's query rows, split by source over the pattern's
key columns, drawn under the enlarged head on a diverging scale. A contribution is signed: one byte each on a signed
square-root scale of the layer's largest magnitude (128 + sign * round(127 * sqrt(|x| / largest)); 128 is exactly
zero, any other value at least one step from it). Each head's total over every source travels exactly (a float).
"""

from __future__ import annotations

import base64
import html
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch

from .heads import model_name
from .parts.multimodal import KINDS


@dataclass
class LayerPattern:
    """One layer's pattern of one prompt, [heads, query, key], with what labels its axes."""

    layer: int | None
    probs: torch.Tensor  #: float32, on the CPU
    heads: list[int]  #: the head number of each row of `probs`
    query_positions: list[int]  #: the token position of each query row
    key_positions: list[int]  #: the token position of each key column


@dataclass
class ImageShown:
    """One view of an image of a prompt, as a picture overlays attention on it: its pixels and where its tokens are.
    An image of one grid is one view; LLaVA-NeXT's is two (its base view and its stitched tiles, both over the whole
    image: the tiles' grid is unpadded to the image's aspect), a video's one per frame (temporal patch)."""

    pixels: torch.Tensor  #: uint8 [height, width, 3]: the image given, else what the tower saw (rescaled)
    grid: tuple[int, int]  #: (rows, columns) of its tokens over it
    positions: list[int]  #: the position of each of its tokens, row-major over the grid
    name: str = ""  #: what it is, as labels name it: "image 0", "image 0 view 1", "video 1 frame 2"
    image: int = 0  #: which image (or video) of the prompt
    view: int = 0  #: which view of it (a video's frame)
    video: bool = False  #: whether it is a video's frame


@dataclass
class Patterns:
    """What a picture shows: one prompt, its tokens, one or more layers, and the prompt's images (if any)."""

    model: str
    prompt: str
    tokens: list[str]  #: the text of every position
    layers: list[LayerPattern]
    images: list[ImageShown] = field(default_factory=list)

    def layer(self, layer: int | None = None) -> LayerPattern:
        """The pattern of `layer` (the only one when None)."""
        if layer is None:
            if len(self.layers) != 1:
                raise ValueError(f"these patterns hold layers {[p.layer for p in self.layers]}: pick one with layer=")
            return self.layers[0]
        for pattern in self.layers:
            if pattern.layer == layer:
                return pattern
        raise IndexError(f"layer {layer} is not among the layers shown: {[p.layer for p in self.layers]}")


def _is_model(obj) -> bool:
    return all(hasattr(obj, name) for name in ("family", "num_layers", "support", "layers"))


def _index_list(spec, size: int, what: str) -> list[int]:
    items = list(range(size))[spec] if isinstance(spec, slice) else [spec] if isinstance(spec, int) else list(spec)
    for item in items:
        if not isinstance(item, int) or not -size <= item < size:
            raise IndexError(f"{what} {item!r} is out of range: there are {size}")
    if not items:
        raise ValueError(f"no {what}s chosen")
    return [item % size for item in items]


def _positions(given, count: int, total: int, axis: str) -> list[int]:
    """The token position of each of `count` entries on an axis: `given`, else the last `count` positions."""
    if given is None:
        if count > total:
            raise ValueError(
                f"the pattern has {count} {axis}s but only {total} tokens are known; pass tokens= for "
                f"the whole context, or {axis}_positions="
            )
        return list(range(total - count, total))
    positions = given
    if len(positions) != count:
        raise ValueError(f"{axis}_positions gives {len(positions)} positions for a pattern with {count} {axis}s")
    if any(not 0 <= p < total for p in positions):
        raise IndexError(f"{axis}_positions must lie in [0, {total}) (the tokens known); got {positions}")
    return positions


def _as_pattern(tensor, where: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{where}: expected a [heads, query, key] tensor; got {type(tensor).__name__}")
    if tensor.dim() == 4 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 3:
        raise ValueError(
            f"{where}: a pattern is [heads, query, key] (or [1, heads, query, key]); got {tuple(tensor.shape)}"
        )
    return tensor.detach().float().cpu()


def _tokens(model, prompt) -> tuple[list[str] | None, str]:
    """(the text of each token, the prompt's text) from a model's tokenizer, or (None, the prompt) without one."""
    if isinstance(prompt, str) and (model is None or getattr(model, "tokenizer", None) is None):
        return None, prompt
    if prompt is None:
        return None, ""
    if model is None or getattr(model, "tokenizer", None) is None:
        ids = torch.as_tensor(prompt).flatten().tolist()
        return [str(i) for i in ids], " ".join(map(str, ids))
    from .capture import prompts_of

    ids, single = prompts_of(model, prompt)
    if not single:
        raise ValueError("a picture shows one prompt; pass one (a string or 1-D token ids)")
    tokenizer = model.tokenizer
    return [tokenizer.decode([int(i)]) for i in ids[0]], prompt if isinstance(prompt, str) else tokenizer.decode(ids[0])


def _with_images(prompt) -> bool:
    """Whether `prompt` is a multimodal model's inputs (a processor's output: input_ids beside pixel_values, ...)."""
    return isinstance(prompt, Mapping) and "input_ids" in prompt and len(prompt) > 1


def _captured_inputs(model, inputs: Mapping, layers, heads) -> tuple[dict, list[int] | None]:
    """`_captured` of a prompt given as the model's inputs (a processor's output: ids with images): one trace."""
    if layers is None:
        raise ValueError("show(model, inputs, layers): name the layers to capture")
    ids = torch.as_tensor(inputs["input_ids"])
    if ids.dim() == 2 and ids.shape[0] != 1:
        raise ValueError("a picture shows one prompt; the inputs hold a batch of " + str(ids.shape[0]))
    layers = [model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)]
    picked = None if heads is None else _index_list(heads, model.layers[layers[0]].self_attn.num_heads, "head")
    rest = {name: value for name, value in inputs.items() if name != "input_ids"}
    saved = {}
    with torch.no_grad(), model.trace(ids.reshape(1, -1), **rest):
        for layer in layers:
            saved[layer] = model.layers[layer].self_attn.attention_probabilities.save()
    return {layer: (p[0] if picked is None else p[0, picked]) for layer, p in saved.items()}, picked


def _picture(given) -> torch.Tensor:
    """An image given (PIL or an [H, W, 3] array) as a uint8 tensor."""
    import numpy as np

    # a copy: PIL's array is read-only
    return torch.tensor(np.asarray(given.convert("RGB") if hasattr(given, "convert") else given))


def _images_of(model, inputs: Mapping, given) -> tuple[list[ImageShown], list[str]]:
    """Each view of the images of a multimodal prompt (`given`: the images themselves, PIL or [H, W, 3] arrays, a
    video as its frames; else the processor's `pixel_values` rescaled to 0-255, which is what the tower saw), and a
    label for every position."""
    found = model.positions(inputs)
    ids = torch.as_tensor(inputs["input_ids"]).flatten().tolist()
    pictures = [] if given is None else list(given) if isinstance(given, (list, tuple)) else [given]
    pixels = inputs.get("pixel_values")
    count = len(found.grids[0])
    # one picture per image (not Llama 4's tiles, several per image)
    if not pictures and not (
        isinstance(pixels, torch.Tensor) and pixels.dim() == 4 and pixels.shape[0] == count and pixels.shape[1] == 3
    ):
        raise ValueError(
            "images=: pass the prompt's images to draw attention over them (this model's pixel_values are not "
            "[images, 3, height, width] pictures, one per image)"
        )
    if pictures and len(pictures) != count:
        raise ValueError(f"images= gives {len(pictures)} images for a prompt holding {count}")
    shown = []
    for image, views in enumerate(found.views[0]):
        video = int(found.kind[0, found.of_image(image)[0]]) == KINDS.index("video")
        for view, grid in enumerate(views):
            if pictures and video:  # a video's frames: a view (temporal patch) drawn on the first frame it covers
                frames = pictures[image]
                if hasattr(frames, "convert") or not len(frames) or _picture(frames[0]).dim() != 3:
                    raise ValueError(
                        f"images=: entry {image} is a video; pass its frames (a list of pictures or a [frames, "
                        f"height, width, 3] array)"
                    )
                picture = _picture(frames[view * len(frames) // len(views)])
            elif pictures:
                picture = _picture(pictures[image])
            else:
                assert isinstance(pixels, torch.Tensor)  # checked above: without pictures, pixel_values are pictures
                seen = pixels[image].float()
                low, high = seen.amin(dim=(1, 2), keepdim=True), seen.amax(dim=(1, 2), keepdim=True)
                picture = ((seen - low) / (high - low).clamp(min=1e-6) * 255).round().permute(1, 2, 0)
            name = _view_name(image, view, len(views), video)
            at = found.of_image(image, view=view).tolist()
            shown.append(ImageShown(picture.to(torch.uint8), grid, at, name, image, view, video))
    return shown, labels(model, ids, found)


def _view_name(image: int, view: int, views: int, video: bool) -> str:
    """An image's view as labels name it: "image 0" (one view), "image 0 view 1", "video 1 frame 2"."""
    if video:
        return f"video {image} frame {view}"
    return f"image {image}" if views == 1 else f"image {image} view {view}"


def labels(model, ids, positions) -> list[str]:
    """A label for every position of a multimodal prompt: an image's token as `<image i row,col>` (`<image i view v
    row,col>` on an image of several views: LLaVA-NeXT's base view 0 and tiles 1), a video's as `<video i frame f
    row,col>`, an image's newline as `<newline image i view v row r>` (the row it ends), a tower's class token as
    `<class image i>`; else its text."""
    found = []
    for position, token in enumerate(torch.as_tensor(ids).flatten().tolist()):
        image = int(positions.image[0, position])
        if image >= 0:
            kind, view = KINDS[int(positions.kind[0, position])], int(positions.view[0, position])
            name = _view_name(image, view, len(positions.views[0][image]), kind == "video")
            row, col = int(positions.row[0, position]), int(positions.col[0, position])
            found.append(
                f"<newline {name} row {row}>"
                if kind == "newline"
                else f"<class {name}>"
                if kind == "class"
                else f"<{name} {row},{col}>"
            )
        else:
            found.append(model.tokenizer.decode([token]) if model.tokenizer is not None else str(token))
    return found


def _captured(model, prompt, layers, heads) -> tuple[dict, list[int] | None]:
    """({layer: [heads, query, key]}, the head numbers kept) of `prompt` on `model`, captured now."""
    from .capture import capture_attention

    if prompt is None or layers is None:
        raise ValueError("show(model, prompt, layers): name the prompt and the layers to capture")
    if isinstance(prompt, (list, tuple)) and prompt and not isinstance(prompt[0], int):
        raise ValueError("a picture shows one prompt; pass one (a string or 1-D token ids)")
    layers = [model.access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)]
    picked = None if heads is None else _index_list(heads, model.layers[layers[0]].self_attn.num_heads, "head")
    captured = capture_attention(model, prompt, layers, keep="probs", heads=picked, progress=False)
    return {layer: captured[layer]["probs"] for layer in captured}, picked


#: The attention of an encoder-decoder a picture shows (`attention=`): its stack, the sublayer, and which of the
#: source (s) and target (t) tokens are the queries and the keys.
SEQ2SEQ_VIEWS = {
    "encoder": ("encoder", "self_attn", "s", "s"),
    "decoder": ("decoder", "self_attn", "t", "t"),
    "cross": ("decoder", "cross_attn", "t", "s"),
}


def _is_seq2seq(obj) -> bool:
    from .stacks import StandardizedSeq2Seq

    return isinstance(obj, StandardizedSeq2Seq)


def _seq2seq(model, prompt, target, layers, heads, attention: str):
    """An encoder-decoder's patterns of `attention` (`SEQ2SEQ_VIEWS`) for the source `prompt` (text, token ids, or a
    mapping of the encoder's inputs: Whisper's `input_features`) and the decoder's `target` (text or ids): ({layer:
    [heads, query, key]}, head numbers kept, every token's text (the source's, then the target's), query positions,
    key positions, the prompt's text). The keys of cross-attention are the source, its queries the target."""
    if attention not in SEQ2SEQ_VIEWS:
        raise ValueError(
            f"attention= is one of {', '.join(map(repr, SEQ2SEQ_VIEWS))} on an encoder-decoder; got {attention!r}"
        )
    if prompt is None or target is None or layers is None:
        raise ValueError(
            "show(model, source, layers, target=...): name the source, the decoder's tokens and the layers"
        )
    stack_name, sublayer, queries_from, keys_from = SEQ2SEQ_VIEWS[attention]
    from .access import access_of

    stack = getattr(model, stack_name)
    access = access_of(stack)
    layers = [access.check_layer(layer) for layer in ([layers] if isinstance(layers, int) else layers)]
    tokenizer = model.tokenizer

    def ids(given) -> torch.Tensor:
        found = tokenizer(given, return_tensors="pt").input_ids if isinstance(given, str) else torch.as_tensor(given)
        return found.reshape(1, -1)

    inputs = dict(prompt) if isinstance(prompt, Mapping) else {"input_ids": ids(prompt)}
    target_ids = ids(target)
    read: list = []
    with torch.no_grad(), model.trace(**inputs, decoder_input_ids=target_ids):
        for layer in layers:
            read.append(getattr(stack.layers[layer], sublayer).attention_probabilities.save())
    data = {layer: pattern[0] for layer, pattern in zip(layers, read)}
    picked = None if heads is None else _index_list(heads, data[layers[0]].shape[0], "head")
    if picked is not None:
        data = {layer: pattern[picked] for layer, pattern in data.items()}
    # a source of token ids reads as its tokens; one of features (Whisper's frames) as its positions
    key_count = data[layers[0]].shape[-1] if keys_from == "s" else None
    if "input_ids" in inputs:
        source = [tokenizer.decode([int(i)]) for i in inputs["input_ids"][0]]
    else:
        source = [f"@{j}" for j in range(key_count if key_count is not None else 0)]
    target_tokens = [tokenizer.decode([int(i)]) for i in target_ids[0]]
    where = {"s": list(range(len(source))), "t": list(range(len(source), len(source) + len(target_tokens)))}
    text = (
        prompt
        if isinstance(prompt, str)
        else tokenizer.decode(inputs["input_ids"][0])
        if "input_ids" in inputs
        else f"{len(source)} source positions"
    )
    text += " → " + (target if isinstance(target, str) else tokenizer.decode(target_ids[0]))
    return data, picked, source + target_tokens, where[queries_from], where[keys_from], text


def _given(source, layers) -> dict:
    """{layer: [heads, query, key]} of a capture result or a tensor."""
    if isinstance(source, Mapping):
        data = {}
        for layer, entry in source.items():
            if not isinstance(entry, Mapping) or "probs" not in entry:
                raise ValueError(
                    f"layer {layer!r} of this capture holds no 'probs'; capture with keep including 'probs'"
                )
            data[layer] = entry["probs"]
        if layers is None:
            return data
        wanted = [layers] if isinstance(layers, int) else list(layers)
        missing = [layer for layer in wanted if layer not in data]
        if missing:
            raise IndexError(f"layers {missing} are not in this capture; it holds {list(data)}")
        return {layer: data[layer] for layer in wanted}
    if isinstance(source, (list, tuple)) and source and isinstance(source[0], Mapping):
        raise ValueError(f"this is a capture of {len(source)} prompts; a picture shows one: pass out[i]")
    if isinstance(source, torch.Tensor):
        if layers is not None and not isinstance(layers, int):
            raise ValueError("a tensor is one layer's pattern: layers= labels it with one int")
        return {layers: source}
    raise TypeError(
        f"show and plot take a model, a capture_attention result or a [heads, query, key] tensor; got "
        f"{type(source).__name__}"
    )


def patterns(
    source,
    prompt=None,
    layers=None,
    *,
    model=None,
    tokens: Sequence[str] | None = None,
    heads=None,
    head_labels: Sequence[int] | None = None,
    key_positions=None,
    query_positions=None,
    title: str | None = None,
    target=None,
    attention: str = "cross",
    images=None,
) -> Patterns:
    """Normalise what `show` and `plot` accept into `Patterns`.

    `source` is one of:
    - a model (`StandardizedTransformer` or `StandardizedVLLM`) with `prompt` and `layers`: runs
      `capture_attention(model, prompt, layers, keep="probs", heads=heads)`;
    - the dict `capture_attention` returns for one prompt (`out[layer]["probs"]`), `layers` picking among its layers;
    - a [heads, query, key] tensor ([1, heads, query, key] too), from either engine or rebuilt; `layers` labels it.

    `heads` picks heads (indexes into the pattern's head axis; on a model, head numbers); `head_labels` names the
    pattern's heads where it holds a subset. `tokens` is the text of every position of the context (else the model's
    tokenizer on `prompt`, else numbers). A pattern's keys are the last of those positions unless `key_positions`
    says which they are (a sliding window's keys on a decode step), and likewise its queries (`query_positions`).
    `model` (given a capture or a tensor) decodes the tokens and names the model; `title` names it instead.

    An encoder-decoder (`StandardizedSeq2Seq`) takes the source as `prompt` (text, ids, or the encoder's inputs as a
    mapping: Whisper's `{"input_features": ...}`), the decoder's tokens as `target`, and which attention to show as
    `attention`: "cross" (target rows over source keys: what each target token reads of the source), "encoder" or
    "decoder"; the tokens are the source's, then the target's.

    A multimodal model takes the prompt as its inputs (a processor's output, or a dict of input_ids, pixel_values and
    the rest): each image's tokens are labelled `<image i row,col>` (see `labels` for views, videos and newlines),
    and the images travel with the patterns to be drawn under attention, each view of an image (LLaVA-NeXT's base
    view and tiles) and each frame of a video apart (`images=`: the pictures themselves, a video as its frames; else
    `pixel_values` rescaled, what the tower saw).
    """
    shown_images: list[ImageShown] = []
    if images is not None and not (_is_model(source) and _with_images(prompt)):
        raise ValueError("images= draws a multimodal prompt's images: pass the model and its inputs (with the images)")
    if _is_seq2seq(source):
        model = source
        data, head_labels, tokens, query_positions, key_positions, text = _seq2seq(
            model, prompt, target, layers, heads, attention
        )
        heads, prompt = None, text
        title = title if title is not None else f"{model_name(model)}, {attention} attention"
    elif target is not None:
        raise ValueError("target= names an encoder-decoder's decoder tokens; this source is not an encoder-decoder")
    elif _is_model(source) and _with_images(prompt):
        model = source
        data, head_labels = _captured_inputs(model, prompt, layers, heads)
        shown_images, image_labels = _images_of(model, prompt, images)
        tokens = image_labels if tokens is None else tokens
        heads, prompt = None, "".join(image_labels)
    elif _is_model(source):
        model = source
        data, head_labels = _captured(model, prompt, layers, heads)
        heads = None
    else:
        data = _given(source, layers)
    if not data:
        raise ValueError("nothing to show: no layers")
    if shown_images:
        found, text = None, prompt
    else:
        found, text = (None, prompt) if _is_seq2seq(model) else _tokens(model, prompt)
    tokens = list(tokens) if tokens is not None else found
    key_positions, query_positions = (
        None if p is None else [int(i) for i in torch.as_tensor(p).flatten().tolist()]
        for p in (key_positions, query_positions)
    )
    out = []
    for layer, tensor in data.items():
        probs = _as_pattern(tensor, f"layer {layer}")
        labels = list(head_labels) if head_labels is not None else list(range(probs.shape[0]))
        if len(labels) != probs.shape[0]:
            raise ValueError(f"head_labels names {len(labels)} heads for a pattern of {probs.shape[0]}")
        if heads is not None:
            picked = _index_list(heads, probs.shape[0], "head")
            probs, labels = probs[picked], [labels[i] for i in picked]
        num_queries, num_keys = probs.shape[1:]
        known = (
            len(tokens)
            if tokens is not None
            else max([num_keys, *(1 + p for p in key_positions or []), *(1 + p for p in query_positions or [])])
        )
        out.append(
            LayerPattern(
                layer,
                probs,
                [int(h) for h in labels],
                _positions(query_positions, num_queries, known, "query"),
                _positions(key_positions, num_keys, known, "key"),
            )
        )
    if tokens is None:
        tokens = [str(i) for i in range(max(max(p.key_positions + p.query_positions) for p in out) + 1)]
    name = title if title is not None else model_name(model) if model is not None else ""
    return Patterns(
        model=name, prompt=text or "".join(tokens), tokens=[str(t) for t in tokens], layers=out, images=shown_images
    )


def _attribution_layers(attribution, patterns: Patterns) -> list[dict]:
    """Each shown layer's attribution map for the page, checked against the patterns it goes beside."""
    tokens = attribution.tokens
    if len(tokens) != len(patterns.tokens):
        raise ValueError(
            f"the attribution is of {len(tokens)} tokens but the pattern of {len(patterns.tokens)}: attribute the "
            f"prompt you show (or pass tokens= for the whole context)"
        )
    for position, (mine, theirs) in enumerate(zip(patterns.tokens, tokens)):
        if mine != theirs and not theirs.startswith("<generated "):  # a decode step's sources are labelled so
            raise ValueError(
                f"the attribution is of another prompt: token {position} is {mine!r} here and {theirs!r} in the "
                f"attribution; attribute the prompt you show (or pass its tokens=)"
            )
    out = []
    for pattern in patterns.layers:
        layer = pattern.layer
        if layer is None:
            raise ValueError("a pattern shown beside an attribution needs its layer: label it with layers=")
        if layer not in attribution.heads:
            why = attribution.unsplit.get(layer)
            raise ValueError(
                f"layer {layer} is not split by head in this attribution"
                + (f" ({why})" if why else f"; it splits layers {sorted(attribution.heads)}")
                + ": show only those layers, or attribute with layers= including it"
            )
        pieces = attribution.heads[layer]  # [rows, heads, sources]
        missing = [h for h in pattern.heads if not 0 <= h < pieces.shape[1]]
        if missing:
            raise ValueError(f"heads {missing} of the pattern are not in the attribution's {pieces.shape[1]} heads")
        pieces = pieces[:, pattern.heads]
        if pieces.shape[2] == len(tokens):  # a source per position
            pieces = pieces[:, :, pattern.key_positions]
        elif pieces.shape[2] != len(pattern.key_positions):  # else the pattern's own keys (an eager window's)
            raise ValueError(
                f"layer {layer} of the attribution reads {pieces.shape[2]} sources, the pattern "
                f"{len(pattern.key_positions)} keys of {len(tokens)} tokens: show the pattern of the same step"
            )
        shown = pieces.transpose(0, 1)  # [heads, rows, keys]
        scale, data = _encode_signed(shown)
        totals = attribution.by_head()[layer][:, pattern.heads]  # over every source, not only the shown keys
        out.append({"scale": scale, "data": data, "totals": totals.tolist()})
    return out


def _encode_signed(values: torch.Tensor) -> tuple[float, list[str]]:
    """[heads, ...] signed numbers as bytes: 128 + sign * round(127 * sqrt(|x| / largest)), at least one step from
    128 where x is not exactly zero (so a tiny contribution keeps its sign); (largest, base64 per head)."""
    values = values.detach().float().cpu()
    scale = float(values.abs().max()) if values.numel() else 0.0
    steps = (values.abs() / (scale or 1.0)).sqrt().mul(127).round().clamp(min=1).where(values != 0, 0)
    q = (128 + values.sign() * steps).to(torch.uint8)
    return scale, [base64.b64encode(q[h].flatten().numpy().tobytes()).decode("ascii") for h in range(q.shape[0])]


# --- the page ---------------------------------------------------------------------------------------------------------


def _encode(pattern: LayerPattern) -> dict:
    """One layer for the page: weights as bytes on a square-root scale, each row up to its last non-zero byte. Byte 0
    is a weight of exactly zero (masked); any positive weight is at least byte 1, so it is never drawn as masked."""
    probs = pattern.probs.detach().float().cpu().clamp(0, 1)
    q = (probs.sqrt() * 255).round().clamp(min=1).where(probs > 0, 0).to(torch.uint8)  # [heads, query, key]
    num_keys = q.shape[2]
    nonzero = (q != 0).any(0)  # [query, key]
    last = torch.where(nonzero, torch.arange(num_keys), -1).max(-1).values
    lengths = (last + 1).tolist()
    kept = torch.arange(num_keys)[None, :] < (last + 1)[:, None]
    data = [base64.b64encode(q[h][kept].numpy().tobytes()).decode("ascii") for h in range(q.shape[0])]
    return {
        "layer": pattern.layer,
        "heads": pattern.heads,
        "queries": pattern.query_positions,
        "keys": pattern.key_positions,
        "lengths": lengths,
        "data": data,
    }


#: The longest side of an image on the page, in pixels (larger ones are shrunk: the page stays small).
IMAGE_SIDE = 320


def _encode_image(image: ImageShown) -> dict:
    """One image (view) for the page: its RGB bytes (base64, shrunk to `IMAGE_SIDE`), its token grid, its tokens'
    positions, what it is."""
    pixels = image.pixels.permute(2, 0, 1)[None].float()
    scale = IMAGE_SIDE / max(pixels.shape[-2:])
    if scale < 1:
        pixels = torch.nn.functional.interpolate(pixels, scale_factor=scale, mode="area")
    rgb = pixels[0].round().clamp(0, 255).to(torch.uint8).permute(1, 2, 0).contiguous()
    return {
        "width": rgb.shape[1],
        "height": rgb.shape[0],
        "rgb": base64.b64encode(rgb.numpy().tobytes()).decode("ascii"),
        "rows": image.grid[0],
        "cols": image.grid[1],
        "positions": image.positions,
        "name": image.name,
        "image": image.image,
        "view": image.view,
        "video": image.video,
    }


def _json_for_script(data) -> str:
    return (
        json.dumps(data, ensure_ascii=True, separators=(",", ":"))
        .replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
    )


class View:
    """A viewer of `Patterns`: displays in a notebook, `.save(path)` writes a self-contained HTML page."""

    def __init__(self, patterns: Patterns, attribution=None):
        self.patterns = patterns
        self.attribution = attribution  #: an `Attribution` drawn beside the patterns, or None
        self._maps = None if attribution is None else _attribution_layers(attribution, patterns)
        self.id = "attnlens-" + uuid.uuid4().hex[:10]

    def fragment(self) -> str:
        """The viewer as an HTML fragment (styles and script scoped to its own element)."""
        p = self.patterns
        layers = [_encode(x) for x in p.layers]
        page: dict = {"model": p.model, "prompt": p.prompt, "tokens": p.tokens, "layers": layers}
        if p.images:
            page["images"] = [_encode_image(image) for image in p.images]
        if self._maps is not None:
            a = self.attribution
            page["attribution"] = {"what": a.what, "rows": a.rows, "values": a.value.tolist(), "notes": a.notes}
            for layer, found in zip(layers, self._maps):
                layer["attribution"] = found
        title = html.escape(f"attnlens · {p.model}" if p.model else "attnlens")
        return (
            _STYLE.replace("#ROOT", f"#{self.id}")
            + f'<div id="{self.id}" class="attnlens-view"><div class="al-title">{title}</div>'
            f'<div class="al-meta"></div><div class="al-prompt">prompt: {html.escape(p.prompt)}</div>'
            + _BODY
            + "</div>"
            + f'<script type="application/json" id="{self.id}-data">{_json_for_script(page)}</script>'
            + "<script>"
            + _SCRIPT.replace("ROOT_ID", self.id)
            + "</script>"
        )

    def html(self) -> str:
        """The whole page: everything inline, nothing fetched."""
        layers = ", ".join(str(x.layer) for x in self.patterns.layers)
        title = html.escape(f"attnlens · {self.patterns.model} · layer {layers}")
        return (
            f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
            f'<body style="margin:16px;background:#fff">{self.fragment()}</body></html>\n'
        )

    def _repr_html_(self) -> str:
        return self.fragment()

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (.html); returns the path."""
        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"{path}: a page is written as .html (attnlens.plot writes PNG)")
        path.write_text(self.html(), encoding="utf-8")
        return path


def show(source, prompt=None, layers=None, *, attribution=None, **options) -> View:
    """A viewer of attention patterns: every head of each layer in a grid, one head large, hover for the weight.

    `show(model, "prompt", layers=[10, 11])` captures the patterns itself; `show(capture_attention(...))` and
    `show(probs_tensor, layers=10, tokens=...)` show ones captured already (see `patterns` for every option:
    `heads`, `head_labels`, `tokens`, `key_positions`, `query_positions`, `model`, `title`). Returns a `View`: a
    notebook displays it, `.save("page.html")` writes a self-contained page.

    `attribution=` (what `attnlens.attribution` returned for the same prompt) draws its map beside the pattern: the
    enlarged head's contribution at the attributed query rows by source, and each head's total in the grid. With a
    model and no `layers`, the layers shown are those the attribution splits by head.
    """
    if attribution is not None:
        if not hasattr(attribution, "by_head"):
            raise TypeError(f"attribution= takes what attnlens.attribution returns; got {type(attribution).__name__}")
        if _is_model(source):
            if model_name(source) != attribution.model:
                raise ValueError(
                    f"the attribution is of {attribution.model}, the pattern of {model_name(source)}: attribute and "
                    f"show the same model"
                )
            layers = sorted(attribution.heads) if layers is None else layers
    return View(patterns(source, prompt, layers, **options), attribution)


def _asset(name: str) -> str:
    """A file of the viewer (attnlens/viewer/: its CSS and JavaScript, linted as such by `make lint`)."""
    return (resources.files("attnlens") / "viewer" / name).read_text(encoding="utf-8")


#: `#ROOT` and `ROOT_ID` in them stand for the viewer's element id, so several viewers on one page keep apart.
_STYLE = "<style>\n" + _asset("viewer.css") + "</style>"

_BODY = (
    '<div class="al-bar"><label>layer <select class="al-layer"></select></label>'
    '<label>head <select class="al-head"></select></label>'
    '<label><input type="checkbox" class="al-sqrt"> square-root colour scale</label>'
    '<label class="al-rows">attributed row <select class="al-row"></select></label></div>'
    '<div class="al-attribution"></div>'
    '<div class="al-grid"></div><div class="al-large"><canvas class="al-big"></canvas><canvas class="al-map"></canvas>'
    '</div><div class="al-images"></div>'
    '<div class="al-tip"></div>'
)

_SCRIPT = "\n" + _asset("viewer.js")
