// Small SVG charts for the page: stacked bars, lines and a heatmap. No library and no CDN: every
// asset ships in the package, so the page works offline.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const GIB = 2 ** 30;

function svgEl(tag, attrs, parent, text) {
  const node = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function clearSvg(svg) { while (svg.firstChild) svg.removeChild(svg.firstChild); }

function viewSize(svg) {
  const vb = svg.viewBox.baseVal;
  return [vb.width, vb.height];
}

// Round tick values covering lo to hi (about n of them); `unit` scales them first (bytes: GiB).
function niceTicks(lo, hi, n = 5, unit = 1) {
  lo /= unit; hi /= unit;
  if (!(hi > lo)) hi = lo + 1;
  const raw = (hi - lo) / n, mag = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 2.5, 5, 10].map(m => m * mag).find(s => s >= raw);
  const ticks = [];
  for (let t = Math.floor(lo / step) * step; t < hi + step * 0.999; t += step) ticks.push(t * unit);
  return ticks;
}

function fmtBytes(v) {
  const units = [["TiB", 2 ** 40], ["GiB", GIB], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [u, s] of units) if (Math.abs(v) >= s) return `${+(v / s).toFixed(1)} ${u}`;
  return `${v} B`;
}

function fmtNum(v) {
  const a = Math.abs(v);
  if (a >= 1e9) return `${+(v / 1e9).toFixed(2)}G`;
  if (a >= 1e6) return `${+(v / 1e6).toFixed(2)}M`;
  if (a >= 1e4) return `${+(v / 1e3).toFixed(1)}k`;
  if (a >= 100) return v.toFixed(0);
  if (a >= 1) return +v.toFixed(2) + "";
  return +v.toPrecision(3) + "";
}

const FORMAT = { bytes: fmtBytes, fraction: v => `${+(v * 100).toFixed(1)}%`,
                 seconds: v => `${+(v * 1e3).toFixed(0)} ms`, "": fmtNum };

function note(svg, text) {
  const [w, h] = viewSize(svg);
  svgEl("text", { x: w / 2, y: h / 2, "text-anchor": "middle", class: "note" }, svg, text);
}

// bars: [{label, segments: [{name, value, color}]}], stacked bottom-up. opts: unit, limit (a
// dashed line, e.g. the device's memory), limitLabel, title, legend (defaults to true).
function stackedBars(svg, bars, opts = {}) {
  clearSvg(svg);
  const [w, h] = viewSize(svg), fmt = FORMAT[opts.unit || ""];
  const legend = opts.legend !== false;
  const m = { l: 64, r: legend ? 190 : 12, t: opts.title ? 24 : 14, b: opts.xlabel ? 36 : 24 };
  const totals = bars.map(b => b.segments.reduce((s, x) => s + x.value, 0));
  const top = Math.max(...totals, opts.limit || 0) * 1.08 || 1;
  const ticks = niceTicks(0, top, 5, opts.unit === "bytes" ? byteScale(top) : 1);
  const ymax = ticks[ticks.length - 1];
  const y = v => h - m.b - (v / ymax) * (h - m.t - m.b);
  const bw = (w - m.l - m.r) / Math.max(bars.length, 1);
  if (opts.title) svgEl("text", { x: m.l, y: 15, class: "title" }, svg, opts.title);
  const axis = svgEl("g", { class: "axis" }, svg);
  for (const t of ticks) {
    svgEl("line", { x1: m.l, x2: w - m.r, y1: y(t), y2: y(t), stroke: "#eee" }, axis);
    svgEl("text", { x: m.l - 6, y: y(t) + 4, "text-anchor": "end" }, axis, fmt(t));
  }
  bars.forEach((bar, i) => {
    const x = m.l + i * bw + bw * 0.15, width = bw * 0.7;
    let base = 0;
    const g = svgEl("g", { class: "bar", "data-label": bar.label }, svg);
    for (const s of bar.segments) {
      if (!(s.value > 0)) continue;
      const r = svgEl("rect", { x, width, y: y(base + s.value), height: y(base) - y(base + s.value),
                                fill: s.color, class: "seg", "data-name": s.name,
                                "data-value": s.value }, g);
      svgEl("title", {}, r, `${s.name}: ${fmt(s.value)}`);
      base += s.value;
    }
    svgEl("text", { x: x + width / 2, y: h - m.b + 14, "text-anchor": "middle" }, svg, bar.label);
    svgEl("text", { x: x + width / 2, y: y(base) - 4, "text-anchor": "middle", class: "total" },
          svg, fmt(base));
  });
  const dash = { stroke: "#000", "stroke-dasharray": "5 4" };
  if (opts.limit) {
    svgEl("line", { x1: m.l, x2: w - m.r, y1: y(opts.limit), y2: y(opts.limit), class: "limit",
                    ...dash }, svg);
  }
  if (legend) {
    const seen = new Map();
    for (const b of bars) for (const s of b.segments) if (s.value > 0) seen.set(s.name, s.color);
    [...seen].forEach(([name, color], i) => {
      const ly = m.t + i * 15;
      svgEl("rect", { x: w - m.r + 12, y: ly, width: 10, height: 10, fill: color }, svg);
      svgEl("text", { x: w - m.r + 27, y: ly + 9 }, svg, name);
    });
    if (opts.limit) {
      const ly = m.t + seen.size * 15 + 5;
      svgEl("line", { x1: w - m.r + 10, x2: w - m.r + 24, y1: ly, y2: ly, ...dash }, svg);
      svgEl("text", { x: w - m.r + 27, y: ly + 4 }, svg,
            `${opts.limitLabel || ""} ${fmt(opts.limit)}`.trim());
    }
  }
  if (opts.xlabel) {
    svgEl("text", { x: (m.l + w - m.r) / 2, y: h - 4, "text-anchor": "middle", class: "note" }, svg,
          opts.xlabel);
  }
}

const LINE_COLORS = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948",
                     "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac", "#1f3b73", "#86bc86"];

// Bytes: ticks in the binary unit of the largest value (GiB, MiB, KiB), so that they read round.
function byteScale(v) { return 1024 ** Math.max(0, Math.floor(Math.log(Math.max(v, 1)) / Math.log(1024))); }

// lines: {name: [[x, y], ...]}. opts: title, unit, empty (what to say when there is no point).
function lineChart(svg, lines, opts = {}) {
  clearSvg(svg);
  const [w, h] = viewSize(svg), fmt = FORMAT[opts.unit || ""];
  const names = Object.keys(lines).filter(n => lines[n].length);
  svgEl("text", { x: 8, y: 15, class: "title" }, svg, opts.title || "");
  if (!names.length) { note(svg, opts.empty || "nothing logged yet"); return; }
  const pts = names.flatMap(n => lines[n]);
  const xs = pts.map(p => p[0]), ys = pts.map(p => p[1]);
  let [ylo, yhi] = [Math.min(...ys), Math.max(...ys)];
  if (ylo === yhi) { ylo -= Math.abs(ylo) * 0.1 || 1; yhi += Math.abs(yhi) * 0.1 || 1; }
  const m = { l: 62, r: 12, t: 24, b: 30 };
  const xlo = Math.min(...xs), xhi = Math.max(Math.max(...xs), xlo + 1);
  const yt = niceTicks(ylo, yhi, 4, opts.unit === "bytes" ? byteScale(yhi) : 1);
  const xt = niceTicks(xlo, xhi, 6);
  const [y0, y1] = [Math.min(yt[0], ylo), Math.max(yt[yt.length - 1], yhi)];
  const X = v => m.l + (v - xlo) / (xhi - xlo) * (w - m.l - m.r);
  const Y = v => h - m.b - (v - y0) / (y1 - y0) * (h - m.t - m.b);
  const axis = svgEl("g", { class: "axis" }, svg);
  for (const t of yt) {
    svgEl("line", { x1: m.l, x2: w - m.r, y1: Y(t), y2: Y(t), stroke: "#eee" }, axis);
    svgEl("text", { x: m.l - 6, y: Y(t) + 4, "text-anchor": "end" }, axis, fmt(t));
  }
  for (const t of xt.filter(t => t >= xlo && t <= xhi && Number.isInteger(t))) {
    svgEl("text", { x: X(t), y: h - m.b + 14, "text-anchor": "middle" }, axis, t);
  }
  svgEl("text", { x: w - m.r, y: h - 4, "text-anchor": "end", class: "note" }, axis, "step");
  names.forEach((name, i) => {
    const color = LINE_COLORS[i % LINE_COLORS.length];
    const d = lines[name].map((p, k) => `${k ? "L" : "M"}${X(p[0]).toFixed(1)},${Y(p[1]).toFixed(1)}`);
    svgEl("path", { d: d.join(""), fill: "none", stroke: color, "stroke-width": 1.6,
                    class: "line", "data-name": name, "data-points": lines[name].length }, svg);
    if (names.length > 1) {
      svgEl("text", { x: w - m.r - 4, y: m.t + 12 * i + 4, "text-anchor": "end",
                      style: `fill: ${color}` }, svg, name);
    }
  });
}

// A sweep's heatmap (planner/sweep_report.py `heatmap_data`): every run in a cell of its own.
function heatmap(svg, data, onCell) {
  clearSvg(svg);
  const rowLabel = vals => data.y.map((k, i) => `${k.split(".").pop()}=${vals[i]}`).join(", ") || "all";
  const labelWidth = Math.max(60, ...data.ys.map(v => rowLabel(v).length * 6.2));
  const cw = 90, ch = 26, m = { l: labelWidth + 12, t: 30, b: 40 };
  const w = m.l + cw * data.xs.length + 20, h = m.t + ch * data.ys.length + m.b;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.style.width = `${w}px`;  // (text at its own size, however many cells)
  svgEl("text", { x: 8, y: 16, class: "title" }, svg, data.title || "");
  const values = data.cells.map(c => c.tokens_per_s_per_device).filter(v => v != null);
  const [lo, hi] = [Math.min(...values), Math.max(...values)];
  const share = v => (hi > lo ? (v - lo) / (hi - lo) : 1);  // 0 slowest .. 1 fastest
  const color = v => `hsl(${220 - 160 * share(v)}, 65%, ${38 + 22 * share(v)}%)`;
  const at = new Map(data.cells.map(c => [`${c.row},${c.col}`, c]));
  data.ys.forEach((vals, r) => {
    svgEl("text", { x: m.l - 6, y: m.t + r * ch + ch / 2 + 4, "text-anchor": "end" }, svg,
          rowLabel(vals));
    data.xs.forEach((_, c) => {
      const cell = at.get(`${r},${c}`), x = m.l + c * cw, y = m.t + r * ch;
      let fill = "#e6e6e6", text = "not in sweep", tc = "#888";
      if (cell && cell.status === "ok") {
        fill = color(cell.tokens_per_s_per_device);
        text = fmtNum(cell.tokens_per_s_per_device);
        tc = share(cell.tokens_per_s_per_device) > 0.6 ? "#222" : "#fff";
      } else if (cell) { fill = "#fbe3e0"; text = cell.status.toUpperCase(); tc = "#c0392b"; }
      const g = svgEl("g", { class: cell ? "cell" : "cell empty",
                             "data-runs": cell ? cell.runs.map(x => x.name).join(" ") : "" }, svg);
      svgEl("rect", { x, y, width: cw - 2, height: ch - 2, fill }, g);
      svgEl("text", { x: x + cw / 2, y: y + ch / 2 + 4, "text-anchor": "middle",
                      style: `fill: ${tc}` }, g, text);
      if (cell) {
        svgEl("title", {}, g, cell.runs.map(x => `${x.name}: ${x.status}`).join("\n"));
        if (onCell) { g.style.cursor = "pointer"; g.addEventListener("click", () => onCell(cell)); }
      }
    });
  });
  data.xs.forEach((v, c) => svgEl("text", { x: m.l + c * cw + cw / 2, y: m.t + data.ys.length * ch + 14,
                                            "text-anchor": "middle" }, svg, String(v)));
  svgEl("text", { x: m.l + cw * data.xs.length / 2, y: h - 8, "text-anchor": "middle" }, svg,
        `${data.x || ""}  (${data.unit})`);
}
