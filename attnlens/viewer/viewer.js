(function () {
  "use strict";
  const started = performance.now();
  const root = document.getElementById("ROOT_ID");
  const page = JSON.parse(document.getElementById("ROOT_ID-data").textContent);
  const $ = (selector) => root.querySelector(selector);
  const grid = $(".al-grid"), big = $(".al-big"), map = $(".al-map"), tip = $(".al-tip");
  const THUMB = 160, LARGE = 720, SMALLEST = (1.5 / 255) ** 2;  // byte 1 holds every weight below SMALLEST
  const SIGNED_SMALLEST = (1.5 / 127) ** 2;  // of the largest contribution: what 128 +- 1 holds
  // ColorBrewer Blues, as matplotlib's "Blues" (attnlens.plot uses it too)
  const BLUES = [[247,251,255],[222,235,247],[198,219,239],[158,202,225],[107,174,214],[66,146,198],[33,113,181],
                 [8,81,156],[8,48,107]];
  // ColorBrewer RdBu reversed, as matplotlib's "RdBu_r" (the attribution plots use it): blue negative, red positive
  const RDBU = [[5,48,97],[33,102,172],[67,147,195],[146,197,222],[209,229,240],[247,247,247],[253,219,199],
                [244,165,130],[214,96,77],[178,24,43],[103,0,31]];
  function colour(anchors, x) {  // x in [0, 1]
    const f = x * (anchors.length - 1), i = Math.min(Math.floor(f), anchors.length - 2), t = f - i;
    return [0, 1, 2].map((j) => Math.round(anchors[i][j] + (anchors[i + 1][j] - anchors[i][j]) * t));
  }
  const rgba = ([r, g, b]) => ((255 << 24) | (b << 16) | (g << 8) | r) >>> 0;  // RGBA bytes, little-endian
  const LUTS = {}, SIGNED_LUTS = {};
  for (const mode of ["linear", "sqrt"]) {
    const lut = new Uint32Array(256), signed = new Uint32Array(256);
    for (let v = 0; v < 256; v++) {
      const s = v / 255;
      lut[v] = rgba(colour(BLUES, mode === "sqrt" ? s : s * s));
      const m = Math.min(Math.abs(v - 128) / 127, 1), shade = mode === "sqrt" ? m : m * m;
      signed[v] = rgba(colour(RDBU, (1 + Math.sign(v - 128) * shade) / 2));
    }
    lut[0] = signed[128] = 0xffffffff;  // exactly zero (masked, or no contribution): white
    LUTS[mode] = lut; SIGNED_LUTS[mode] = signed;
  }
  const state = {layer: 0, head: 0, row: 0, mode: "linear", geometry: null, mapGeometry: null, query: null};
  // matplotlib's "inferno", as attnlens.plot draws attention over images
  const INFERNO = [[0,0,4],[40,11,84],[101,21,110],[159,42,99],[212,72,66],[245,125,21],[250,193,39],[252,255,164]];

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
    if (layer.attribution) layer.attribution.bytes = layer.attribution.data.map(decode);
    return layer;
  }
  const current = () => prepare(page.layers[state.layer]);
  function weight(layer, head, row, column) {
    const byte = column < layer.lengths[row] ? layer.bytes[head][layer.offsets[row] + column] : 0;
    return byte < 2 ? byte * SMALLEST / 2 : (byte / 255) * (byte / 255);  // byte 1: somewhere below SMALLEST
  }
  function contribution(layer, head, row, column) {  // the attribution map's value, as the page knows it
    const found = layer.attribution, v = found.bytes[head][row * layer.keys.length + column] - 128, m = Math.abs(v);
    return Math.sign(v) * found.scale * (m < 2 ? m * SIGNED_SMALLEST / 2 : (m / 127) * (m / 127));
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
    showTip(event, "layer " + layer.layer + " \u00b7 head " + layer.heads[head] + "\nquery " + q + " " +
      JSON.stringify(page.tokens[q]) + "\nkey   " + k + " " + JSON.stringify(page.tokens[k]) + "\nweight " + shown,
      {head: layer.heads[head], query: q, key: k, weight: w});
  }
  const signed = (x) => (x > 0 ? "+" : "") + (x === 0 ? "0" : x.toPrecision(3));
  function hoverMap(event, row, column) {  // a cell of the attribution map: a query row, a source
    const layer = current();
    if (row < 0 || column < 0 || row >= page.attribution.rows.length || column >= layer.keys.length) return hide();
    const q = page.attribution.rows[row], k = layer.keys[column], c = contribution(layer, state.head, row, column);
    const small = Math.abs(c) > 0 && Math.abs(c) < SIGNED_SMALLEST * layer.attribution.scale;
    showTip(event, "layer " + layer.layer + " \u00b7 head " + layer.heads[state.head] + " \u00b7 " +
      page.attribution.what + "\nquery  " + q + " " + JSON.stringify(page.tokens[q]) + "\nsource " + k + " " +
      JSON.stringify(page.tokens[k]) + "\ncontribution " + (small ? (c > 0 ? "+" : "-") + "< " +
      (SIGNED_SMALLEST * layer.attribution.scale).toExponential(1) : signed(c)),
      {head: layer.heads[state.head], query: q, key: k, contribution: c});
  }
  function showTip(event, text, data) {
    tip.textContent = text;
    for (const key of Object.keys(tip.dataset)) delete tip.dataset[key];
    Object.assign(tip.dataset, data);
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
      if (layer.attribution) {  // the head's total over every source, as text and as a tint
        const totals = layer.attribution.totals[state.row], total = totals[i];
        const largest = Math.max(...totals.map(Math.abs)) || 1;
        caption.textContent += " \u00b7 " + signed(total);
        caption.dataset.total = total;
        const [r, g, b] = colour(RDBU, (1 + total / largest) / 2);
        caption.style.background = "rgb(" + r + "," + g + "," + b + ")";
        caption.style.color = Math.abs(total / largest) > 0.6 ? "#fff" : "#222";
      }
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
    for (const [r, q] of page.attribution ? page.attribution.rows.entries() : []) {  // the attributed rows
      const at = layer.queries.indexOf(q);
      context.strokeStyle = r === state.row ? "#e6550d" : "#fdae6b";
      if (at >= 0) context.strokeRect(left - 0.5, top + at * cellH - 0.5, K * cellW + 1, cellH + 1);
    }
    state.geometry = {left, top, cellW, cellH, Q, K};
    root.dataset.head = layer.heads[state.head];
    renderMap(left, cellW);
  }

  function renderMap(left, cellW) {  // under the large pattern, its key columns: the head's contribution by source
    const layer = current();
    map.style.display = layer.attribution ? "" : "none";
    if (!layer.attribution) return;
    const R = page.attribution.rows.length, K = layer.keys.length, cellH = Math.max(14, Math.min(24, cellW));
    const top = 20, bytes = layer.attribution.bytes[state.head], lut = SIGNED_LUTS[state.mode];
    const strip = document.createElement("canvas");
    strip.width = K; strip.height = R;
    const stripContext = strip.getContext("2d"), data = stripContext.createImageData(K, R);
    new Uint32Array(data.data.buffer).set(Array.from(bytes, (v) => lut[v]));
    stripContext.putImageData(data, 0, 0);
    map.width = left + K * cellW + 10;
    map.height = top + R * cellH + 6;
    const context = map.getContext("2d");
    context.fillStyle = "#fff";
    context.fillRect(0, 0, map.width, map.height);
    context.imageSmoothingEnabled = false;
    context.drawImage(strip, left, top, K * cellW, R * cellH);
    context.font = "11px monospace";
    context.textBaseline = "middle";
    context.fillStyle = "#777";
    context.textAlign = "left";
    context.fillText("head " + layer.heads[state.head] + "'s contribution to " + page.attribution.what +
      " by source (red +, blue \u2212; \u00b1" + layer.attribution.scale.toPrecision(3) + " darkest)", 2, 8);
    context.textAlign = "right";
    page.attribution.rows.forEach((q, r) => {
      context.fillStyle = r === state.row ? "#e6550d" : "#333";
      context.fillText(label(q, true), left - 4, top + (r + 0.5) * cellH);
    });
    state.mapGeometry = {left, top, cellW, cellH};
  }

  const images = $(".al-images"), pictures = (page.images || []).map((found) => {  // each drawn once, at its size
    const canvas = document.createElement("canvas"), raw = decode(found.rgb);
    canvas.width = found.width; canvas.height = found.height;
    const context = canvas.getContext("2d"), data = context.createImageData(found.width, found.height);
    for (let i = 0, j = 0; i < raw.length; i += 3, j += 4) {
      data.data[j] = raw[i]; data.data[j + 1] = raw[i + 1]; data.data[j + 2] = raw[i + 2]; data.data[j + 3] = 255;
    }
    context.putImageData(data, 0, 0);
    return canvas;
  });
  function renderImages() {  // the enlarged head's attention from one query row over each image (each view) shown
    if (!pictures.length) return;
    const layer = current(), column = new Map(layer.keys.map((k, c) => [k, c]));
    const row = state.query === null || state.query >= layer.queries.length ? layer.queries.length - 1 : state.query;
    const q = layer.queries[row];
    images.textContent = "";
    page.images.forEach((found, i) => {
      const weights = found.positions.map((k) => (column.has(k) ? weight(layer, state.head, row, column.get(k)) : 0));
      const largest = Math.max(...weights) || 1;
      const figure = document.createElement("figure"), canvas = document.createElement("canvas");
      canvas.className = "al-image"; canvas.width = found.width; canvas.height = found.height;
      canvas.dataset.image = i;
      const context = canvas.getContext("2d");
      context.drawImage(pictures[i], 0, 0);
      const cellW = found.width / found.cols, cellH = found.height / found.rows;
      weights.forEach((w, t) => {
        const [r, g, b] = colour(INFERNO, w / largest);
        context.fillStyle = "rgba(" + r + "," + g + "," + b + ",0.6)";
        context.fillRect((t % found.cols) * cellW, Math.floor(t / found.cols) * cellH, cellW, cellH);
      });
      canvas.addEventListener("mousemove", (event) => {
        const [x, y] = pointer(canvas, event);
        const r = Math.floor(y / cellH), c = Math.floor(x / cellW), t = r * found.cols + c;
        if (r < 0 || c < 0 || r >= found.rows || c >= found.cols) return hide();
        const k = found.positions[t], w = weights[t];
        const place = found.video ? {image: found.image, frame: found.view} : {image: found.image, view: found.view};
        showTip(event, "layer " + layer.layer + " \u00b7 head " + layer.heads[state.head] + "\nquery " + q + " " +
          JSON.stringify(page.tokens[q]) + "\n" + found.name + " row " + r + " col " + c + " (key " + k + ")\nweight " +
          (w >= 0.001 ? w.toFixed(3) : w.toExponential(1)), {...place, row: r, col: c, key: k, weight: w});
      });
      canvas.addEventListener("mouseleave", hide);
      const caption = document.createElement("figcaption");
      caption.textContent = found.name + " \u00b7 head " + layer.heads[state.head] + " from query " + q + " " +
        JSON.stringify(page.tokens[q]) + " \u00b7 brightest " + largest.toFixed(3) + " (hover a row above to move)";
      figure.append(canvas, caption);
      images.append(figure);
    });
    root.dataset.imageQuery = q;
  }

  big.addEventListener("mousemove", (event) => {
    const g = state.geometry, [x, y] = pointer(big, event);
    const row = Math.floor((y - g.top) / g.cellH);
    hover(event, state.head, row, Math.floor((x - g.left) / g.cellW));
    if (pictures.length && row >= 0 && row < g.Q && row !== state.query) { state.query = row; renderImages(); }
  });
  big.addEventListener("mouseleave", hide);
  map.addEventListener("mousemove", (event) => {
    const g = state.mapGeometry, [x, y] = pointer(map, event);
    hoverMap(event, Math.floor((y - g.top) / g.cellH), Math.floor((x - g.left) / g.cellW));
  });
  map.addEventListener("mouseleave", hide);

  const layerSelect = $(".al-layer"), headSelect = $(".al-head");
  page.layers.forEach((layer, i) => layerSelect.add(new Option(String(layer.layer), i)));
  layerSelect.parentElement.style.display = page.layers.length > 1 ? "" : "none";
  layerSelect.addEventListener("change", () => select(Number(layerSelect.value), 0));
  headSelect.addEventListener("change", () => select(state.layer, Number(headSelect.value)));
  const rowSelect = $(".al-row"), rows = page.attribution ? page.attribution.rows : [];
  rows.forEach((q, r) => rowSelect.add(new Option(q + " " + label(q, false), r)));
  rowSelect.parentElement.style.display = rows.length > 1 ? "" : "none";
  rowSelect.addEventListener("change", () => { state.row = Number(rowSelect.value); select(state.layer, state.head); });
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
    if (page.attribution) {
      const r = state.row, q = page.attribution.rows[r];
      $(".al-attribution").textContent = "attribution: " + page.attribution.what + " at query " + q + " " +
        JSON.stringify(page.tokens[q]) + " = " + page.attribution.values[r].toPrecision(4) + " \u00b7 under the " +
        "head: its contribution by source (8 bits, signed square-root scale of the layer's largest) \u00b7 in the " +
        "grid: each head's total over every source \u00b7 " + page.attribution.notes.join("; ");
      root.dataset.row = q;
    }
    renderGrid();
    renderLarge();
    renderImages();
  }

  select(0, 0);
  root.dataset.renderMs = (performance.now() - started).toFixed(1);
  window.attnlens = window.attnlens || {};
  window.attnlens["ROOT_ID"] = {
    select,
    // the centre of cell (row, column) of the large canvas, in its own pixels
    cell: (row, column) => [state.geometry.left + (column + 0.5) * state.geometry.cellW,
                            state.geometry.top + (row + 0.5) * state.geometry.cellH],
    // the centre of cell (attributed row, column) of the attribution map, in its own pixels
    mapCell: (row, column) => [state.mapGeometry.left + (column + 0.5) * state.mapGeometry.cellW,
                               state.mapGeometry.top + (row + 0.5) * state.mapGeometry.cellH],
    // the centre of token (row, column) of the `i`-th image shown (each view of an image, each frame of a video, in
    // order), in that image canvas's own pixels
    patch: (i, row, column) => [(column + 0.5) * page.images[i].width / page.images[i].cols,
                                (row + 0.5) * page.images[i].height / page.images[i].rows],
  };
})();
