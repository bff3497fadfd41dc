"""Pictures of attention patterns: `show(...)` gives a self-contained HTML viewer (a notebook displays it; `.save`
writes a page that needs no network), `attnlens.plot` a PNG for papers. Both read their input through `patterns()`.

The page draws on `<canvas>`: a grid of every head of a layer and one head large, tokens on both axes, a tooltip with
the query token, the key token and the weight under the pointer. Weights travel as one byte each on a square-root
scale (base64, per head), each row only up to its last non-zero weight (so a causal pattern ships its lower triangle).
"""

from __future__ import annotations

import base64
import html
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .heads import model_name


@dataclass
class LayerPattern:
    """One layer's pattern of one prompt, [heads, query, key], with what labels its axes."""

    layer: int | None
    probs: torch.Tensor  #: float32, on the CPU
    heads: list[int]  #: the head number of each row of `probs`
    query_positions: list[int]  #: the token position of each query row
    key_positions: list[int]  #: the token position of each key column


@dataclass
class Patterns:
    """What a picture shows: one prompt, its tokens, one or more layers."""

    model: str
    prompt: str
    tokens: list[str]  #: the text of every position
    layers: list[LayerPattern]

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
            raise ValueError(f"the pattern has {count} {axis}s but only {total} tokens are known; pass tokens= for "
                             f"the whole context, or {axis}_positions=")
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
        raise ValueError(f"{where}: a pattern is [heads, query, key] (or [1, heads, query, key]); got "
                         f"{tuple(tensor.shape)}")
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
    return [tokenizer.decode([int(i)]) for i in ids[0]], prompt if isinstance(prompt, str) else \
        tokenizer.decode(ids[0])


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


def _given(source, layers) -> dict:
    """{layer: [heads, query, key]} of a capture result or a tensor."""
    if isinstance(source, Mapping):
        data = {}
        for layer, entry in source.items():
            if not isinstance(entry, Mapping) or "probs" not in entry:
                raise ValueError(f"layer {layer!r} of this capture holds no 'probs'; capture with keep including "
                                 f"'probs'")
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
    raise TypeError(f"show and plot take a model, a capture_attention result or a [heads, query, key] tensor; got "
                    f"{type(source).__name__}")


def patterns(source, prompt=None, layers=None, *, model=None, tokens: Sequence[str] | None = None, heads=None,
             head_labels: Sequence[int] | None = None, key_positions=None, query_positions=None,
             title: str | None = None) -> Patterns:
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
    """
    if _is_model(source):
        model = source
        data, head_labels = _captured(model, prompt, layers, heads)
        heads = None
    else:
        data = _given(source, layers)
    if not data:
        raise ValueError("nothing to show: no layers")
    found, text = _tokens(model, prompt)
    tokens = list(tokens) if tokens is not None else found
    key_positions, query_positions = (None if p is None else [int(i) for i in torch.as_tensor(p).flatten().tolist()]
                                      for p in (key_positions, query_positions))
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
        known = len(tokens) if tokens is not None else max([num_keys, *(1 + p for p in key_positions or []),
                                                              *(1 + p for p in query_positions or [])])
        out.append(LayerPattern(layer, probs, [int(h) for h in labels],
                                _positions(query_positions, num_queries, known, "query"),
                                _positions(key_positions, num_keys, known, "key")))
    if tokens is None:
        tokens = [str(i) for i in range(max(max(p.key_positions + p.query_positions) for p in out) + 1)]
    name = title if title is not None else model_name(model) if model is not None else ""
    return Patterns(model=name, prompt=text or "".join(tokens), tokens=[str(t) for t in tokens], layers=out)


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
    return {"layer": pattern.layer, "heads": pattern.heads, "queries": pattern.query_positions,
            "keys": pattern.key_positions, "lengths": lengths, "data": data}


def _json_for_script(data) -> str:
    return json.dumps(data, ensure_ascii=True, separators=(",", ":")).replace("<", "\\u003c").replace(
        ">", "\\u003e").replace("&", "\\u0026")


class View:
    """A viewer of `Patterns`: displays in a notebook, `.save(path)` writes a self-contained HTML page."""

    def __init__(self, patterns: Patterns):
        self.patterns = patterns
        self.id = "attnlens-" + uuid.uuid4().hex[:10]

    def fragment(self) -> str:
        """The viewer as an HTML fragment (styles and script scoped to its own element)."""
        p = self.patterns
        page = {"model": p.model, "prompt": p.prompt, "tokens": p.tokens, "layers": [_encode(x) for x in p.layers]}
        title = html.escape(f"attnlens · {p.model}" if p.model else "attnlens")
        return (_STYLE.replace("#ROOT", f"#{self.id}")
                + f'<div id="{self.id}" class="attnlens-view"><div class="al-title">{title}</div>'
                f'<div class="al-meta"></div><div class="al-prompt">prompt: {html.escape(p.prompt)}</div>'
                + _BODY + "</div>"
                + f'<script type="application/json" id="{self.id}-data">{_json_for_script(page)}</script>'
                + "<script>" + _SCRIPT.replace("ROOT_ID", self.id) + "</script>")

    def html(self) -> str:
        """The whole page: everything inline, nothing fetched."""
        layers = ", ".join(str(x.layer) for x in self.patterns.layers)
        title = html.escape(f"attnlens · {self.patterns.model} · layer {layers}")
        return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>'
                f'<body style="margin:16px;background:#fff">{self.fragment()}</body></html>\n')

    def _repr_html_(self) -> str:
        return self.fragment()

    def save(self, path: str | Path) -> Path:
        """Write the page to `path` (.html); returns the path."""
        path = Path(path)
        if path.suffix.lower() not in (".html", ".htm"):
            raise ValueError(f"{path}: a page is written as .html (attnlens.plot writes PNG)")
        path.write_text(self.html(), encoding="utf-8")
        return path


def show(source, prompt=None, layers=None, **options) -> View:
    """A viewer of attention patterns: every head of each layer in a grid, one head large, hover for the weight.

    `show(model, "prompt", layers=[10, 11])` captures the patterns itself; `show(capture_attention(...))` and
    `show(probs_tensor, layers=10, tokens=...)` show ones captured already (see `patterns` for every option:
    `heads`, `head_labels`, `tokens`, `key_positions`, `query_positions`, `model`, `title`). Returns a `View`: a
    notebook displays it, `.save("page.html")` writes a self-contained page.
    """
    return View(patterns(source, prompt, layers, **options))


_STYLE = """<style>
#ROOT{font:13px system-ui,sans-serif;color:#222}
#ROOT .al-title{font-size:16px;font-weight:600;margin-bottom:2px}
#ROOT .al-meta,#ROOT .al-prompt{color:#555;margin:2px 0}
#ROOT .al-prompt{max-height:4.5em;overflow:auto;white-space:pre-wrap;font-family:monospace}
#ROOT .al-bar{margin:8px 0;display:flex;gap:16px;align-items:center}
#ROOT .al-grid{display:flex;flex-wrap:wrap;gap:10px;margin:6px 0}
#ROOT figure{margin:0;text-align:center;cursor:pointer}
#ROOT figure.al-on canvas{outline:2px solid #e6550d}
#ROOT figcaption{font-size:11px;color:#555}
#ROOT .al-large{overflow:auto;max-width:100%;max-height:1000px;border-top:1px solid #ddd;padding-top:6px}
#ROOT canvas{display:block}
#ROOT .al-tip{position:fixed;display:none;pointer-events:none;background:#fff;border:1px solid #999;padding:4px 6px;
font:12px monospace;white-space:pre;box-shadow:0 1px 4px rgba(0,0,0,.2);z-index:1000}
</style>"""

_BODY = ('<div class="al-bar"><label>layer <select class="al-layer"></select></label>'
         '<label>head <select class="al-head"></select></label>'
         '<label><input type="checkbox" class="al-sqrt"> square-root colour scale</label></div>'
         '<div class="al-grid"></div><div class="al-large"><canvas class="al-big"></canvas></div>'
         '<div class="al-tip"></div>')

_SCRIPT = r"""
(function () {
  "use strict";
  const started = performance.now();
  const root = document.getElementById("ROOT_ID");
  const page = JSON.parse(document.getElementById("ROOT_ID-data").textContent);
  const $ = (selector) => root.querySelector(selector);
  const grid = $(".al-grid"), big = $(".al-big"), tip = $(".al-tip");
  const THUMB = 160, LARGE = 720, SMALLEST = (1.5 / 255) ** 2;  // byte 1 holds every weight below SMALLEST
  // ColorBrewer Blues, as matplotlib's "Blues" (attnlens.plot uses it too)
  const ANCHORS = [[247,251,255],[222,235,247],[198,219,239],[158,202,225],[107,174,214],[66,146,198],[33,113,181],
                   [8,81,156],[8,48,107]];
  function colour(x) {
    const f = x * (ANCHORS.length - 1), i = Math.min(Math.floor(f), ANCHORS.length - 2), t = f - i;
    return [0, 1, 2].map((j) => Math.round(ANCHORS[i][j] + (ANCHORS[i + 1][j] - ANCHORS[i][j]) * t));
  }
  const LUTS = {};
  for (const mode of ["linear", "sqrt"]) {
    const lut = new Uint32Array(256);
    for (let v = 0; v < 256; v++) {
      const s = v / 255, [r, g, b] = colour(mode === "sqrt" ? s : s * s);
      lut[v] = ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;  // RGBA bytes, little-endian
    }
    lut[0] = 0xffffffff;  // exactly zero (masked): white
    LUTS[mode] = lut;
  }
  const state = {layer: 0, head: 0, mode: "linear", geometry: null};

  function decode(text) {
    const raw = atob(text), out = new Uint8Array(raw.length);
    for (let i = 0; i < raw.length; i++) out[i] = raw.charCodeAt(i);
    return out;
  }
  function prepare(layer) {  // decoded on first use
    if (layer.bytes) return layer;
    layer.offsets = new Int32Array(layer.lengths.length + 1);
    layer.lengths.forEach((n, r) => { layer.offsets[r + 1] = layer.offsets[r] + n; });
    layer.bytes = layer.data.map(decode);
    layer.images = {};
    return layer;
  }
  const current = () => prepare(page.layers[state.layer]);
  function weight(layer, head, row, column) {
    const byte = column < layer.lengths[row] ? layer.bytes[head][layer.offsets[row] + column] : 0;
    return byte < 2 ? byte * SMALLEST / 2 : (byte / 255) * (byte / 255);  // byte 1: somewhere below SMALLEST
  }
  function image(layer, head) {  // the pattern at one pixel per cell, cached per head and colour scale
    const key = head + ":" + state.mode;
    if (layer.images[key]) return layer.images[key];
    const Q = layer.queries.length, K = layer.keys.length, bytes = layer.bytes[head], lut = LUTS[state.mode];
    const canvas = document.createElement("canvas");
    canvas.width = K; canvas.height = Q;
    const context = canvas.getContext("2d"), data = context.createImageData(K, Q);
    const pixels = new Uint32Array(data.data.buffer);
    pixels.fill(lut[0]);
    for (let r = 0; r < Q; r++) {
      const from = layer.offsets[r], n = layer.lengths[r], base = r * K;
      for (let c = 0; c < n; c++) pixels[base + c] = lut[bytes[from + c]];
    }
    context.putImageData(data, 0, 0);
    return (layer.images[key] = canvas);
  }
  function shown(token) { return token.replace(/ /g, "\u2423").replace(/\n/g, "\u23ce").replace(/\t/g, "\u21e5"); }
  function label(position, thinned) {
    const text = shown(page.tokens[position]);
    const cut = text.length > 16 ? text.slice(0, 15) + "\u2026" : text;
    return thinned ? position + " " + cut : cut;
  }

  function hover(event, head, row, column) {
    const layer = current();
    if (row < 0 || column < 0 || row >= layer.queries.length || column >= layer.keys.length) return hide();
    const q = layer.queries[row], k = layer.keys[column], w = weight(layer, head, row, column);
    const shown = w === 0 ? "0" : w < SMALLEST ? "< " + SMALLEST.toExponential(1) : w >= 0.001 ? w.toFixed(3) :
      w.toExponential(1);
    tip.textContent = "layer " + layer.layer + " \u00b7 head " + layer.heads[head] + "\nquery " + q + " " +
      JSON.stringify(page.tokens[q]) + "\nkey   " + k + " " + JSON.stringify(page.tokens[k]) + "\nweight " + shown;
    Object.assign(tip.dataset, {head: layer.heads[head], query: q, key: k, weight: w});
    tip.style.display = "block";
    tip.style.left = (event.clientX + 14) + "px";
    tip.style.top = (event.clientY + 14) + "px";
  }
  function hide() { tip.style.display = "none"; }
  function pointer(canvas, event) {  // canvas pixels under the pointer
    const box = canvas.getBoundingClientRect();
    return [(event.clientX - box.left) * canvas.width / box.width,
            (event.clientY - box.top) * canvas.height / box.height];
  }

  function renderGrid() {
    const layer = current(), Q = layer.queries.length, K = layer.keys.length;
    const [w, h] = K >= Q ? [THUMB, Math.max(6, Math.round(THUMB * Q / K))]
                          : [Math.max(6, Math.round(THUMB * K / Q)), THUMB];
    grid.textContent = "";
    layer.heads.forEach((name, i) => {
      const figure = document.createElement("figure"), canvas = document.createElement("canvas");
      canvas.className = "al-thumb"; canvas.width = w; canvas.height = h; canvas.dataset.head = name;
      const context = canvas.getContext("2d");
      context.imageSmoothingEnabled = K > w || Q > h;
      context.imageSmoothingQuality = "high";
      context.drawImage(image(layer, i), 0, 0, w, h);
      const caption = document.createElement("figcaption");
      caption.textContent = "head " + name;
      figure.append(canvas, caption);
      if (i === state.head) figure.classList.add("al-on");
      figure.addEventListener("click", () => select(state.layer, i));
      canvas.addEventListener("mousemove", (event) => {
        const [x, y] = pointer(canvas, event);
        hover(event, i, Math.floor(y * Q / h), Math.floor(x * K / w));
      });
      canvas.addEventListener("mouseleave", hide);
      grid.append(figure);
    });
    root.dataset.heads = layer.heads.length;
  }

  function renderLarge() {
    const layer = current(), Q = layer.queries.length, K = layer.keys.length;
    const fit = (n) => Math.max(1, Math.min(32, Math.floor(LARGE / n)));
    let cellW = fit(K), cellH = fit(Q);
    if (Q > 1 && K > 1) cellW = cellH = Math.min(cellW, cellH);
    const stepQ = Math.max(1, Math.ceil(13 / cellH)), stepK = Math.max(1, Math.ceil(13 / cellW));
    const context = big.getContext("2d");
    context.font = "11px monospace";
    const rows = [], columns = [];
    for (let r = 0; r < Q; r += stepQ) rows.push([r, label(layer.queries[r], stepQ > 1)]);
    for (let c = 0; c < K; c += stepK) columns.push([c, label(layer.keys[c], stepK > 1)]);
    const widest = (items) => Math.min(150, Math.max(0, ...items.map(([, t]) => context.measureText(t).width)));
    const left = 22 + widest(rows), top = 22 + widest(columns);
    big.width = left + K * cellW + 10;
    big.height = top + Q * cellH + 10;
    context.fillStyle = "#fff";
    context.fillRect(0, 0, big.width, big.height);
    context.imageSmoothingEnabled = false;
    context.drawImage(image(layer, state.head), left, top, K * cellW, Q * cellH);
    context.font = "11px monospace";
    context.fillStyle = "#333";
    context.textBaseline = "middle";
    context.textAlign = "right";
    for (const [r, text] of rows) context.fillText(text, left - 4, top + (r + 0.5) * cellH);
    context.save();
    context.rotate(-Math.PI / 2);
    context.textAlign = "left";
    for (const [c, text] of columns) context.fillText(text, -(top - 4), left + (c + 0.5) * cellW);
    context.restore();
    context.fillStyle = "#777";
    context.textAlign = "left";
    context.fillText("key \u2192", 2, 8);
    context.save();
    context.translate(8, top);
    context.rotate(Math.PI / 2);
    context.fillText("query \u2192", 0, 0);
    context.restore();
    state.geometry = {left, top, cellW, cellH, Q, K};
    root.dataset.head = layer.heads[state.head];
  }

  big.addEventListener("mousemove", (event) => {
    const g = state.geometry, [x, y] = pointer(big, event);
    hover(event, state.head, Math.floor((y - g.top) / g.cellH), Math.floor((x - g.left) / g.cellW));
  });
  big.addEventListener("mouseleave", hide);

  const layerSelect = $(".al-layer"), headSelect = $(".al-head");
  page.layers.forEach((layer, i) => layerSelect.add(new Option(String(layer.layer), i)));
  layerSelect.parentElement.style.display = page.layers.length > 1 ? "" : "none";
  layerSelect.addEventListener("change", () => select(Number(layerSelect.value), 0));
  headSelect.addEventListener("change", () => select(state.layer, Number(headSelect.value)));
  $(".al-sqrt").addEventListener("change", (event) => {
    state.mode = event.target.checked ? "sqrt" : "linear";
    select(state.layer, state.head);
  });

  function select(layerIndex, head) {
    const changed = layerIndex !== state.layer || !headSelect.options.length;
    state.layer = layerIndex; state.head = head;
    const layer = current();
    if (changed) {
      headSelect.textContent = "";
      layer.heads.forEach((name, i) => headSelect.add(new Option(String(name), i)));
    }
    layerSelect.value = layerIndex; headSelect.value = head;
    $(".al-meta").textContent = "layer " + layer.layer + " \u00b7 " + layer.heads.length + " heads \u00b7 " +
      layer.queries.length + " queries \u00d7 " + layer.keys.length + " keys \u00b7 weights to 8 bits " +
      "(square-root scale) \u00b7 click a head to enlarge it, hover a cell for its weight";
    Object.assign(root.dataset, {layer: layer.layer, tokens: page.tokens.length, queries: layer.queries.length,
                                 keys: layer.keys.length});
    renderGrid();
    renderLarge();
  }

  select(0, 0);
  root.dataset.renderMs = (performance.now() - started).toFixed(1);
  window.attnlens = window.attnlens || {};
  window.attnlens["ROOT_ID"] = {
    select,
    // the centre of cell (row, column) of the large canvas, in its own pixels
    cell: (row, column) => [state.geometry.left + (column + 0.5) * state.geometry.cellW,
                            state.geometry.top + (row + 0.5) * state.geometry.cellH],
  };
})();
"""
