// layerwise explorer: plain JavaScript, no dependencies, talks only to the server that served it.
"use strict";

const PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                 "#bcbd22", "#17becf"];
const SVGNS = "http://www.w3.org/2000/svg";
const $ = (id) => document.getElementById(id);
const state = { info: null, layer: 0, method: "pca", sentence: null, sim: 0 };

// An exported page (layerwise explore --export) carries the answers in window.LAYERWISE_SNAPSHOT: no server.
function fromSnapshot(snap, path) {
  if (path === "info") return snap.info;
  if (path === "scores" && snap.scores) return snap.scores;
  if (path.startsWith("layer/") && snap.layers[path]) return snap.layers[path];
  if (path.startsWith("probe/") && snap.probes[path.slice(6)]) return snap.probes[path.slice(6)];
  if (path === "sentence") {
    throw new Error("this page was exported without its model: run layerwise explore for the sentence view");
  }
  throw new Error("not in this exported page: " + path);
}

async function api(path, options) {
  if (window.LAYERWISE_SNAPSHOT) return fromSnapshot(window.LAYERWISE_SNAPSHOT, path);
  const res = await fetch("/explorer/api/" + path, options);
  const body = await res.json();
  if (!res.ok) throw new Error(body.detail || res.statusText);
  return body;
}

function el(tag, attrs, parent) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
function fmt(v, digits) { return v === null || v === undefined ? "-" : Number(v).toFixed(digits === undefined ? 3 : digits); }

function tooltip(evt, text) {
  const tip = $("tooltip");
  if (text === null) { tip.hidden = true; return; }
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = (evt.clientX + 12) + "px";
  tip.style.top = (evt.clientY + 12) + "px";
}

// colour scale: t in 0..1 -> light to dark blue (sequential), or blue-white-red (diverging, t in -1..1)
function seq(t) {
  t = Math.max(0, Math.min(1, t));
  const a = [247, 251, 255], b = [8, 48, 107];
  return `rgb(${a.map((x, i) => Math.round(x + (b[i] - x) * t)).join(",")})`;
}

function showView(name) {
  for (const v of ["corpus", "sentence", "probe"]) {
    $("view-" + v).hidden = v !== name;
    $("tab-" + v).classList.toggle("active", v === name);
  }
}

// ---------------------------------------------------------------------------------------------- corpus view
function labelColours(labels) {
  const names = [...new Set(labels || [])].sort();
  const map = {};
  names.forEach((n, i) => { map[n] = PALETTE[i % PALETTE.length]; });
  return map;
}

async function showLayer(k) {
  state.layer = k;
  const c = state.info.corpus;
  $("layer-slider").value = k;
  $("layer-name").textContent = c.layer_names[k];
  document.body.dataset.layerLoading = "1";
  const view = await api(`layer/${k}?method=${state.method}`);
  if (state.layer !== k) return;  // the slider moved on
  const s = view.scores || {};
  $("score-knn").textContent = fmt(s.knn);
  $("score-probe").textContent = fmt(s.probe);
  $("score-silhouette").textContent = fmt(s.silhouette);
  $("explained").textContent = view.explained ?
    `axes explain ${(100 * view.explained[0]).toFixed(1)}% + ${(100 * view.explained[1]).toFixed(1)}% of the variance` : "";
  drawScatter(view.points, c.labels, c.texts);
  markCurve(k);
  document.body.dataset.layerShown = String(k);
  delete document.body.dataset.layerLoading;
}

function drawScatter(points, labels, texts) {
  const svg = $("scatter");
  clear(svg);
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height"), pad = 20;
  const xs = points.map((p) => p[0]), ys = points.map((p) => p[1]);
  const [x0, x1, y0, y1] = [Math.min(...xs), Math.max(...xs), Math.min(...ys), Math.max(...ys)];
  const sx = (x) => pad + (x - x0) / ((x1 - x0) || 1) * (w - 2 * pad);
  const sy = (y) => h - pad - (y - y0) / ((y1 - y0) || 1) * (h - 2 * pad);
  const colours = labelColours(labels);
  points.forEach((p, i) => {
    const dot = el("circle", { cx: sx(p[0]).toFixed(1), cy: sy(p[1]).toFixed(1), r: 3, "fill-opacity": 0.7,
                              fill: labels ? colours[labels[i]] : "#1f77b4", "data-i": i }, svg);
    const text = (labels ? `[${labels[i]}] ` : "") + texts[i];
    dot.addEventListener("mousemove", (e) => tooltip(e, text));
    dot.addEventListener("mouseleave", (e) => tooltip(e, null));
  });
}

function drawLegend(labels) {
  const legend = $("legend");
  legend.textContent = "";
  const colours = labelColours(labels);
  for (const [name, colour] of Object.entries(colours)) {
    const item = document.createElement("span");
    const dot = document.createElement("i");
    dot.style.background = colour;
    item.appendChild(dot);
    item.appendChild(document.createTextNode(name));
    legend.appendChild(item);
  }
}

function lineChart(svg, names, series, opts) {
  // series: [{name, values, colour, dashed}], values may hold null; opts: {ymin, ymax, ylabel, errors}
  clear(svg);
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const L = 42, R = 10, T = 10, B = 34 + 16 * Math.ceil(series.length / 3);  // room for the legend below
  const all = series.flatMap((s) => s.values).filter((v) => v !== null && v !== undefined);
  let lo = opts.ymin !== undefined ? opts.ymin : Math.min(...all), hi = opts.ymax !== undefined ? opts.ymax : Math.max(...all);
  if (!(hi > lo)) { lo -= 0.5; hi += 0.5; }
  const sx = (i) => L + (names.length > 1 ? i / (names.length - 1) : 0.5) * (w - L - R);
  const sy = (v) => T + (1 - (v - lo) / (hi - lo)) * (h - T - B);
  for (let g = 0; g <= 4; g++) {
    const v = lo + (hi - lo) * g / 4;
    el("line", { x1: L, x2: w - R, y1: sy(v), y2: sy(v), stroke: "#eee" }, svg);
    el("text", { x: L - 4, y: sy(v) + 4, "text-anchor": "end" }, svg).textContent = v.toFixed(opts.digits || 2);
  }
  names.forEach((n, i) => {
    el("text", { x: sx(i), y: h - B + 14, "text-anchor": "middle" }, svg).textContent = n;
  });
  if (opts.xlabel) el("text", { x: (L + w - R) / 2, y: h - B + 28, "text-anchor": "middle" }, svg).textContent = opts.xlabel;
  series.forEach((s) => {
    const pts = s.values.map((v, i) => (v === null || v === undefined ? null : [sx(i), sy(v)])).filter((p) => p);
    if (s.flat) {
      el("line", { x1: L, x2: w - R, y1: sy(s.values[0]), y2: sy(s.values[0]), stroke: s.colour,
                   "stroke-dasharray": "5,4", class: "series" }, svg);
    } else if (pts.length) {
      el("polyline", { points: pts.map((p) => p.join(",")).join(" "), fill: "none", stroke: s.colour,
                       "stroke-width": 2, class: "series" }, svg);
      s.values.forEach((v, i) => {
        if (v === null || v === undefined) return;
        if (s.errors && s.errors[i]) {
          el("line", { x1: sx(i), x2: sx(i), y1: sy(v - s.errors[i]), y2: sy(v + s.errors[i]), stroke: s.colour }, svg);
        }
        const dot = el("circle", { cx: sx(i), cy: sy(v), r: 3.5, fill: s.colour, class: "point" }, svg);
        dot.addEventListener("mousemove", (e) => tooltip(e, `${s.name} at ${names[i]}: ${v.toFixed(4)}`));
        dot.addEventListener("mouseleave", (e) => tooltip(e, null));
      });
    }
  });
  const slot = (w - L - R) / 3;
  series.forEach((s, i) => {
    const x = L + (i % 3) * slot, y = h - B + 48 + 16 * Math.floor(i / 3);
    el("rect", { x: x, y: y - 9, width: 10, height: 10, fill: s.colour }, svg);
    el("text", { x: x + 14, y: y }, svg).textContent = s.name;
  });
  return { sx, T, B, h };
}

let curveGeom = null;
function drawCurve(scores) {
  const series = [
    { name: "kNN accuracy", values: scores.knn, colour: PALETTE[0] },
    { name: "probe accuracy", values: scores.probe, colour: PALETTE[1] },
    { name: "silhouette", values: scores.silhouette, colour: PALETTE[2] },
  ].filter((s) => s.values.some((v) => v !== null));
  const names = scores.names.map((n) => n.replace("layer ", "").replace("embeddings", "emb"));
  curveGeom = lineChart($("score-curve"), names, series, { xlabel: "layer" });
  const probe = scores.probe.map((v, i) => [v, i]).filter((p) => p[0] !== null);
  if (probe.length) {
    const best = probe.reduce((a, b) => (b[0] > a[0] ? b : a));
    $("score-best").textContent = `${scores.names[best[1]]} (${fmt(best[0])})`;
  }
  markCurve(state.layer);
}

function markCurve(k) {
  const svg = $("score-curve");
  const old = svg.querySelector(".marker");
  if (old) old.remove();
  if (!curveGeom) return;
  el("line", { x1: curveGeom.sx(k), x2: curveGeom.sx(k), y1: curveGeom.T, y2: curveGeom.h - curveGeom.B,
               stroke: "#999", "stroke-dasharray": "3,3", class: "marker" }, svg);
}

async function initCorpus() {
  const c = state.info.corpus;
  if (!c) { $("corpus-empty").hidden = false; return; }
  $("corpus-body").hidden = false;
  $("corpus-source").textContent = c.source;
  $("corpus-note").textContent = c.note + (c.labels ? "" : " (no labels: start with --labels COLUMN to colour them)");
  const slider = $("layer-slider");
  slider.max = c.layer_names.length - 1;
  const last = c.layer_names.length - 1;
  slider.addEventListener("input", () => showLayer(+slider.value));
  const method = $("method");
  for (const m of state.info.methods) method.add(new Option(m.toUpperCase(), m));
  method.addEventListener("change", () => { state.method = method.value; showLayer(state.layer); });
  drawLegend(c.labels);
  await showLayer(last);
  if (c.labels) drawCurve(await api("scores"));
}

// -------------------------------------------------------------------------------------------- sentence view
async function runSentence() {
  const text = $("sentence-input").value;
  const site = $("site").value || "block";
  $("sentence-error").hidden = true;
  try {
    state.sentence = await api("sentence", { method: "POST", headers: { "content-type": "application/json" },
                                             body: JSON.stringify({ text, site }) });
  } catch (err) {
    $("sentence-error").textContent = err.message;
    $("sentence-error").hidden = false;
    return;
  }
  const s = state.sentence;
  const slider = $("sim-layer");
  slider.max = s.layers.length - 1;
  slider.value = s.layers.length - 1;
  drawHeatmap();
  drawSimilarity(s.layers.length - 1);
  document.body.dataset.sentenceShown = "1";
}

function drawHeatmap() {
  const s = state.sentence, metric = $("metric").value;
  const svg = $("heatmap");
  clear(svg);
  const values = s[metric];  // [layers][tokens]
  const T = s.tokens.length, K = s.layers.length;
  const cw = Math.max(18, Math.min(60, Math.floor(800 / T))), ch = 24, left = 90, top = 70;
  svg.setAttribute("width", left + T * cw + 10);
  svg.setAttribute("height", top + K * ch + 10);
  const flat = values.flat();
  let lo = Math.min(...flat), hi = Math.max(...flat);
  if (metric === "cos_last") { lo = Math.min(lo, 0); hi = 1; }
  s.tokens.forEach((tok, j) => {
    const t = el("text", { x: left + j * cw + cw / 2, y: top - 6, transform: `rotate(-50 ${left + j * cw + cw / 2} ${top - 6})` }, svg);
    t.textContent = tok;
  });
  values.forEach((row, i) => {
    el("text", { x: left - 6, y: top + i * ch + ch / 2 + 4, "text-anchor": "end" }, svg).textContent = s.layer_names[i];
    row.forEach((v, j) => {
      const cell = el("rect", { x: left + j * cw, y: top + i * ch, width: cw - 1, height: ch - 1,
                                fill: seq((v - lo) / ((hi - lo) || 1)), class: "cell", "data-layer": s.layers[i],
                                "data-token": j }, svg);
      cell.addEventListener("mousemove", (e) => tooltip(e, `${s.tokens[j]} at ${s.layer_names[i]}: ${metric} ${v.toFixed(4)}`));
      cell.addEventListener("mouseleave", (e) => tooltip(e, null));
    });
  });
}

function drawSimilarity(k) {
  const s = state.sentence;
  state.sim = k;
  $("sim-layer-name").textContent = s.layer_names[k];
  const svg = $("similarity");
  clear(svg);
  const T = s.tokens.length, size = Math.max(12, Math.min(36, Math.floor(420 / T))), left = 90, top = 90;
  svg.setAttribute("width", left + T * size + 10);
  svg.setAttribute("height", top + T * size + 10);
  s.tokens.forEach((tok, j) => {
    el("text", { x: left + j * size + size / 2, y: top - 6, transform: `rotate(-50 ${left + j * size + size / 2} ${top - 6})` }, svg).textContent = tok;
    el("text", { x: left - 6, y: top + j * size + size / 2 + 4, "text-anchor": "end" }, svg).textContent = tok;
  });
  s.similarity[k].forEach((row, i) => row.forEach((v, j) => {
    const cell = el("rect", { x: left + j * size, y: top + i * size, width: size - 1, height: size - 1,
                              fill: seq((v + 1) / 2), class: "cell" }, svg);
    cell.addEventListener("mousemove", (e) => tooltip(e, `cos(${s.tokens[i]}, ${s.tokens[j]}) = ${v.toFixed(3)}`));
    cell.addEventListener("mouseleave", (e) => tooltip(e, null));
  }));
}

function initSentence() {
  const model = state.info.model;
  if (!model) { $("sentence-empty").hidden = false; $("sentence-body").hidden = true; return; }
  const site = $("site");
  for (const name of model.sites) site.add(new Option(name, name));
  const pick = $("sentence-pick");
  const texts = state.info.corpus ? state.info.corpus.texts.slice(0, 200) : [];
  texts.forEach((t) => pick.add(new Option(t.length > 80 ? t.slice(0, 77) + "..." : t, t)));
  pick.addEventListener("change", () => { if (pick.value) { $("sentence-input").value = pick.value; runSentence(); } });
  $("sentence-go").addEventListener("click", runSentence);
  $("sentence-input").addEventListener("keydown", (e) => { if (e.key === "Enter") runSentence(); });
  $("metric").addEventListener("change", () => state.sentence && drawHeatmap());
  $("sim-layer").addEventListener("input", () => drawSimilarity(+$("sim-layer").value));
}

// ----------------------------------------------------------------------------------------------- probe view
async function openProbe(index) {
  $("probe-error").hidden = true;
  let p;
  try {
    p = await api("probe/" + index);
  } catch (err) {
    $("probe-error").textContent = err.message;
    $("probe-error").hidden = false;
    return;
  }
  $("probe-body").hidden = false;
  $("probe-title").textContent = p.title;
  const singles = p.rows.filter((r) => r.kind === "layer");
  const strategies = p.rows.filter((r) => r.kind === "strategy" && r.layers.length > 1);
  const names = singles.map((r) => (r.layers[0] === 0 ? "emb" : String(r.layers[0])));
  const series = [{ name: "single layer", colour: PALETTE[0], values: singles.map((r) => 100 * r.dev_mean),
                    errors: singles.map((r) => 100 * (r.dev_std || 0)) }];
  strategies.forEach((r, i) => series.push({ name: r.name, colour: PALETTE[(i + 1) % PALETTE.length], flat: true,
                                             values: names.map(() => 100 * r.dev_mean) }));
  lineChart($("probe-curve"), names, series, { xlabel: "layer (0 = embeddings)", digits: 1 });
  drawCka(p.cka, p.cka_labels);
  const table = $("probe-table");
  table.textContent = "";
  const head = table.insertRow();
  for (const h of ["probe", "layers", "combine", `dev ${p.metric}`, `test ${p.metric}`]) {
    const th = document.createElement("th");
    th.textContent = h;
    head.appendChild(th);
  }
  const pct = (m, s) => (m === null || m === undefined ? "-" : (100 * m).toFixed(2) + (p.restarts > 1 && s ? ` ± ${(100 * s).toFixed(2)}` : ""));
  for (const r of p.rows) {
    const tr = table.insertRow();
    tr.className = "probe-row";
    for (const v of [r.name, r.layers.join(","), r.combine, pct(r.dev_mean, r.dev_std), pct(r.test_mean, r.test_std)]) {
      tr.insertCell().textContent = v;
    }
  }
  const prov = p.provenance || {};
  $("probe-provenance").textContent = `model ${prov.model || "?"}; train ${prov.train || "?"}; dev ${prov.dev || "?"}; ` +
    `probe ${(p.options || {}).probe || "?"}; ${p.restarts} restart(s); ${p.name}`;
  document.body.dataset.probeShown = "1";
}

function drawCka(cka, labels) {
  const svg = $("probe-cka");
  clear(svg);
  const n = cka.length, left = 40, top = 10, size = Math.floor(280 / n);
  cka.forEach((row, i) => row.forEach((v, j) => {
    const cell = el("rect", { x: left + j * size, y: top + i * size, width: size - 1, height: size - 1, fill: seq(v),
                              class: "cell" }, svg);
    cell.addEventListener("mousemove", (e) => tooltip(e, `CKA(${labels[i]}, ${labels[j]}) = ${v.toFixed(3)}`));
    cell.addEventListener("mouseleave", (e) => tooltip(e, null));
  }));
  labels.forEach((l, i) => {
    el("text", { x: left - 4, y: top + i * size + size / 2 + 4, "text-anchor": "end" }, svg).textContent = l;
    el("text", { x: left + i * size + size / 2, y: top + n * size + 14, "text-anchor": "middle" }, svg).textContent = l;
  });
}

function initProbe() {
  const dirs = state.info.probe_dirs;
  const holder = $("probe-dirs");
  dirs.forEach((d) => {
    const b = document.createElement("button");
    b.textContent = d.name;
    b.className = "probe-dir";
    b.addEventListener("click", () => openProbe(d.index));
    holder.appendChild(b);
  });
  if (!dirs.length) {
    $("probe-error").textContent = "no probe directory: start with --probe DIR (layerwise explore or serve)";
    $("probe-error").hidden = false;
  } else openProbe(dirs[0].index);
}

// ------------------------------------------------------------------------------------------------------ start
async function main() {
  state.info = await api("info");
  if (state.info.model) $("model-name").textContent = state.info.model.name;
  for (const v of ["corpus", "sentence", "probe"]) $("tab-" + v).addEventListener("click", () => showView(v));
  const first = state.info.corpus ? "corpus" : (state.info.probe_dirs.length ? "probe" : "sentence");
  showView(location.hash ? location.hash.slice(1) : first);
  initSentence();
  initProbe();
  await initCorpus();
  document.body.dataset.ready = "1";
}

main().catch((err) => { document.body.dataset.error = err.message; console.error(err); });
