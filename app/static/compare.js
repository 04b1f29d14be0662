"use strict";
// Compare runs: metrics overlaid (live while a run is going: its stream feeds its series), configs side by side
// with differences highlighted, and the same prompt's rollouts from each run next to each other.
(() => {
  const { api, el, num, PALETTE } = Collage;
  const { Chart, bindSmoothing, parseEvent } = CollageCharts;
  const ids = document.getElementById("compare").dataset.runs.split(",");
  const ENDED = ["succeeded", "failed", "cancelled"];
  const STREAMS_MAX = 4;  // a browser keeps about 6 connections per server: more live runs are polled instead
  const charts = new Map();  // metric key -> Chart
  const shown = k => !k.startsWith("timing/") && k !== "num_tokens";
  for (const s of document.querySelectorAll(".swatch")) {  // the theme's series colours, as the charts use them
    const i = Number(s.dataset.index) % PALETTE.length;
    s.style.background = `var(--series-${i + 1}, ${PALETTE[i]})`;
  }

  function flat(obj, prefix = "") {
    return Object.entries(obj || {}).flatMap(([k, v]) => v && typeof v === "object" && !Array.isArray(v) ? flat(v, prefix + k + ".") : [[prefix + k, v]]);
  }

  async function sideBySide(runs) {
    const stepSel = document.getElementById("prompt-step"), rowSel = document.getElementById("prompt-row");
    const box = document.getElementById("side-by-side");
    const show = async () => {
      const cols = await Promise.all(runs.map(r => api(`/runs/${r.id}/samples`, { params: { step: stepSel.value, limit: 200 } })));
      const row = Number(rowSel.value);
      box.replaceChildren(...runs.map((r, i) => {
        const samples = cols[i].items.filter(s => s.dataset_row === row);
        return el("div", { class: "column" }, el("h3", { text: r.name }),
          samples.length ? null : el("p", { class: "muted", text: "no completion of this prompt at this step" }),
          samples[0] ? el("div", { class: "thumbs" }, samples[0].images.map(im => el("img", { src: im.thumb_url, class: "thumb", alt: "image" }))) : null,
          samples.map(s => el("div", { class: "cmp-sample" }, el("pre", { class: "completion", text: s.completion }),
            el("small", { text: `reward ${num(s.reward)} · advantage ${num(s.advantage)}` }))));
      }));
    };
    const first = await Promise.all(runs.map(r => api(`/runs/${r.id}/samples`, { params: { limit: 500 } })));
    const steps = [...new Set(first.flatMap(p => p.items.map(s => s.step)))].sort((a, b) => a - b);
    stepSel.replaceChildren(...steps.map(s => el("option", { value: s, text: s })));
    const refreshRows = async () => {
      const page = await api(`/runs/${runs[0].id}/samples`, { params: { step: stepSel.value, limit: 200 } });
      const rows = [...new Set(page.items.map(s => s.dataset_row))];
      rowSel.replaceChildren(...rows.map(r => el("option", { value: r, text: r })));
      await show();
    };
    stepSel.onchange = refreshRows; rowSel.onchange = show;
    if (steps.length) await refreshRows();
  }

  function addChart(key, runs, metrics) {
    const series = runs.map((r, i) => ({ label: r.name, key, run: r.id, color: i, points: metrics[i][key] || [] }));
    charts.set(key, new Chart(document.getElementById("charts"), { key, series }));
  }

  function legendItem(id) { return document.querySelector(`.legend li[data-run="${CSS.escape(id)}"]`); }
  function showState(id, { status, step, max_steps }) {
    const item = legendItem(id);
    if (!item) return;
    if (status) item.querySelector(".run-status").textContent = status;
    if (step !== undefined) item.querySelector(".run-step").textContent = `step ${step} / ${max_steps}`;
  }

  function onMetrics(runs, runId, step, values) {
    CollageCharts.ingest(runId, step, values);
    for (const key of Object.keys(values).filter(shown).sort()) {
      if (!charts.has(key)) addChart(key, runs, runs.map(r => r.id === runId ? { [key]: [[step, values[key]]] } : {}));
    }
  }

  // A live run's new steps: from its server-sent events, or polled when too many runs are live at once.
  function follow(runs, r, useStream) {
    if (useStream) {
      const source = new EventSource(`/api/v1/runs/${r.id}/stream`);
      source.addEventListener("metrics", e => { const { step, ...values } = parseEvent(e.data); onMetrics(runs, r.id, step, values); });
      source.addEventListener("progress", e => showState(r.id, parseEvent(e.data)));
      source.addEventListener("status", e => {
        const state = parseEvent(e.data);
        showState(r.id, state);
        if (ENDED.includes(state.status) || state.status === "deleted") source.close();
      });
      source.onerror = () => { source.close(); setTimeout(() => follow(runs, r, false), 3000); };
      return;
    }
    let last = -1;
    const poll = async () => {
      const [state, metrics] = await Promise.all([api("/runs/" + r.id), api(`/runs/${r.id}/metrics`, { params: { from_step: last + 1 } })]);
      const byStep = new Map();
      for (const [key, points] of Object.entries(metrics)) for (const [step, value] of points) {
        if (!byStep.has(step)) byStep.set(step, {});
        byStep.get(step)[key] = value;
        last = Math.max(last, step);
      }
      for (const [step, values] of [...byStep].sort((a, b) => a[0] - b[0])) onMetrics(runs, r.id, step, values);
      showState(r.id, { status: state.status, ...state.progress });
      if (!ENDED.includes(state.status)) setTimeout(poll, 5000);
    };
    poll().catch(() => setTimeout(() => follow(runs, r, false), 5000));
  }

  bindSmoothing(document.getElementById("smoothing"), document.getElementById("smoothing-value"));
  (async () => {
    const runs = await Promise.all(ids.map(id => api("/runs/" + id)));
    const metrics = await Promise.all(ids.map(id => api(`/runs/${id}/metrics`, { params: { max_points: 500 } })));
    const keys = [...new Set(metrics.flatMap(m => Object.keys(m)))].filter(shown).sort();
    for (const key of ["reward", ...keys.filter(k => k !== "reward")]) {
      if (keys.includes(key)) addChart(key, runs, metrics);
    }
    runs.forEach(r => showState(r.id, { status: r.status, ...r.progress }));
    const live = runs.filter(r => !ENDED.includes(r.status));
    live.forEach((r, i) => follow(runs, r, i < STREAMS_MAX));
    const configs = runs.map(r => Object.fromEntries(flat(r.config)));
    const allKeys = [...new Set(configs.flatMap(c => Object.keys(c)))].sort();
    const table = document.getElementById("config-diff");
    table.append(el("tr", {}, el("th", { text: "key" }), runs.map(r => el("th", { text: r.name }))));
    for (const key of allKeys) {
      const values = configs.map(c => JSON.stringify(c[key] ?? null));
      const differs = new Set(values).size > 1;
      table.append(el("tr", { class: differs ? "differs" : "" }, el("td", { text: key }), values.map(v => el("td", { text: v }))));
    }
    await sideBySide(runs);
  })();
})();
