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
