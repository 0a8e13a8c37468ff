// attnreg head view: draws the data embedded in #attnreg-data (see attnreg/analysis/head_view.py). No network.
(function () {
  "use strict";
  const D = JSON.parse(document.getElementById("attnreg-data").textContent);
  const M = D.models, L = M.length ? M[0].layers : 0, H = M.length ? M[0].heads : 0;
  const COLORS = ["rgba(25,90,210,", "rgba(225,110,0,"];
  const S = { doc: 0, layer: 0, head: 0, stat: "entropy", grid: "0", arcs: "view", query: -1 };
  const cache = {};
  const el = (tag, attrs, text) => {
    const e = document.createElement(tag);
    for (const k in attrs || {}) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const fmt = (v) => (v === null || v === undefined || Number.isNaN(v) ? "\u2014" : v.toFixed(6));

  // -- decoding the base64 typed arrays ------------------------------------------------------------------
  function bytes(s) {
    const b = atob(s), out = new Uint8Array(b.length);
    for (let i = 0; i < b.length; i++) out[i] = b.charCodeAt(i);
    return out;
  }
  function arrays(d, m) {
    const id = d + ":" + m;
    if (cache[id]) return cache[id];
    const a = D.documents[d].models[m];
    const keys = bytes(a.keys).buffer;
    const scale = new Float32Array(bytes(a.received_scale).buffer), raw = bytes(a.received);
    const T = D.documents[d].tokens.length, received = new Float32Array(raw.length);
    for (let i = 0; i < raw.length; i++) received[i] = (raw[i] / 255) ** 2 * scale[Math.floor(i / T)];
    cache[id] = {
      k: a.top_k, keys: a.index === "u16" ? new Uint16Array(keys) : new Uint32Array(keys),
      weights: bytes(a.weights), received: received, scale: scale,
      parents: new Int16Array(bytes(a.parents).buffer),
    };
    return cache[id];
  }

  // -- page ----------------------------------------------------------------------------------------------
  const statNames = D.statistics.concat(["parent_accuracy", "reverse_parent_accuracy", "importance"])
    .filter((n) => M.some((m) => m.statistics[n]));
  const labels = { entropy: "entropy (normalized)", to_first: "sink share (first token)", distance: "mean distance",
    to_previous: "previous token", to_next: "next token", parent_accuracy: "parent accuracy",
    reverse_parent_accuracy: "parent accuracy (head to dependent)", importance: "importance" };
  document.body.appendChild(el("h1", {}, D.title));
  const notes = el("div", { id: "notes" });
  D.notes.forEach((n) => notes.appendChild(el("div", {}, n)));
  document.body.appendChild(notes);
  const controls = el("div", { id: "controls" });
  function select(id, label, options) {
    const s = el("select", { id: id });
    options.forEach(([v, t]) => s.appendChild(el("option", { value: v }, t)));
    const l = el("label", {}, label + " ");
    l.appendChild(s);
    controls.appendChild(l);
    return s;
  }
  const docSel = select("doc", "document", D.documents.map((d, i) => [i, (i + 1) + ". " + d.title]));
  const statSel = select("stat", "colour by", statNames.map((n) => [n, labels[n] || n.replace(/_/g, " ")]));
  const gridOpts = M.map((m, i) => [String(i), m.name]);
  if (M.length > 1) gridOpts.push(["diff", "difference: " + M[0].name + " \u2212 " + M[1].name]);
  const gridSel = select("gridmode", "grid", gridOpts);
  const arcSel = select("arcmode", "arcs", [["view", "every query in view"], ["pointer", "query under the pointer"]]);
  document.body.appendChild(controls);
  const main = el("div", { id: "main" }), left = el("div", { id: "left" }), right = el("div", { id: "right" });
  const grid = el("div", { id: "grid", class: "grid" }), legend = el("div", { id: "legend" });
  const table = el("table", { id: "headstats" });
  left.append(grid, legend, table);
  const title = el("div", { id: "headtitle" }), strip = el("canvas", { id: "strip" });
  const box = el("div", { id: "textbox" }), spacer = el("div", { id: "spacer" }), text = el("canvas", { id: "text" });
  const parseBox = el("div", { id: "parsebox" });
  box.append(text, spacer);
  right.append(title, strip, box, parseBox);
  main.append(left, right);
  document.body.appendChild(main);

  // -- the grid ------------------------------------------------------------------------------------------
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function ramp(t) {
    t = Math.max(0, Math.min(1, t)) * (VIRIDIS.length - 1);
    const i = Math.min(Math.floor(t), VIRIDIS.length - 2), f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return "rgb(" + a.map((x, j) => Math.round(x + f * (b[j] - x))).join(",") + ")";
  }
  function diverging(t) { // -1 blue .. 0 white .. 1 red
    const c = t < 0 ? [40, 90, 200] : [200, 40, 40], f = Math.min(1, Math.abs(t));
    return "rgb(" + c.map((x) => Math.round(255 + f * (x - 255))).join(",") + ")";
  }
  const value = (m, stat, l, h) => { const g = M[m].statistics[stat]; return g ? g[l][h] : null; };
  const unit = (s) => /^(entropy|to_|argmax_|parent_accuracy|reverse_parent)/.test(s);
  function cellValue(l, h) {
    if (S.grid !== "diff") return value(+S.grid, S.stat, l, h);
    const a = value(0, S.stat, l, h), b = value(1, S.stat, l, h);
    return a === null || b === null ? null : a - b;
  }
  const grouped = (l) => M[0].groups[l].some((g, h) => h > 0 && g === M[0].groups[l][h - 1]); // shared keys
  function drawGrid() {
    grid.textContent = "";
    grid.style.gridTemplateColumns = "auto repeat(" + H + ", auto)";
    const m = S.grid === "diff" ? 0 : +S.grid, info = M[m];
    grid.appendChild(el("div", { class: "lab" }, "layer \\ head"));
    for (let h = 0; h < H; h++) {
      const g = info.groups[0][h], start = grouped(0) && h > 0 && info.groups[0][h - 1] !== g;
      grid.appendChild(el("div", { class: "hn" + (start ? " g" : ""), title: "key/value group " + g }, h));
    }
    let lo = Infinity, hi = -Infinity;
    for (let l = 0; l < L; l++) for (let h = 0; h < H; h++) {
      const v = cellValue(l, h);
      if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
    }
    const span = Math.max(Math.abs(lo), Math.abs(hi)) || 1;
    if (S.grid !== "diff" && unit(S.stat)) { lo = 0; hi = 1; }
    for (let l = 0; l < L; l++) {
      grid.appendChild(el("div", { class: "lab" }, "L" + l));
      for (let h = 0; h < H; h++) {
        const g = info.groups[l][h], start = grouped(l) && h > 0 && info.groups[l][h - 1] !== g, v = cellValue(l, h);
        let cls = "cell" + (start ? " g" : "");
        for (const k of ["removed", "silenced", "supervised"]) if (M.some((x) => x[k][l][h])) cls += " " + k;
        if (l === S.layer && h === S.head) cls += " chosen";
        const c = el("div", { class: cls, "data-layer": l, "data-head": h,
          title: "L" + l + "H" + h + " (key/value group " + g + "): " + fmt(v) });
        c.style.background = v === null ? "#eee" : S.grid === "diff" ? diverging(v / span) : ramp((v - lo) / ((hi - lo) || 1));
        c.addEventListener("click", () => choose(l, h));
        grid.appendChild(c);
      }
    }
    legend.textContent = S.grid === "diff" ? "blue: " + M[1].name + " higher, red: " + M[0].name + " higher (\u00b1" +
      span.toPrecision(3) + "). " : "colour: " + (lo === Infinity ? "no values" : lo.toPrecision(3) + " to " + hi.toPrecision(3)) + ". ";
    legend.appendChild(document.createTextNode("\u2605 supervised, dashed: silenced, hatched: removed; " +
      "a gap separates key/value groups."));
  }

  function drawTable() {
    table.textContent = "";
    const head = el("tr");
    head.appendChild(el("th", {}, "L" + S.layer + "H" + S.head));
    M.forEach((m) => head.appendChild(el("th", {}, m.name)));
    if (M.length > 1) head.appendChild(el("th", {}, "difference"));
    table.appendChild(head);
    for (const n of statNames) {
      const row = el("tr");
      row.appendChild(el("td", {}, labels[n] || n.replace(/_/g, " ")));
      const vs = M.map((m, i) => value(i, n, S.layer, S.head));
      vs.forEach((v, i) => row.appendChild(el("td", { class: "value", "data-model": i, "data-stat": n }, fmt(v))));
      if (M.length > 1) row.appendChild(el("td", {}, vs[0] === null || vs[1] === null ? "\u2014" : fmt(vs[0] - vs[1])));
      table.appendChild(row);
    }
  }

  // -- the text with arcs ----------------------------------------------------------------------------------
  const LINE = 24, PAD = 6;
  let layout = null;
  function layoutText() {
    const doc = D.documents[S.doc], ctx = text.getContext("2d"), width = box.clientWidth - 16;
    ctx.font = "13px system-ui, sans-serif";
    const pos = [];
    let x = PAD, y = LINE + 8;
    doc.tokens.forEach((t) => {
      const w = ctx.measureText(t).width + 6;
      if (x + w > width && x > PAD) { x = PAD; y += LINE * 2; }
      pos.push([x, y, w]);
      x += w + 2;
    });
    layout = { pos: pos, height: y + LINE, width: width };
    box.style.height = Math.min(380, layout.height + 4) + "px";
    spacer.style.height = Math.max(0, layout.height - box.clientHeight) + "px";
  }
  function arcsOf(m, i) {
    const a = arrays(S.doc, m), T = D.documents[S.doc].tokens.length, out = [];
    if (!M[m].present[S.layer][S.head]) return out;
    const base = ((S.layer * H + S.head) * T + i) * a.k;
    for (let s = 0; s < a.k; s++) if (a.weights[base + s] > 0) out.push([a.keys[base + s], a.weights[base + s] / 255]);
    return out;
  }
  function drawText() {
    if (!layout) layoutText();
    const dpr = window.devicePixelRatio || 1, w = layout.width, h = Math.min(box.clientHeight, layout.height);
    text.width = w * dpr; text.height = h * dpr; text.style.width = w + "px"; text.style.height = h + "px";
    const ctx = text.getContext("2d"), top = box.scrollTop, T = D.documents[S.doc].tokens.length;
    ctx.setTransform(dpr, 0, 0, dpr, 0, -top * dpr);
    ctx.font = "13px system-ui, sans-serif";
    ctx.textBaseline = "middle";
    const rec = arrays(S.doc, 0), off = (S.layer * H + S.head) * T, sc = rec.scale[S.layer * H + S.head] || 1;
    const visible = [];
    layout.pos.forEach(([x, y, tw], i) => {
      if (y < top - LINE * 2 || y > top + h + LINE * 2) return;
      visible.push(i);
      ctx.fillStyle = "rgba(240,160,0," + (0.6 * rec.received[off + i] / sc).toFixed(3) + ")";
      ctx.fillRect(x, y - 9, tw, 18);
      ctx.fillStyle = i === S.query ? "#e0007a" : "#222";
      ctx.fillText(D.documents[S.doc].tokens[i], x + 3, y);
    });
    const queries = S.arcs === "pointer" ? (S.query >= 0 ? [S.query] : []) : visible;
    const alpha = S.arcs === "pointer" ? 1 : 0.55;
    M.forEach((m, mi) => {
      for (const i of queries) for (const [j, wgt] of arcsOf(mi, i)) {
        const [x1, y1, w1] = layout.pos[i], [x2, y2, w2] = layout.pos[j], up = mi === 0 ? -1 : 1;
        if (S.arcs === "pointer") { // the keys of the query under the pointer, shaded by weight
          ctx.fillStyle = COLORS[mi] + (0.4 * wgt).toFixed(3) + ")";
          ctx.fillRect(x2, y2 + (up < 0 ? -9 : 0), w2, 9);
        }
        if (j === i) continue;
        const ax = x1 + w1 / 2, bx = x2 + w2 / 2, ay = y1 + up * 9, by = y2 + up * 9;
        const lift = Math.min(LINE * 0.95, 6 + Math.abs(ax - bx) / 8 + Math.abs(ay - by) / 4);
        ctx.strokeStyle = COLORS[mi] + (alpha * wgt).toFixed(3) + ")";
        ctx.lineWidth = 0.5 + 2.5 * wgt;
        ctx.beginPath(); ctx.moveTo(ax, ay);
        ctx.quadraticCurveTo((ax + bx) / 2, (up < 0 ? Math.min(ay, by) : Math.max(ay, by)) + up * lift, bx, by);
        ctx.stroke();
      }
    });
    drawStrip(visible);
  }
  function drawStrip(visible) {
    const dpr = window.devicePixelRatio || 1, w = strip.clientWidth, h = 28, T = D.documents[S.doc].tokens.length;
    strip.width = w * dpr; strip.height = h * dpr;
    const ctx = strip.getContext("2d"), band = h / M.length;
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, h);
    M.forEach((m, mi) => {
      const a = arrays(S.doc, mi), off = (S.layer * H + S.head) * T, sc = a.scale[S.layer * H + S.head] || 1;
      for (let x = 0; x < w; x++) {
        const from = Math.floor(x * T / w), to = Math.max(from + 1, Math.floor((x + 1) * T / w));
        let v = 0;
        for (let i = from; i < to && i < T; i++) v = Math.max(v, a.received[off + i]);
        ctx.fillStyle = ramp(Math.sqrt(v / sc));
        ctx.fillRect(x, mi * band, 1, band);
      }
    });
    if (visible.length) {
      ctx.strokeStyle = "#e0007a";
      ctx.strokeRect(visible[0] * w / T, 0.5, Math.max(2, (visible[visible.length - 1] - visible[0] + 1) * w / T), h - 1);
    }
  }

  // -- gold and predicted parents ------------------------------------------------------------------------
  // The overlay scrolls over the whole document, but its canvas is only as wide as the box: it sticks to the
  // box's left edge and redraws the words and arcs in view on every scroll. (A canvas as wide as a long document,
  // some 80,000 px at 2,048 tokens, is beyond what browsers draw: it stays blank.) The box's data attributes say
  // what was drawn last: the first and last word in view and the number of arcs.
  const BASE = 110, FONT = "13px system-ui, sans-serif";
  const parseNote = el("div", { id: "parsenote", class: "lab" });
  const parseArea = el("div", { id: "parsearea" }), parse = el("canvas", { id: "parse" });
  parseArea.appendChild(parse);
  let parseLayout = null;
  function layoutParse() {
    const doc = D.documents[S.doc], ctx = parse.getContext("2d"), xs = [];
    ctx.font = FONT;
    let x = 10;
    doc.words.forEach((w) => { const tw = ctx.measureText(w).width; xs.push(x + tw / 2); x += tw + 16; });
    parseLayout = { xs: xs, width: x, height: BASE + 30 + 60 * M.length };
    parseArea.style.width = x + "px";
    parseArea.style.height = parseLayout.height + "px";
  }
  function drawParse() {
    const doc = D.documents[S.doc];
    if (!doc.words) { parseBox.textContent = ""; delete parseBox.dataset.arcs; return; }
    if (!parseBox.firstChild) parseBox.append(parseNote, parseArea);
    if (!parseLayout) layoutParse();
    const n = doc.words.length, hits = [];
    M.forEach((m, mi) => {
      if (!m.present[S.layer][S.head]) return;
      const a = arrays(S.doc, mi), off = (S.layer * H + S.head) * n;
      let right = 0, scored = 0;
      for (let i = 0; i < n; i++) {
        if (a.parents[off + i] >= 0 && doc.gold[i] >= 0) { scored++; right += a.parents[off + i] === doc.gold[i]; }
      }
      hits.push(m.name + ": " + right + "/" + scored);
    });
    parseNote.textContent = "gold arcs above; each head's predicted parent (dependent to head) below, green where " +
      "it is the gold parent. Words right: " + hits.join(", ");
    drawParseView();
  }
  function drawParseView() {
    const doc = D.documents[S.doc];
    if (!doc.words || !parseLayout) return;
    const xs = parseLayout.xs, n = xs.length, height = parseLayout.height, dpr = window.devicePixelRatio || 1;
    const w = Math.max(1, Math.min(parseBox.clientWidth, parseLayout.width)), left = parseBox.scrollLeft;
    const right = left + w;
    parse.width = Math.ceil(w * dpr); parse.height = Math.ceil(height * dpr);
    parse.style.width = w + "px"; parse.style.height = height + "px";
    const ctx = parse.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, -left * dpr, 0); // document coordinates
    ctx.clearRect(left, 0, w, height);
    ctx.font = FONT; ctx.textAlign = "center"; ctx.textBaseline = "middle";
    let first = -1, last = -1, arcs = 0;
    for (let i = 0; i < n; i++) {
      if (xs[i] < left - 300 || xs[i] > right + 300) continue; // no word is 600 px wide
      ctx.fillStyle = "#222"; ctx.fillText(doc.words[i], xs[i], BASE);
      if (xs[i] >= left && xs[i] <= right) { if (first < 0) first = i; last = i; }
    }
    const inView = (i, j) => Math.min(xs[i], xs[j]) - 3 <= right && Math.max(xs[i], xs[j]) + 3 >= left;
    const arc = (i, j, y, up, color, width) => {
      if (!inView(i, j)) return;
      const h = Math.min(up ? BASE - 12 : 55, 10 + Math.abs(xs[i] - xs[j]) / 3);
      ctx.strokeStyle = color; ctx.lineWidth = width; ctx.beginPath();
      ctx.moveTo(xs[i], y); ctx.bezierCurveTo(xs[i], y + (up ? -h : h), xs[j], y + (up ? -h : h), xs[j], y); ctx.stroke();
      ctx.fillStyle = color; ctx.beginPath(); ctx.arc(xs[i], y, 2.5, 0, 7); ctx.fill();
      arcs++;
    };
    doc.gold.forEach((p, i) => { if (p >= 0) arc(i, p, BASE - 10, true, "#777", 1.2); });
    const names = [];
    M.forEach((m, mi) => {
      if (!m.present[S.layer][S.head]) return;
      const a = arrays(S.doc, mi), off = (S.layer * H + S.head) * n, y = BASE + 12 + 60 * mi;
      for (let i = 0; i < n; i++) {
        const p = a.parents[off + i];
        if (p < 0) continue;
        const ok = p === doc.gold[i];
        arc(i, p, y, false, ok ? "rgba(20,150,60,0.9)" : COLORS[mi] + "0.55)", ok ? 2 : 1);
      }
      names.push([m.name + " (predicted parent)", y + 50, COLORS[mi] + "1)"]);
    });
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0); // the labels stay at the box's left edge
    ctx.textAlign = "left";
    const label = (name, y, color) => { // on a light backing, over the arcs that pass under it
      ctx.fillStyle = "rgba(255,255,255,0.8)"; ctx.fillRect(0, y - 8, ctx.measureText(name).width + 4, 16);
      ctx.fillStyle = color; ctx.fillText(name, 2, y);
    };
    label("gold", 12, "#555");
    names.forEach(([name, y, color]) => label(name, y, color));
    parseBox.dataset.first = first; parseBox.dataset.last = last; parseBox.dataset.arcs = arcs;
  }

  // -- interaction ---------------------------------------------------------------------------------------
  function headTitle() {
    const g = M[0].groups[S.layer][S.head], marks = [];
    M.forEach((m) => ["removed", "silenced", "supervised"].forEach((k) => {
      if (m[k][S.layer][S.head]) marks.push(k + " in " + m.name);
    }));
    title.textContent = "layer " + S.layer + ", head " + S.head + " (key/value group " + g + ")" +
      (marks.length ? ": " + marks.join(", ") : "") + ". Strip: attention each token receives; arcs: " +
      M.map((m, i) => (i ? "below, " : "above, ") + m.name).join("; ") + ".";
  }
  function redraw() {
    drawGrid(); drawTable(); headTitle(); drawText(); drawParse();
    document.body.dataset.layer = S.layer; document.body.dataset.head = S.head; document.body.dataset.doc = S.doc;
    try { // the address names the choice, to share it; a sandboxed frame (Jupyter) may refuse
      history.replaceState(null, "", "#doc=" + S.doc + "&layer=" + S.layer + "&head=" + S.head + "&stat=" + S.stat);
    } catch (error) { /* nothing to share there */ }
  }
  function choose(l, h) { S.layer = l; S.head = h; redraw(); }
  docSel.onchange = () => {
    S.doc = +docSel.value; S.query = -1; layout = null; parseLayout = null; box.scrollTop = 0; parseBox.scrollLeft = 0;
    redraw();
  };
  statSel.onchange = () => { S.stat = statSel.value; redraw(); };
  gridSel.onchange = () => { S.grid = gridSel.value; drawGrid(); };
  arcSel.onchange = () => { S.arcs = arcSel.value; drawText(); };
  box.addEventListener("scroll", drawText);
  parseBox.addEventListener("scroll", drawParseView);
  window.addEventListener("resize", () => { layout = null; drawText(); drawParseView(); });
  text.addEventListener("mousemove", (e) => {
    const r = text.getBoundingClientRect(), x = e.clientX - r.left, y = e.clientY - r.top + box.scrollTop;
    const i = layout.pos.findIndex(([tx, ty, tw]) => x >= tx && x <= tx + tw && Math.abs(y - ty) <= LINE);
    if (i !== S.query) { S.query = i; drawText(); }
  });
  strip.addEventListener("click", (e) => {
    const r = strip.getBoundingClientRect(), T = D.documents[S.doc].tokens.length;
    const i = Math.min(T - 1, Math.floor((e.clientX - r.left) / r.width * T));
    box.scrollTop = Math.max(0, layout.pos[i][1] - box.clientHeight / 2);
  });
  const hash = new URLSearchParams(location.hash.slice(1));
  if (!M.length || !D.documents.length) return;
  S.doc = Math.min(+(hash.get("doc") || 0), D.documents.length - 1);
  S.layer = Math.min(+(hash.get("layer") || 0), L - 1);
  S.head = Math.min(+(hash.get("head") || 0), H - 1);
  if (statNames.includes(hash.get("stat"))) S.stat = hash.get("stat");
  docSel.value = S.doc; statSel.value = S.stat;
  redraw();
  document.body.dataset.ready = "1";
})();
