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
// The page's state lives in its URL (a link shows what you see): `m.` the memory form's flags,
// `p.` the layouts form's, `r.` the runs shown; the hash names the view.
const START = new URLSearchParams(location.search);
let VIEW = "memory";

function saveState() {
  const q = new URLSearchParams();
  if (PAGE.get("poll")) q.set("poll", PAGE.get("poll"));
  if (OPTIONS) {
    for (const [k, v] of memoryQuery()) q.set(`m.${k}`, v);
    for (const [k, v] of planQuery()) q.set(`p.${k}`, v);
  }
  if (runs.open) q.set("r.run", runs.open);
  if (runs.compare) q.set("r.compare", runs.compare);
  history.replaceState(null, "", `?${q}#${VIEW}`);
}

// The value saved under `prefix.name` in the URL the page was opened with, or undefined.
function started(prefix, name) {
  const v = START.get(`${prefix}.${name}`);
  return v === null ? undefined : v;
}

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
  VIEW = name;
  for (const tab of document.querySelectorAll(".tab")) {
    tab.classList.toggle("active", tab.dataset.view === name);
  }
  for (const view of document.querySelectorAll(".view")) view.hidden = view.id !== `view-${name}`;
  saveState();
  if (name === "runs" && !runs.listed) loadRunList();
  if (name === "layouts" && !plan.done) runPlan();
}

// ---------------------------------------------------------------------------------- Memory view
const POW2 = (lo, hi) => { const v = []; for (let x = lo; x <= hi; x *= 2) v.push(x); return v; };
// name, values, default: the layout flags of `ultrascale memory`, on sliders.
const SLIDERS = [["dp", POW2(1, 1024), 8], ["tp", POW2(1, 64), 1], ["pp", POW2(1, 64), 1],
                 ["cp", POW2(1, 32), 1], ["ep", POW2(1, 64), 1], ["zero", [0, 1, 2, 3], 1],
                 ["mbs", POW2(1, 64), 1], ["grad_accum", POW2(1, 256), 1],
                 ["seq_len", POW2(512, 131072), 4096], ["pp_virtual_stages", [1, 2, 4, 8], 1]];
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

// A slider's value, its list of positions extended when the value is not on it (a layout of the
// planner may use 512 micro-batches or dp 3).
function setSlider(name, value) {
  const [, values] = SLIDERS.find(s => s[0] === name);
  const v = +value;
  if (!values.includes(v)) { values.push(v); values.sort((a, b) => a - b); }
  const input = $(`slider-${name}`);
  input.max = values.length - 1;
  input.value = values.indexOf(v);
  input.dispatchEvent(new Event("show"));
}

function buildMemoryControls() {
  fillSelect($("memory-preset"), OPTIONS.presets, started("m", "preset") || "llama3-8b");
  for (const [name, values, start] of SLIDERS) {
    const row = document.createElement("div");
    row.className = "slider";
    const input = Object.assign(document.createElement("input"), {
      type: "range", min: 0, max: values.length - 1, step: 1, id: `slider-${name}`,
      value: values.indexOf(start) });
    input.dataset.flag = name;
    const out = document.createElement("output");
    out.id = `slider-${name}-value`;
    const show = () => { out.value = values[+input.value]; };
    input.addEventListener("input", show);
    input.addEventListener("show", show);
    show();
    row.append(Object.assign(document.createElement("span"), { textContent: name }), input, out);
    $("memory-sliders").append(row);
    if (started("m", name) !== undefined) setSlider(name, started("m", name));
  }
  const pick = (name, values, chosen) => {
    const select = Object.assign(document.createElement("select"), { name });
    fillSelect(select, values, chosen);
    return select;
  };
  const c = OPTIONS.choices;
  const m = name => started("m", name);
  $("memory-sliders").append(
    labelled("recompute", pick("recompute", c.recompute, m("recompute") || "none")),
    labelled("precision", pick("dtype", c.dtype, m("dtype") || "bf16")),
    labelled("pp schedule", pick("pp_schedule", c.pp_schedule, m("pp_schedule") || "1f1b")),
    labelled("sequence parallel", Object.assign(document.createElement("input"),
                                                { type: "checkbox", name: "sequence_parallel",
                                                  checked: m("sequence_parallel") === "true" })));
  $("memory-device").append(
    // (no GPU is saved as no `m.gpu`: the default h100 only for a page opened without a state)
    labelled("GPU", pick("gpu", ["", ...OPTIONS.gpus], m("gpu") ?? (
      [...START.keys()].some(k => k.startsWith("m.")) ? "" : "h100"))),
    labelled("runtime", pick("runtime", c.runtime, m("runtime") || "ultrascale")));
  for (const name of SIZES) {
    $("memory-sizes").append(labelled(name, Object.assign(document.createElement("input"),
                                                          { name, type: "number", min: 1,
                                                            value: m(name) ?? "" })));
  }
  if (SIZES.some(name => m(name))) $("memory-sizes").parentElement.open = true;
  $("memory-form").hf_config.value = m("hf_config") || "";
  // A size set by hand belongs to the model it was set on: another preset or config starts from
  // its own sizes (they show in the boxes, greyed, until one is typed over).
  const resetSizes = () => { for (const name of SIZES) $("memory-form")[name].value = ""; };
  $("memory-preset").addEventListener("change", resetSizes);
  $("memory-form").hf_config.addEventListener("change", resetSizes);
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
    saveState();
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
  const form = $("memory-form");
  for (const name of SIZES) form[name].placeholder = r.model[name] ?? "";  // the model's own
  const verdict = $("memory-verdict");
  verdict.replaceChildren(`${fmtBytes(r.total)} per device, ${r.rank_desc}`);
  if (r.device_memory != null) {
    const span = document.createElement("span");
    span.className = r.fits ? "fits" : "nofit";
    span.textContent = r.fits ? " fits" : " does NOT fit";
    verdict.append(":", span, ` in ${fmtBytes(r.device_memory)}` +
                   (r.reserved !== r.total ? ` (reserved with fragmentation: ${fmtBytes(r.reserved)})` : ""));
  }
  const byHand = SIZES.filter(name => form[name].value);
  if (byHand.length) {  // (said, so that a size typed for another model is never silently kept)
    const span = document.createElement("span");
    span.id = "memory-overrides";
    span.textContent = `; sizes set by hand: ${byHand.map(n => `${n}=${form[n].value}`).join(", ")}`;
    verdict.append(span);
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
const plan = { done: false, last: null };
const PLAN_FIELDS = ["gpus", "gpu", "global_batch_tokens", "seq_len", "dtype", "top"];

// The query of the layouts form: the flags of `ultrascale plan`.
function planQuery() {
  const form = $("plan-form"), q = new URLSearchParams();
  const hf = form.hf_config.value.trim();
  if (hf) q.set("hf_config", hf); else q.set("preset", form.preset.value);
  for (const name of PLAN_FIELDS) if (form[name].value) q.set(name, form[name].value);
  return q;
}

function buildPlanControls() {
  const form = $("plan-form"), p = name => started("p", name);
  fillSelect($("plan-preset"), OPTIONS.presets, p("preset") || "llama3-8b");
  fillSelect($("plan-gpu"), OPTIONS.gpus, p("gpu") || "h100");
  form.hf_config.value = p("hf_config") || "";
  for (const name of PLAN_FIELDS) if (p(name) !== undefined) form[name].value = p(name);
  form.addEventListener("submit", runPlan);
}

async function runPlan(event) {
  if (event) event.preventDefault();
  plan.done = true;
  const form = $("plan-form");
  $("plan-summary").textContent = "planning…";
  saveState();
  try {
    renderPlan(await getJSON(`/api/plan?${planQuery()}`), form);
    showError("plan-error", null);
  } catch (err) {
    $("plan-summary").textContent = "";
    showError("plan-error", err);
  }
}

// `dp=8,tp=2,...`: a row's layout as `--layout` takes it.
function layoutArg(fields) {
  return Object.entries(fields).filter(([, v]) => v !== null).map(([k, v]) => `${k}=${v}`)
    .join(",");
}

function renderPlan(p, form) {
  plan.last = p;
  $("plan-summary").textContent = `${p.considered} layouts considered for ${form.gpus.value} x ` +
    `${form.gpu.value}; ${p.ranked.length ? "the fastest that fit:" : "none fits in memory."}`;
  const rows = p.ranked.length ? p.ranked : (p.smallest ? [p.smallest] : []);
  const table = $("plan-table");
  const head = "<tr><th>#</th><th>layout</th><th>memory</th><th>tokens/s/device</th><th>MFU</th>" +
               "<th>step</th><th>dominant cost</th><th></th></tr>";
  table.innerHTML = head;
  rows.forEach((r, i) => {
    const tr = table.insertRow();
    tr.className = i === 0 && p.ranked.length ? "first" : "";
    tr.dataset.layout = r.layout;
    const same = (r.same_time || []).length ? ` (same time: ${r.same_time.join(", ")})` : "";
    for (const text of [i + 1, r.layout + same,
                        r.memory_bytes != null ? fmtBytes(r.memory_bytes) : "?",
                        fmtNum(r.tokens_per_s_per_device), `${(r.mfu * 100).toFixed(1)}%`,
                        `${(r.step_time_s * 1e3).toFixed(0)} ms`, r.dominant]) {
      tr.insertCell().textContent = text;
    }
    // Its memory breakdown in the Memory view, and its `ultrascale train` config to download.
    const cell = tr.insertCell();
    const show = Object.assign(document.createElement("button"), {
      type: "button", className: "to-memory", textContent: "memory",
      title: "this layout's memory, part by part" });
    show.addEventListener("click", () => openInMemory(r.layout_fields));
    const q = planQuery();
    q.set("layout", layoutArg(r.layout_fields));
    if (r.split_given) q.set("pp_layers", r.pp_layers.join(","));  // the row's balanced split
    q.delete("top");
    q.delete("global_batch_tokens");
    const link = Object.assign(document.createElement("a"), {
      className: "config", href: `/api/config?${q}`, textContent: "config",
      title: "its `ultrascale train` config (plan.yaml)" });
    link.download = "plan.yaml";
    cell.append(show, " ", link);
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

// A layout of the plan in the Memory view: the plan's model and GPU, the layout's every knob.
function openInMemory(fields) {
  const mform = $("memory-form"), pform = $("plan-form");
  mform.hf_config.value = pform.hf_config.value;
  mform.preset.value = pform.preset.value;
  for (const name of SIZES) mform[name].value = "";
  for (const [name] of SLIDERS) if (fields[name] != null) setSlider(name, fields[name]);
  for (const name of ["recompute", "dtype", "pp_schedule"]) mform[name].value = fields[name];
  mform.sequence_parallel.checked = !!fields.sequence_parallel;
  if (OPTIONS.gpus.includes(pform.gpu.value)) mform.gpu.value = pform.gpu.value;
  showView("memory");
  updateMemory();
}

// ------------------------------------------------------------------------------------ Runs view
// A run, or two overlaid (`compare`): each line named `run: line` then.
const runs = { listed: false, timer: null, open: null, compare: "" };

async function loadRunList() {
  runs.listed = true;
  try {
    const d = await getJSON("/api/runs");
    const option = (r, prefix = "") => {
      const o = document.createElement("option");
      o.value = r.path; o.dataset.kind = r.kind;
      o.textContent = prefix + (r.kind === "sweep" ? "sweep: " : "") + r.label;
      return o;
    };
    const select = $("runs-select");
    select.replaceChildren(...d.runs.map(r => option(r)));
    const none = Object.assign(document.createElement("option"), { value: "",
                                                                  textContent: "(none)" });
    $("runs-compare").replaceChildren(none, ...d.runs.filter(r => r.kind === "run")
      .map(r => option(r)));
    $("runs-status").textContent = d.runs.length ? "" :
      `no run yet under ${d.roots.join(", ")}: start \`ultrascale train\`, or \`ultrascale ui --runs-dir DIR\``;
    const wanted = runs.open || started("r", "run");
    const compare = runs.compare || started("r", "compare") || "";
    if (d.runs.some(r => r.path === compare)) $("runs-compare").value = compare;
    if (wanted && d.runs.some(r => r.path === wanted)) {
      select.value = wanted;
      if (wanted !== runs.open || $("runs-compare").value !== (runs.compare || "")) openSelected();
    } else if (d.runs.length) openSelected();
  } catch (err) { showError("runs-error", err); }
}

function openSelected() {
  const option = $("runs-select").selectedOptions[0];
  if (!option) return;
  clearInterval(runs.timer);
  runs.open = option.value;
  runs.compare = option.dataset.kind === "sweep" ? "" : $("runs-compare").value;
  saveState();
  showError("runs-error", null);
  if (option.dataset.kind === "sweep") openSweep(option.value);
  else openRun([option.value, runs.compare].filter((p, i, all) => p && all.indexOf(p) === i));
}

function runLabel(path) {
  const option = [...$("runs-select").options].find(o => o.value === path);
  return option ? option.textContent : path;
}

function openRun(paths) {
  $("sweep-view").hidden = true;
  const grid = $("runs-charts");
  grid.hidden = false;
  grid.replaceChildren();
  for (const chart of Object.keys(OPTIONS.charts)) {
    grid.append(svgEl("svg", { id: `run-${chart}`, class: "chart", viewBox: "0 0 460 230" }));
  }
  const group = paths.map(path => ({ path, label: runLabel(path), next: 0, series: {},
                                     last: null }));
  for (const state of group) for (const chart of Object.keys(OPTIONS.charts)) state.series[chart] = {};
  runs.state = group;
  pollRuns(group);
  runs.timer = setInterval(() => pollRuns(group), POLL_MS);
}

async function pollRun(state) {
  const d = await getJSON(`/api/run?path=${encodeURIComponent(state.path)}&after=${state.next}`);
  if (d.reset) for (const c in state.series) state.series[c] = {};
  for (const [chart, lines] of Object.entries(d.series)) {
    for (const [name, points] of Object.entries(lines)) {
      (state.series[chart][name] ||= []).push(...points);
    }
  }
  const fresh = d.steps.length > 0 || d.reset || state.next === 0;
  state.next = d.next;
  if (d.steps.length) state.last = d.steps[d.steps.length - 1];
  return fresh;
}

async function pollRuns(group) {
  if (group.busy) return;  // (one read at a time: two from the same line would add points twice)
  group.busy = true;
  try {
    const fresh = await Promise.all(group.map(pollRun));
    if (runs.state !== group) return;
    if (fresh.some(Boolean)) {
      for (const [chart, [title, unit]] of Object.entries(OPTIONS.charts)) {
        const lines = {};
        for (const state of group) {
          for (const [name, points] of Object.entries(state.series[chart])) {
            lines[group.length > 1 ? `${state.label}: ${name}` : name] = points;
          }
        }
        lineChart($(`run-${chart}`), lines, { title, unit, empty: chart === "mfu"
          ? "unknown: the device's peak rate is not known (e.g. a CPU)" : "not logged" });
      }
    }
    $("runs-status").textContent = `last step ${group.map(s => s.last ?? "–").join(" / ")}; ` +
      `read every ${POLL_MS / 1000} s (at ${new Date().toLocaleTimeString()})`;
  } catch (err) {
    showError("runs-error", err);
  } finally {
    group.busy = false;
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
  buildPlanControls();
  $("runs-select").addEventListener("change", openSelected);
  $("runs-compare").addEventListener("change", openSelected);
  $("runs-refresh").addEventListener("click", loadRunList);
  for (const tab of document.querySelectorAll(".tab")) {
    tab.addEventListener("click", () => showView(tab.dataset.view));
  }
  showView(location.hash.slice(1) || "memory");
  updateMemory();
  document.body.dataset.ready = "true";  // (the browser test waits for it)
}

start();
