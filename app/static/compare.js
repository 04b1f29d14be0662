"use strict";
// Compare runs: metrics overlaid (live while a run is going: its stream feeds its series), the held-out
// evaluation's metrics in a section of their own, a filter over the charts, the config keys that differ (every key
// on request), and one prompt (its images and answer) with each run's completions of it.
(() => {
  const { api, el, num, PALETTE, promptNode } = Collage;
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

  // ---- the same prompt, each run: pick a step and a dataset row; the prompt (its images and the row's answer) once,
  // then each run's completions of it with their rewards. A run whose prompt for that row differs (another dataset)
  // shows its own.

  const samplesAt = new Map();  // `${run}:${step}` -> that step's rows (a promise)
  function rowsAt(runId, step) {
    const key = `${runId}:${step}`;
    if (!samplesAt.has(key)) samplesAt.set(key, api(`/runs/${runId}/samples`, { params: { step, limit: 500 } }).then(p => p.items));
    return samplesAt.get(key);
  }
  const rowKey = s => s.dataset_row === null || s.dataset_row === undefined ? `group ${s.group}` : `row ${s.dataset_row}`;
  const samePrompt = (a, b) => JSON.stringify(a.prompt) === JSON.stringify(b.prompt) && a.images.map(i => i.sha256).join() === b.images.map(i => i.sha256).join();

  function promptBlock(sample) {
    const columns = Object.entries(sample.columns || {});
    return el("div", { class: "cmp-prompt" },
      el("div", { class: "thumbs" }, sample.images.map((im, i) => el("img", { src: im.thumb_url, class: "thumb", alt: `image ${i + 1} of ${sample.images.length}`,
        title: `${im.width}x${im.height}`, onclick: () => Collage.modal(el("img", { src: im.url, class: "full", alt: `image ${i + 1}` })) }))),
      promptNode(sample.prompt, sample.images),
      columns.length ? el("div", { class: "columns" }, columns.map(([k, v]) => el("span", { class: "column", "data-column": k }, el("b", { text: k + ": " }), v === null ? "–" : String(v)))) : null);
  }

  function completionBlock(run, s) {
    const names = Object.keys(s.rewards || {});
    return el("div", { class: "cmp-sample", "data-id": s.id },
      el("pre", { class: "completion", text: s.completion }),
      el("small", { class: "muted" }, `reward ${num(s.reward)} · advantage ${num(s.advantage)}` + (s.truncated ? " · truncated" : ""),
        names.length ? " · " + names.map(n => `${n} ${num(s.rewards[n])}`).join(" · ") : ""));
  }

  async function sideBySide(runs) {
    const stepSel = document.getElementById("prompt-step"), rowSel = document.getElementById("prompt-row");
    const box = document.getElementById("side-by-side"), shared = document.getElementById("shared-prompt");
    const stepsOf = await Promise.all(runs.map(r => api(`/runs/${r.id}/histogram`, { params: { bins: 1 } }).then(h => h.steps, () => [])));
    const steps = [...new Set(stepsOf.flat())].sort((a, b) => a - b);
    if (!steps.length) { box.replaceChildren(el("p", { class: "muted", text: "No rollouts yet in these runs." })); return; }
    const inAll = steps.filter(s => stepsOf.every(list => list.includes(s)));
    stepSel.replaceChildren(...steps.map(s => el("option", { value: s, text: `${s}` + (inAll.includes(s) ? "" : " (not in every run)") })));
    stepSel.value = String(inAll.length ? inAll[inAll.length - 1] : steps[steps.length - 1]);

    const show = async () => {
      const step = Number(stepSel.value), key = rowSel.value;
      const cols = await Promise.all(runs.map(r => rowsAt(r.id, step)));
      if (Number(stepSel.value) !== step || rowSel.value !== key) return;  // changed meanwhile
      const mine = cols.map(items => items.filter(s => rowKey(s) === key));
      const first = mine.find(m => m.length)?.[0];
      shared.replaceChildren(...(first ? [el("h3", { text: `Prompt · step ${step} · ${key}` }), promptBlock(first)] : []));
      box.replaceChildren(...runs.map((r, i) => el("div", { class: "column", "data-run": r.id }, el("h3", { text: r.name }),
        mine[i].length ? null : el("p", { class: "muted", text: "no completion of this prompt at this step" }),
        mine[i].length && !samePrompt(mine[i][0], first) ? el("div", { class: "own-prompt" }, el("p", { class: "muted", text: "this run's prompt for this row differs:" }), promptBlock(mine[i][0])) : null,
        mine[i].map(s => completionBlock(r, s)))));
      box.dataset.shown = `${step}:${key}`;
    };
    const refreshRows = async () => {
      const step = Number(stepSel.value);
      const cols = await Promise.all(runs.map(r => rowsAt(r.id, step)));
      const counts = new Map();  // row key -> runs that have it at this step
      cols.forEach(items => new Set(items.map(rowKey)).forEach(k => counts.set(k, (counts.get(k) || 0) + 1)));
      const keys = [...counts.keys()].sort((a, b) => counts.get(b) - counts.get(a) || a.localeCompare(b, undefined, { numeric: true }));
      rowSel.replaceChildren(...keys.map(k => el("option", { value: k, text: counts.get(k) === runs.length ? k : `${k} (${counts.get(k)} of ${runs.length} runs)` })));
      await show();
    };
    stepSel.onchange = refreshRows; rowSel.onchange = show;
    await refreshRows();
  }

  // ---- config differences: only the keys whose values differ, every key on request

  function configDiff(runs) {
    const configs = runs.map(r => Object.fromEntries(flat(r.config)));
    const allKeys = [...new Set(configs.flatMap(c => Object.keys(c)))].sort();
    const table = document.getElementById("config-diff"), toggle = document.getElementById("diff-all");
    const summary = document.getElementById("diff-summary");
    const rows = allKeys.map(key => {
      const values = configs.map(c => JSON.stringify(c[key] ?? null));
      return { key, values, differs: new Set(values).size > 1 };
    });
    const differing = rows.filter(r => r.differs).length;
    summary.textContent = differing ? `${differing} of ${rows.length} keys differ` : `The ${rows.length} keys are the same in every run`;
    toggle.parentElement.querySelector(".toggle-label").textContent = `show all ${rows.length} keys`;
    const draw = () => {
      const all = toggle.checked;
      table.replaceChildren(el("tr", {}, el("th", { text: "key" }), runs.map(r => el("th", { text: r.name }))),
        ...rows.filter(r => all || r.differs).map(r => el("tr", { class: r.differs ? "differs" : "", "data-key": r.key },
          el("td", { text: r.key }), r.values.map(v => el("td", { text: v })))));
    };
    toggle.onchange = draw;
    draw();
  }

  // Evaluation metrics (eval/*, logged at evaluation steps only) get their own section, each run's points marked
  // and joined; every other key is a training chart. The chart filter shows the charts whose key contains its text.
  const isEval = k => k.startsWith("eval/");
  const filter = document.getElementById("chart-filter");
  function showChart(chart) { chart.box.hidden = !!filter.value.trim() && !chart.key.includes(filter.value.trim()); }
  filter.addEventListener("input", () => { for (const chart of charts.values()) showChart(chart); });

  function addChart(key, runs, metrics) {
    const evaluation = isEval(key);
    const series = runs.map((r, i) => ({ label: r.name, key, run: r.id, color: i, markers: evaluation, points: metrics[i][key] || [] }));
    if (evaluation) document.getElementById("eval-section").hidden = false;
    const chart = new Chart(document.getElementById(evaluation ? "eval-charts" : "charts"), { key, series });
    charts.set(key, chart);
    showChart(chart);
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
    for (const key of ["reward", "eval/reward", ...keys.filter(k => k !== "reward" && k !== "eval/reward")]) {
      if (keys.includes(key)) addChart(key, runs, metrics);
    }
    runs.forEach(r => showState(r.id, { status: r.status, ...r.progress }));
    const live = runs.filter(r => !ENDED.includes(r.status));
    live.forEach((r, i) => follow(runs, r, i < STREAMS_MAX));
    configDiff(runs);
    await sideBySide(runs);
  })();
})();
