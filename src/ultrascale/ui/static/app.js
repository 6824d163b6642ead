// The three views. Every number comes from the server's JSON API, which runs the CLI's own code.
"use strict";

const PAGE = new URLSearchParams(location.search);
const POLL_MS = +PAGE.get("poll") || 2000;  // how often an open run is read again
const CATEGORIES = [["params", "parameters", "#4e79a7"], ["grads", "gradients", "#f28e2b"],
                    ["optimizer", "optimizer state", "#59a14f"],
                    ["activations", "activations", "#e15759"],
                    ["comm_buffers", "communication buffers", "#b07aa1"],
                    ["other", "workspaces", "#9c755f"]];
const $ = id => document.getElementById(id);
let OPTIONS = null;

async function getJSON(url) {
  const response = await fetch(url);
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function showError(id, err) {
  const node = $(id);
  node.hidden = !err;
  node.textContent = err ? err.message || String(err) : "";
}

function fillSelect(select, values, chosen) {
  select.replaceChildren(...values.map(v => {
    const o = document.createElement("option");
    o.value = v; o.textContent = v === "" ? "(none)" : v; o.selected = v === chosen;
    return o;
  }));
}

function showView(name) {
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  history.replaceState(null, "", `${location.search}#${name}`);
  if (name === "runs" && !runs.listed) loadRunList();
  if (name === "layouts" && !plan.done) runPlan();
}

// ---------------------------------------------------------------------------------- Memory view
const POW2 = (lo, hi) => { const v = []; for (let x = lo; x <= hi; x *= 2) v.push(x); return v; };
// name, values, default: the layout flags of `ultrascale memory`, on sliders.
const SLIDERS = [["dp", POW2(1, 1024), 8], ["tp", POW2(1, 64), 1], ["pp", POW2(1, 64), 1],
                 ["cp", POW2(1, 32), 1], ["ep", POW2(1, 64), 1], ["zero", [0, 1, 2, 3], 1],
                 ["mbs", POW2(1, 64), 1], ["grad_accum", POW2(1, 256), 1],
                 ["seq_len", POW2(512, 131072), 4096]];
const SIZES = ["hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
               "vocab_size", "num_experts", "experts_top_k"];
const KNOBS = { seq_len: POW2(1024, 32768), mbs: POW2(1, 16), zero: [0, 1, 2, 3],
                tp: POW2(1, 8), pp: POW2(1, 8), dp: POW2(1, 64), cp: POW2(1, 8),
                recompute: ["none", "selective", "full"] };

function labelled(text, input) {
  const label = document.createElement("label");
  label.append(text + " ", input);
  return label;
}

function buildMemoryControls() {
  fillSelect($("memory-preset"), OPTIONS.presets, "llama3-8b");
  for (const [name, values, start] of SLIDERS) {
    const row = document.createElement("div");
    row.className = "slider";
    const input = Object.assign(document.createElement("input"), {
      type: "range", min: 0, max: values.length - 1, step: 1, id: `slider-${name}`,
      value: values.indexOf(start) });
    input.dataset.flag = name;
    const out = document.createElement("output");
    const show = () => { out.value = values[+input.value]; };
    input.addEventListener("input", show);
    show();
    row.append(Object.assign(document.createElement("span"), { textContent: name }), input, out);
    $("memory-sliders").append(row);
  }
  const pick = (name, values, chosen) => {
    const select = Object.assign(document.createElement("select"), { name });
    fillSelect(select, values, chosen);
    return select;
  };
  const c = OPTIONS.choices;
  $("memory-sliders").append(
    labelled("recompute", pick("recompute", c.recompute, "none")),
    labelled("precision", pick("dtype", c.dtype, "bf16")),
    labelled("pp schedule", pick("pp_schedule", c.pp_schedule, "1f1b")),
    labelled("sequence parallel", Object.assign(document.createElement("input"),
                                                { type: "checkbox", name: "sequence_parallel" })));
  $("memory-device").append(labelled("GPU", pick("gpu", ["", ...OPTIONS.gpus], "h100")),
                            labelled("runtime", pick("runtime", c.runtime, "ultrascale")));
  for (const name of SIZES) {
    $("memory-sizes").append(labelled(name, Object.assign(document.createElement("input"),
                                                          { name, type: "number", min: 1 })));
  }
  $("memory-form").addEventListener("input", scheduleMemory);
  $("memory-form").addEventListener("change", scheduleMemory);
  $("memory-knob").addEventListener("change", () => updateKnob(memory.last));
}

// The query of the form's state: the flags of `ultrascale memory`, with one of them changed.
function memoryQuery(change = {}) {
  const q = new URLSearchParams();
  const form = $("memory-form");
  const hf = form.hf_config.value.trim();
  if (hf) q.set("hf_config", hf); else q.set("preset", form.preset.value);
  for (const name of SIZES) if (form[name].value) q.set(name, form[name].value);
  for (const [name, values] of SLIDERS) q.set(name, values[+$(`slider-${name}`).value]);
  for (const name of ["recompute", "dtype", "pp_schedule", "runtime"]) q.set(name, form[name].value);
  if (form.gpu.value) q.set("gpu", form.gpu.value);
  q.set("sequence_parallel", form.sequence_parallel.checked);
  for (const [k, v] of Object.entries(change)) q.set(k, v);
  return q;
}

const memory = { timer: null, seq: 0, last: null };

function scheduleMemory() {
  clearTimeout(memory.timer);
  memory.timer = setTimeout(updateMemory, 80);
}

async function updateMemory() {
  const seq = ++memory.seq;
  try {
    const report = await getJSON(`/api/memory?${memoryQuery()}`);
    if (seq !== memory.seq) return;  // an answer to an older position of the sliders
    showError("memory-error", null);
    memory.last = report;
    renderMemory(report);
    updateKnob(report);
  } catch (err) {
    if (seq === memory.seq) showError("memory-error", err);
  }
}

function memorySegments(r) {
  const segments = [];
  for (const [key, name, color] of CATEGORIES) {
    if (key !== "activations") { segments.push({ name, value: r[key], color }); continue; }
    // Activations by part, in shades of the category's red.
    const parts = Object.entries(r.activation_parts).filter(p => p[1] > 0);
    const sum = parts.reduce((s, p) => s + p[1], 0);
    parts.sort((a, b) => b[1] - a[1]).forEach(([part, n], i) => segments.push({
      name: `act: ${part}`, value: sum ? n * r.activations / sum : 0,
      color: `hsl(${2 + i * 4}, ${70 - i * 3}%, ${40 + i * 4.5}%)` }));
  }
  return segments;
}

function renderMemory(r) {
  const verdict = $("memory-verdict");
  verdict.replaceChildren(`${fmtBytes(r.total)} per device, ${r.rank_desc}`);
  if (r.device_memory != null) {
    const span = document.createElement("span");
    span.className = r.fits ? "fits" : "nofit";
    span.textContent = r.fits ? " fits" : " does NOT fit";
    verdict.append(":", span, ` in ${fmtBytes(r.device_memory)}` +
                   (r.reserved !== r.total ? ` (reserved with fragmentation: ${fmtBytes(r.reserved)})` : ""));
  }
  verdict.title = r.device_note || "";
  stackedBars($("memory-bars"), [{ label: layoutText(r.layout), segments: memorySegments(r) }],
              { unit: "bytes", limit: r.device_memory, limitLabel: "device memory" });
}

function layoutText(l) {
  const dims = ["dp", "tp", "pp", "cp", "ep"].filter(k => l[k] > 1).map(k => `${k}${l[k]}`);
  return [...dims, `zero${l.zero}`, `mbs${l.mbs}`, `seq ${l.seq_len}`].join(" ");
}

async function updateKnob(current) {
  if (!current) return;
  const knob = $("memory-knob").value, values = KNOBS[knob];
  const answers = await Promise.allSettled(
    values.map(v => getJSON(`/api/memory?${memoryQuery({ [knob]: v })}`)));
  if (current !== memory.last) return;
  const bars = values.map((v, i) => ({
    label: String(v),
    segments: answers[i].status === "fulfilled"
      ? CATEGORIES.map(([key, name, color]) => ({ name, color, value: answers[i].value[key] }))
      : [] }));
  stackedBars($("memory-knob-chart"), bars, { unit: "bytes", limit: current.device_memory,
                                              limitLabel: "device memory", xlabel: knob });
}

// --------------------------------------------------------------------------------- Layouts view
const plan = { done: false };

async function runPlan(event) {
  if (event) event.preventDefault();
  plan.done = true;
  const form = $("plan-form"), q = new URLSearchParams();
  const hf = form.hf_config.value.trim();
  if (hf) q.set("hf_config", hf); else q.set("preset", form.preset.value);
  for (const name of ["gpus", "gpu", "global_batch_tokens", "seq_len", "dtype", "top"]) {
    if (form[name].value) q.set(name, form[name].value);
  }
  $("plan-summary").textContent = "planning…";
  try {
    renderPlan(await getJSON(`/api/plan?${q}`), form);
    showError("plan-error", null);
  } catch (err) {
    $("plan-summary").textContent = "";
    showError("plan-error", err);
  }
}

function renderPlan(p, form) {
  $("plan-summary").textContent = `${p.considered} layouts considered for ${form.gpus.value} x ` +
    `${form.gpu.value}; ${p.ranked.length ? "the fastest that fit:" : "none fits in memory."}`;
  const rows = p.ranked.length ? p.ranked : (p.smallest ? [p.smallest] : []);
  const table = $("plan-table");
  const head = "<tr><th>#</th><th>layout</th><th>memory</th><th>tokens/s/device</th><th>MFU</th>" +
               "<th>step</th><th>dominant cost</th></tr>";
  table.innerHTML = head;
  rows.forEach((r, i) => {
    const tr = table.insertRow();
    tr.className = i === 0 && p.ranked.length ? "first" : "";
    for (const text of [i + 1, r.layout, r.memory_bytes != null ? fmtBytes(r.memory_bytes) : "?",
                        fmtNum(r.tokens_per_s_per_device), `${(r.mfu * 100).toFixed(1)}%`,
                        `${(r.step_time_s * 1e3).toFixed(0)} ms`, r.dominant]) {
      tr.insertCell().textContent = text;
    }
  });
  const keys = [...new Set(rows.flatMap(r => Object.keys(r.breakdown_s)))];
  stackedBars($("plan-breakdown"), rows.slice(0, 5).map((r, i) => ({
    label: `#${i + 1}`, segments: keys.map((k, j) => ({
      name: k, value: r.breakdown_s[k] || 0, color: LINE_COLORS[j % LINE_COLORS.length] })) })),
              { unit: "seconds" });
  $("plan-why").textContent = p.why || "";
  $("plan-advice").replaceChildren(...(p.advice || []).map(a =>
    Object.assign(document.createElement("li"), { textContent: a })));
}

// ------------------------------------------------------------------------------------ Runs view
const runs = { listed: false, timer: null, open: null };

async function loadRunList() {
  runs.listed = true;
  try {
    const d = await getJSON("/api/runs");
    const select = $("runs-select");
    select.replaceChildren(...d.runs.map(r => {
      const o = document.createElement("option");
      o.value = r.path; o.dataset.kind = r.kind;
      o.textContent = (r.kind === "sweep" ? "sweep: " : "") + r.label;
      return o;
    }));
    $("runs-status").textContent = d.runs.length ? "" :
      `no run yet under ${d.roots.join(", ")}: start \`ultrascale train\`, or \`ultrascale ui --runs-dir DIR\``;
    if (d.runs.length && (!runs.open || !d.runs.some(r => r.path === runs.open))) openSelected();
    else if (runs.open) select.value = runs.open;
  } catch (err) { showError("runs-error", err); }
}

function openSelected() {
  const option = $("runs-select").selectedOptions[0];
  if (!option) return;
  clearInterval(runs.timer);
  runs.open = option.value;
  showError("runs-error", null);
  if (option.dataset.kind === "sweep") openSweep(option.value); else openRun(option.value);
}

function openRun(path) {
  $("sweep-view").hidden = true;
  const grid = $("runs-charts");
  grid.hidden = false;
  grid.replaceChildren();
  const state = { path, next: 0, series: {}, steps: 0, last: null };
  for (const chart of Object.keys(OPTIONS.charts)) {
    const svg = svgEl("svg", { id: `run-${chart}`, class: "chart", viewBox: "0 0 460 230" });
    grid.append(svg);
    state.series[chart] = {};
  }
  runs.state = state;
  pollRun(state);
  runs.timer = setInterval(() => pollRun(state), POLL_MS);
}

async function pollRun(state) {
  if (state.busy) return;  // (one read at a time: two from the same line would add points twice)
  state.busy = true;
  try {
    const d = await getJSON(`/api/run?path=${encodeURIComponent(state.path)}&after=${state.next}`);
    if (runs.state !== state) return;
    if (d.reset) for (const c in state.series) state.series[c] = {};
    const fresh = d.steps.length > 0 || d.reset || state.next === 0;
    for (const [chart, lines] of Object.entries(d.series)) {
      for (const [name, points] of Object.entries(lines)) {
        (state.series[chart][name] ||= []).push(...points);
      }
    }
    state.next = d.next;
    if (d.steps.length) state.last = d.steps[d.steps.length - 1];
    if (fresh) {
      for (const [chart, [title, unit]] of Object.entries(OPTIONS.charts)) {
        lineChart($(`run-${chart}`), state.series[chart], { title, unit, empty: chart === "mfu"
          ? "unknown: the device's peak rate is not known (e.g. a CPU)" : "not logged" });
      }
    }
    $("runs-status").textContent = `last step ${state.last ?? "–"}; read every ` +
      `${POLL_MS / 1000} s (at ${new Date().toLocaleTimeString()})`;
  } catch (err) {
    showError("runs-error", err);
  } finally {
    state.busy = false;
  }
}

async function openSweep(path) {
  $("runs-charts").hidden = true;
  $("sweep-view").hidden = false;
  $("runs-status").textContent = "";
  try {
    const data = await getJSON(`/api/sweep?path=${encodeURIComponent(path)}`);
    heatmap($("sweep-heatmap"), data, cell => {
      const prefix = `${path}/${cell.runs[0].name}`;
      const option = [...$("runs-select").options].find(o => o.value === prefix ||
                                                          o.value.startsWith(prefix + "/"));
      if (option) { $("runs-select").value = option.value; openSelected(); }
    });
  } catch (err) { showError("runs-error", err); }
}

// ------------------------------------------------------------------------------------- start-up
async function start() {
  OPTIONS = await getJSON("/api/options");
  buildMemoryControls();
  fillSelect($("plan-preset"), OPTIONS.presets, "llama3-8b");
  fillSelect($("plan-gpu"), OPTIONS.gpus, "h100");
  $("plan-form").addEventListener("submit", runPlan);
  $("runs-select").addEventListener("change", openSelected);
  $("runs-refresh").addEventListener("click", loadRunList);
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }
  showView(location.hash.slice(1) || "memory");
  updateMemory();
  document.body.dataset.ready = "true";  // (the browser test waits for it)
}

start();
