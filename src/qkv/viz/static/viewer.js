(() => {
  "use strict";
  const data = JSON.parse(document.getElementById("qkv-data").textContent);
  const $ = (id) => document.getElementById(id);
  const LQ = data.lq, LK = data.lk, H = data.heads, NL = data.layers.length;
  const ROW = 18;
  const viewer = { ready: false, renders: 0, lastRenderMs: 0 };
  window.qkvViewer = viewer;
  const state = {
    layer: data.initial.layer, head: data.initial.head, view: data.initial.view,
    focus: data.initial.token === null ? null : { side: "q", index: data.initial.token },
    pinned: data.initial.token !== null,
  };
  viewer.state = state;
  let W = null;        // Uint8Array: layers x heads x LQ x LK, weight * 255
  let blocked = null;  // Uint8Array: LQ x LK, 1 where the mask blocks
  const LUT = colorRamp();

  function colorRamp() {  // white -> deep blue, 256 steps, as [r, g, b] triplets
    const stops = [[255, 255, 255], [198, 219, 239], [107, 174, 214], [33, 113, 181],
      [8, 48, 107]];
    const out = new Uint8Array(256 * 3);
    for (let i = 0; i < 256; i++) {
      const t = i / 255 * (stops.length - 1), a = Math.floor(Math.min(t, stops.length - 2));
      const f = t - a;
      for (let c = 0; c < 3; c++) {
        out[i * 3 + c] = Math.round(stops[a][c] * (1 - f) + stops[a + 1][c] * f);
      }
    }
    return out;
  }

  async function inflate(b64) {
    const text = atob(b64), bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Uint8Array(await new Response(stream).arrayBuffer());
  }

  const offset = (layer, head) => (layer * H + head) * LQ * LK;
  const weight = (i, j) => W[offset(state.layer, state.head) + i * LK + j] / 255;
  const label = (side, i) => (side === "q" ? data.queryTokens : data.keyTokens)[i];

  function fmt(w) { return w >= 0.001 || w === 0 ? w.toFixed(3) : "<0.001"; }

  // --- controls -----------------------------------------------------------------------------
  function option(select, value, text) {
    const o = document.createElement("option");
    o.value = String(value);
    o.textContent = text;
    select.appendChild(o);
  }

  function buildControls() {
    $("title").textContent = data.title;
    $("subtitle").textContent = data.subtitle;
    document.title = data.title + " \u00b7 qkv attention viewer";
    data.layers.forEach((name, i) => option($("layer"), i, name));
    for (let h = 0; h < H; h++) option($("head"), h, "head " + h);
    $("layer").addEventListener("change", () => select(+$("layer").value, state.head));
    $("head").addEventListener("change", () => select(state.layer, +$("head").value));
    for (const tab of document.querySelectorAll(".tabs button")) {
      tab.addEventListener("click", () => showView(tab.dataset.view));
    }
    $("footer-size").textContent = LQ + (LQ === LK ? "" : " \u00d7 " + LK) + " tokens \u00b7 " +
      NL + (NL === 1 ? " layer" : " layers") + " \u00d7 " + H + (H === 1 ? " head" : " heads");
  }

  function select(layer, head) {
    state.layer = layer;
    state.head = head;
    $("layer").value = String(layer);
    $("head").value = String(head);
    renderHead();
    markCurrentThumb();
  }

  function showView(view) {
    state.view = view;
    for (const tab of document.querySelectorAll(".tabs button")) {
      tab.setAttribute("aria-selected", String(tab.dataset.view === view));
    }
    $("head-view").hidden = view !== "head";
    $("model-view").hidden = view !== "model";
    if (view === "model") renderModel();
    else { sizeLines(); drawLines(); }
  }

  // --- head view: tokens, lines, matrix -------------------------------------------------------
  const tokenEls = { q: [], k: [] };
  // The lines canvas only covers the visible part of the (scrolling) token columns and is
  // redrawn on scroll: a canvas as tall as 512 tokens would be slow to draw.
  let linesCanvas, links = [], linesW = 180, viewH = 0, dpr = 1, scrollQueued = false;
  const y = (i) => i * ROW + ROW / 2;

  function buildTokens() {
    for (const side of ["q", "k"]) {
      const column = $(side === "q" ? "tokens-q" : "tokens-k");
      const labels = side === "q" ? data.queryTokens : data.keyTokens;
      const frag = document.createDocumentFragment();
      labels.forEach((text, i) => {
        const el = document.createElement("div");
        el.className = "tok";
        el.textContent = text;
        el.title = (side === "q" ? "query " : "key ") + i + ": " + text;
        el.dataset.side = side;
        el.dataset.index = String(i);
        frag.appendChild(el);
        tokenEls[side].push(el);
      });
      column.appendChild(frag);
      column.addEventListener("mouseover", (e) => {
        const el = e.target.closest(".tok");
        if (el && !state.pinned) setFocus(el.dataset.side, +el.dataset.index);
      });
      column.addEventListener("click", (e) => {
        const el = e.target.closest(".tok");
        if (!el) return;
        const same = state.focus && state.focus.side === el.dataset.side &&
          state.focus.index === +el.dataset.index;
        state.pinned = !(same && state.pinned);
        setFocus(el.dataset.side, +el.dataset.index);
      });
    }
    $("lines-grid").addEventListener("mouseleave", () => { if (!state.pinned) setFocus(null); });
    linesCanvas = $("lines");
    $("lines-col").style.height = Math.max(LQ, LK) * ROW + "px";
    $("lines-wrap").addEventListener("scroll", () => {
      if (scrollQueued) return;
      scrollQueued = true;
      requestAnimationFrame(() => { scrollQueued = false; drawLines(); });
    });
    window.addEventListener("resize", () => { sizeLines(); drawLines(); });
  }

  function sizeLines() {
    viewH = Math.max(ROW, Math.min(Math.max(LQ, LK) * ROW, $("lines-wrap").clientHeight));
    dpr = Math.min(window.devicePixelRatio || 1, 2);
    linesCanvas.width = Math.round(linesW * dpr);
    linesCanvas.height = Math.round(viewH * dpr);
    linesCanvas.style.width = linesW + "px";
    linesCanvas.style.height = viewH + "px";
  }

  function collectLinks() {
    // Every link of the head above a small weight as [i, j, weight x 255]; for long inputs only
    // each query's strongest few, so that the picture stays readable and fast.
    links = [];
    const base = offset(state.layer, state.head), threshold = 4;  // weight >= about 0.016
    const most = LK <= 64 ? LK : 8;
    for (let i = 0; i < LQ; i++) {
      const row = base + i * LK;
      let keys = [];
      for (let j = 0; j < LK; j++) if (W[row + j] >= threshold) keys.push(j);
      if (keys.length > most) keys = keys.sort((a, b) => W[row + b] - W[row + a]).slice(0, most);
      for (const j of keys) links.push([i, j, W[row + j]]);
    }
  }

  function drawLines() {
    const ctx = linesCanvas.getContext("2d"), top = $("lines-wrap").scrollTop;
    const bottom = top + viewH;
    const crosses = (a, b) => Math.max(a, b) >= top && Math.min(a, b) <= bottom;
    ctx.setTransform(1, 0, 0, 1, 0, 0);
    ctx.clearRect(0, 0, linesCanvas.width, linesCanvas.height);
    ctx.setTransform(dpr, 0, 0, dpr, 0, -top * dpr);
    const f = state.focus, levels = 16, paths = Array.from({ length: levels }, () => new Path2D());
    for (const [i, j, w] of links) {
      if (!crosses(y(i), y(j))) continue;
      const p = paths[Math.min(levels - 1, Math.floor(w / 256 * levels))];
      p.moveTo(0, y(i));
      p.lineTo(linesW, y(j));
    }
    ctx.lineWidth = 1.2;
    paths.forEach((p, level) => {  // one stroke per strength level: opacity = weight
      const alpha = (0.08 + 0.85 * (level + 0.5) / levels) * (f ? 0.15 : 1);
      ctx.strokeStyle = "rgba(37, 89, 214, " + alpha.toFixed(3) + ")";
      ctx.stroke(p);
    });
    if (!f) return;
    const peak = focusPeak(f), count = f.side === "q" ? LK : LQ;
    ctx.lineWidth = 2;
    for (let n = 0; n < count; n++) {
      const w = f.side === "q" ? weight(f.index, n) : weight(n, f.index);
      const i = f.side === "q" ? f.index : n, j = f.side === "q" ? n : f.index;
      if (w <= 0 || w / peak < 0.02 || !crosses(y(i), y(j))) continue;
      ctx.strokeStyle = "rgba(245, 120, 11, " + (0.15 + 0.85 * w / peak).toFixed(3) + ")";
      ctx.beginPath();
      ctx.moveTo(0, y(i));
      ctx.lineTo(linesW, y(j));
      ctx.stroke();
    }
  }

  function focusPeak(f) {
    let peak = 0;
    const count = f.side === "q" ? LK : LQ;
    for (let n = 0; n < count; n++) {
      peak = Math.max(peak, f.side === "q" ? weight(f.index, n) : weight(n, f.index));
    }
    return peak || 1;
  }
  let highlighted = [];
  function highlightTokens() {
    for (const el of highlighted) { el.style.backgroundColor = ""; el.classList.remove("focus"); }
    highlighted = [];
    const f = state.focus, info = $("focus-info");
    info.textContent = "";
    if (!f) {
      const hint = document.createElement("span");
      hint.className = "muted";
      hint.textContent = "Hover a token to see where it looks (left: as a query) or who looks at" +
        " it (right: as a key). Click to pin.";
      info.appendChild(hint);
      return;
    }
    const own = tokenEls[f.side][f.index];
    own.classList.add("focus");
    highlighted.push(own);
    const other = f.side === "q" ? "k" : "q", peak = focusPeak(f), ranked = [];
    tokenEls[other].forEach((el, n) => {
      const w = f.side === "q" ? weight(f.index, n) : weight(n, f.index);
      ranked.push([w, n]);
      if (w <= 0) return;
      el.style.backgroundColor = "rgba(245, 158, 11, " + (0.9 * w / peak).toFixed(3) + ")";
      highlighted.push(el);
    });
    ranked.sort((a, b) => b[0] - a[0]);
    const head = document.createElement("strong");
    head.textContent = "\u201c" + label(f.side, f.index) + "\u201d";
    info.appendChild(head);
    info.appendChild(document.createTextNode(f.side === "q"
      ? " (query " + f.index + ") attends most to: "
      : " (key " + f.index + ") is attended most by: "));
    const top = ranked.slice(0, 5).filter((r) => r[0] > 0);
    info.appendChild(document.createTextNode(top.map(([w, n]) =>
      "\u201c" + label(other, n) + "\u201d (" + n + ") " + fmt(w)).join(", ") ||
      "nothing (masked)"));
  }

  function setFocus(side, index) {
    state.focus = side === null ? null : { side, index };
    if (side === null) state.pinned = false;
    drawLines();
    highlightTokens();
    drawOverlay(null);
  }

  // matrix
  let matrix, overlay, cell = 1;
  function buildMatrix() {
    matrix = $("matrix");
    overlay = $("matrix-overlay");
    const box = Math.min(480, Math.max(240, Math.max(LQ, LK) * 14));
    cell = box / Math.max(LQ, LK);
    matrix.width = Math.min(LK, Math.ceil(box));  // at most one pixel per screen pixel
    matrix.height = Math.min(LQ, Math.ceil(box));
    matrix.style.width = LK * cell + "px";
    matrix.style.height = LQ * cell + "px";
    const ratio = Math.min(window.devicePixelRatio || 1, 2);
    overlay.width = Math.round(LK * cell * ratio);
    overlay.height = Math.round(LQ * cell * ratio);
    overlay.style.width = LK * cell + "px";
    overlay.style.height = LQ * cell + "px";
    overlay.getContext("2d").setTransform(ratio, 0, 0, ratio, 0, 0);
    overlay.addEventListener("mousemove", (e) => {
      const r = overlay.getBoundingClientRect();
      const j = Math.floor((e.clientX - r.left) / cell), i = Math.floor((e.clientY - r.top) / cell);
      if (i < 0 || j < 0 || i >= LQ || j >= LK) return;
      const tip = $("tip");
      tip.textContent = "query " + i + " \u201c" + label("q", i) + "\u201d \u2192 key " + j +
        " \u201c" + label("k", j) + "\u201d: " +
        (blocked && blocked[i * LK + j] ? "blocked by the mask" : fmt(weight(i, j)));
      tip.style.display = "block";
      tip.style.left = e.clientX + 14 + "px";
      tip.style.top = e.clientY + 12 + "px";
      drawOverlay([i, j]);
    });
    overlay.addEventListener("mouseleave", () => { $("tip").style.display = "none";
      drawOverlay(null); });
    overlay.addEventListener("click", (e) => {
      const r = overlay.getBoundingClientRect();
      const i = Math.floor((e.clientY - r.top) / cell);
      if (i >= 0 && i < LQ) { state.pinned = true; setFocus("q", i); }
    });
    const bar = $("legend-bar"), ctx = bar.getContext("2d"), img = ctx.createImageData(256, 1);
    for (let i = 0; i < 256; i++) {
      img.data.set([LUT[i * 3], LUT[i * 3 + 1], LUT[i * 3 + 2], 255], i * 4);
    }
    bar.width = 256;
    bar.height = 1;
    ctx.putImageData(img, 0, 0);
    $("legend-blocked").hidden = !blocked;
  }

  function paint(ctx, layer, head, w, h) {
    // One head's weights into a w x h ImageData; shrinking keeps each block's largest weight
    // so that sharp peaks stay visible.
    const img = ctx.createImageData(w, h);
    const base = offset(layer, head);
    let peak = 1;
    for (let n = base; n < base + LQ * LK; n++) if (W[n] > peak) peak = W[n];
    const px = img.data;
    for (let y = 0; y < h; y++) {
      const i0 = Math.floor(y * LQ / h), i1 = Math.max(i0 + 1, Math.floor((y + 1) * LQ / h));
      for (let x = 0; x < w; x++) {
        const j0 = Math.floor(x * LK / w), j1 = Math.max(j0 + 1, Math.floor((x + 1) * LK / w));
        let best = 0, open = false;
        for (let i = i0; i < i1; i++) {
          const row = base + i * LK;
          for (let j = j0; j < j1; j++) {
            if (W[row + j] > best) best = W[row + j];
            if (!blocked || !blocked[i * LK + j]) open = true;
          }
        }
        const o = (y * w + x) * 4;
        if (!open) { px[o] = 230; px[o + 1] = 230; px[o + 2] = 230; px[o + 3] = 255; continue; }
        const t = Math.min(255, Math.round(best / peak * 255)) * 3;
        px[o] = LUT[t]; px[o + 1] = LUT[t + 1]; px[o + 2] = LUT[t + 2]; px[o + 3] = 255;
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  function drawOverlay(hover) {
    const ctx = overlay.getContext("2d");
    ctx.clearRect(0, 0, LK * cell, LQ * cell);
    const f = state.focus;
    ctx.lineWidth = Math.max(1.5, Math.min(cell / 3, 2.5));
    if (f) {
      ctx.strokeStyle = "rgba(245, 120, 11, 0.95)";
      if (f.side === "q") ctx.strokeRect(0, f.index * cell, LK * cell, cell);
      else ctx.strokeRect(f.index * cell, 0, cell, LQ * cell);
    }
    if (hover) {
      ctx.strokeStyle = "rgba(16, 24, 40, 0.9)";
      ctx.strokeRect(hover[1] * cell, hover[0] * cell, cell, cell);
    }
  }

  function renderHead() {
    const start = performance.now();
    collectLinks();
    drawLines();
    highlightTokens();
    paint(matrix.getContext("2d"), state.layer, state.head, matrix.width, matrix.height);
    drawOverlay(null);
    $("head-title").textContent = data.layers[state.layer] + ", head " + state.head;
    viewer.renders += 1;
    viewer.lastRenderMs = performance.now() - start;
  }

  // --- model view: layers x heads thumbnails --------------------------------------------------
  let modelBuilt = false;
  const thumbs = [];
  function renderModel() {
    if (modelBuilt) { markCurrentThumb(); return; }
    modelBuilt = true;
    const grid = $("model-grid");
    const room = Math.max(320, (grid.parentElement.clientWidth || 900) - 90);
    const size = Math.max(36, Math.min(96, Math.floor(room / H) - 6));
    const pixels = Math.min(size, Math.max(LQ, LK));
    grid.style.gridTemplateColumns = "max-content repeat(" + H + ", " + size + "px)";
    grid.appendChild(document.createElement("div"));
    for (let h = 0; h < H; h++) {
      const name = document.createElement("div");
      name.className = "colname";
      name.textContent = "head " + h;
      grid.appendChild(name);
    }
    for (let l = 0; l < NL; l++) {
      const name = document.createElement("div");
      name.className = "rowname";
      name.textContent = data.layers[l];
      grid.appendChild(name);
      for (let h = 0; h < H; h++) {
        const c = document.createElement("canvas");
        c.width = pixels;
        c.height = pixels;
        c.style.width = size + "px";
        c.style.height = size + "px";
        c.title = data.layers[l] + ", head " + h + " \u2014 click to open";
        paint(c.getContext("2d"), l, h, pixels, pixels);
        c.addEventListener("click", () => { select(l, h); showView("head"); });
        grid.appendChild(c);
        thumbs.push([l, h, c]);
      }
    }
    markCurrentThumb();
  }

  function markCurrentThumb() {
    for (const [l, h, c] of thumbs) {
      c.classList.toggle("current", l === state.layer && h === state.head);
    }
  }

  async function main() {
    try {
      if (typeof DecompressionStream === "undefined") {
        throw new Error("this browser cannot decompress the embedded weights " +
          "(DecompressionStream is missing); open the file in a current browser");
      }
      W = await inflate(data.weights);
      if (W.length !== NL * H * LQ * LK) throw new Error("the embedded weights are damaged");
      blocked = data.blocked ? await inflate(data.blocked) : null;
      buildControls();
      buildTokens();
      buildMatrix();
      sizeLines();
      select(state.layer, state.head);
      showView(state.view);
      if (state.focus) {  // open on the focus token, scrolled into view
        const wrap = $("lines-wrap");
        wrap.scrollTop = Math.max(0, y(state.focus.index) - wrap.clientHeight / 2);
        setFocus(state.focus.side, state.focus.index);
      }
      viewer.ready = true;
      document.documentElement.dataset.ready = "true";
    } catch (error) {
      const box = $("error");
      box.textContent = "The attention viewer could not start: " + error.message;
      box.style.display = "block";
      document.documentElement.dataset.ready = "error";
      throw error;
    }
  }
  main();
})();
