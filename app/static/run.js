"use strict";
// The run page: status, progress and time left, a live chart per metric and one of every reward function's mean
// and weighted contribution (server-sent events, no reload), the held-out evaluation's metrics in a section of
// their own (eval/reward over the training reward, the eval reward per number of images in one chart), a
// per-step completion-length histogram, events with
// warnings highlighted, editable tags and notes, and the run's buttons (cancel and delete ask first).
(() => {
  const { api, el, duration, timeLeft } = Collage;
  const { Chart, Histogram, bindSmoothing, parseEvent } = CollageCharts;
  const runId = document.getElementById("run").dataset.run;
  const mayChange = document.getElementById("run").dataset.mayChange === "1";
  const chartsBox = document.getElementById("charts");
  const charts = new Map();  // metric key -> Chart
  const ENDED = ["succeeded", "failed", "cancelled"];
  const OVERLAY = "rewards/overlay";
  let lastEvent = null;
  let run = null;
  let histogram = null;
  let source = null;
  let queuedRefresh = null;

  const ORDER = ["reward", OVERLAY, "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "loss",
    "grad_norm", "learning_rate", "step_time"];
  const rank = k => { const i = ORDER.indexOf(k); return i === -1 ? (k.startsWith("rewards/") ? 1.5 : 100) : i; };
  const shown = k => !k.startsWith("timing/") && k !== "num_tokens";

  function render(r) {
    run = r;
    document.getElementById("status").textContent = r.status;
    document.getElementById("status").className = "status status-" + r.status;
    const { step, max_steps } = r.progress;
    document.getElementById("bar").style.width = (max_steps ? 100 * step / max_steps : 0) + "%";
    document.getElementById("progress-text").textContent = `step ${step} / ${max_steps}`;
    const left = timeLeft(r);
    document.getElementById("time-left").textContent =
      left === null ? (r.finished_at ? "ended" : "–") : left === "estimating" ? "estimating" : duration(left) + " left";
    document.getElementById("attempt").textContent = r.attempt;
    const error = document.getElementById("error");
    error.hidden = !r.error; error.textContent = r.error || "";
    // live, not an event written at submit: a worker that starts a moment later makes the note go away
    const note = document.getElementById("queue-note");
    const queue = r.config?.resources?.queue || "default";
    note.hidden = !(r.status === "queued" && r.queue_workers === 0);
    note.textContent = note.hidden ? "" : `No live worker takes runs from queue "${queue}": the run waits until one starts (collage worker --queues ${queue}).`;
    // a queued run's place, wait and workers change without a status event: look again while it waits
    clearTimeout(queuedRefresh);
    if (r.status === "queued") queuedRefresh = setTimeout(async () => { try { render(await api("/runs/" + runId)); } catch { /* next event */ } }, 10000);
    // a run the user may not change (another member's): its buttons stay disabled, the page says why (run.html)
    document.getElementById("cancel").disabled = !mayChange || !["queued", "running"].includes(r.status);
    document.getElementById("resume").disabled = !mayChange || !["failed", "cancelled"].includes(r.status);
    resumeLabel(r);
    document.getElementById("delete").disabled = !mayChange || !ENDED.includes(r.status);
    document.getElementById("edit-meta").disabled = !mayChange;
    renderMeta(r);
  }

  // ---- charts

  // Evaluation (eval/* keys, logged at evaluation steps only): charts of their own, in an "Evaluation" section
  // beside the training ones. A metric with a training counterpart is drawn over it (the training values faint,
  // every step; the evaluation's as points joined by a line); eval/by_images/<n>/reward, one per number of
  // images in the prompt, share one chart with a series per count.
  const isEval = k => k.startsWith("eval/");
  const BY_IMAGES = "eval/by_images";
  const byImages = k => /^eval\/by_images\/([^/]+)\/reward$/.exec(k)?.[1] ?? null;  // "3", "8+" or null
  const chartOf = k => byImages(k) !== null ? BY_IMAGES : k;
  const evalRank = k => k === "eval/reward" ? 0 : k === BY_IMAGES ? 1 : k.startsWith("eval/pass@") ? 2
    : k.startsWith("eval/rewards/") ? 3 : k === "eval/completion_length" ? 4 : 5;
  const twin = k => k === "eval/reward" ? "reward" : k === "eval/completion_length" ? "completions/mean_length"
    : /^eval\/rewards\/.+\/mean$/.test(k) ? k.slice(5) : null;  // the training metric an eval metric is drawn over
  const countOrder = n => parseInt(n, 10) + (n.endsWith("+") ? 0.5 : 0);
  // one colour per count (0..7 exact, the last bucket "8+" dashed: the palette has 8 colours)
  const countSeries = (key, points) => {
    const n = byImages(key);
    return { label: `${n} image${n === "1" ? "" : "s"}`, key, run: runId, markers: true, color: parseInt(n, 10),
      dash: n.endsWith("+") ? [5, 3] : undefined, points };
  };

  const training = { charts, rank, box: () => chartsBox };
  const evaluation = { charts: new Map(), rank: evalRank, box: evalBox };
  const groupOf = chartKey => isEval(chartKey) ? evaluation : training;
  let evalSection = null;
  function evalBox() {  // the Evaluation section, made when the run's first eval metric arrives
    if (!evalSection) {
      evalSection = el("section", { id: "evaluation" },
        el("div", { class: "toolbar chart-controls" }, el("h2", { text: "Evaluation" }),
          el("small", { class: "muted", text: "held-out rows, at each evaluation step · training values faint for comparison" })),
        el("div", { id: "eval-charts", class: "charts" }));
      chartsBox.closest("section").after(evalSection);
    }
    return evalSection.querySelector("#eval-charts");
  }

  // The chart goes where its rank puts it among the charts already in its section.
  function place(group, key) {
    for (const [other, chart] of group.charts) if (group.rank(other) > group.rank(key) || (group.rank(other) === group.rank(key) && other.localeCompare(key) > 0)) return chart.box;
    return null;
  }
  function resort(group) {  // the map in page order, so place() finds the first chart ranked after a new one
    const sorted = [...group.charts.entries()].sort(([a], [b]) => group.rank(a) - group.rank(b) || a.localeCompare(b));
    group.charts.clear();
    for (const [k, c] of sorted) group.charts.set(k, c);
  }
  const byRank = group => (a, b) => group.rank(a) - group.rank(b) || a.localeCompare(b);

  // What a training chart already holds of a metric (its history, for an eval chart made mid-run).
  function known(key) {
    const series = charts.get(key)?.series.find(s => s.key === key && s.scale === 1);
    return series ? [...series.values] : [];
  }

  // The series of a new chart from `metrics` ({key: points}); for a by-images chart, one per count present.
  function seriesFor(chartKey, metrics) {
    if (chartKey === BY_IMAGES) {
      return Object.keys(metrics).filter(k => byImages(k) !== null).sort((a, b) => countOrder(byImages(a)) - countOrder(byImages(b)))
        .map(k => countSeries(k, metrics[k]));
    }
    if (!isEval(chartKey)) return [{ label: chartKey, key: chartKey, run: runId, points: metrics[chartKey] }];
    const evalSeries = { label: chartKey, key: chartKey, run: runId, markers: true, color: 1, points: metrics[chartKey] };
    const train = twin(chartKey);
    if (!train) return [{ ...evalSeries, color: 0 }];
    const history = new Map(known(train));  // made mid-run: the training chart's points, then this step's
    for (const [x, y] of metrics[train] || []) history.set(x, y);
    const points = [...history].sort((a, b) => a[0] - b[0]);
    return [{ label: `${train} (training)`, key: train, run: runId, faint: true, color: 0, points }, evalSeries];
  }

  const TITLES = { "eval/reward": "eval/reward over the training reward", [BY_IMAGES]: "eval reward per image count" };

  function addChart(chartKey, metrics) {
    const group = groupOf(chartKey);
    const chart = new Chart(group.box(), { key: chartKey, title: TITLES[chartKey], before: place(group, chartKey), series: seriesFor(chartKey, metrics) });
    group.charts.set(chartKey, chart);
    resort(group);
    return chart;
  }

  // A by-images count seen for the first time gets its series in the existing chart.
  function addCount(key, points) {
    const chart = evaluation.charts.get(BY_IMAGES);
    if (!chart || chart.series.some(s => s.key === key)) return;
    const order = countOrder(byImages(key));
    const at = chart.series.findIndex(s => countOrder(byImages(s.key)) > order);
    chart.addSeries(countSeries(key, points), at === -1 ? chart.series.length : at);
  }

  // Every reward function's mean with its weighted contribution (mean × weight from the config): the weighted
  // lines of all functions add up to the reward.
  function addOverlay(metrics) {
    const rewards = (run.config?.rewards || []).filter(r => `rewards/${r.name}/mean` in metrics);
    if (!rewards.length || charts.has(OVERLAY)) return;
    const series = rewards.flatMap((r, i) => {
      const key = `rewards/${r.name}/mean`, color = i, weight = r.weight ?? 1;
      return [
        { label: `${r.name} mean`, key, run: runId, color, points: metrics[key] },
        { label: `${r.name} × ${weight}`, key, run: runId, color, dash: [6, 4], scale: weight, points: metrics[key] },
      ];
    });
    const chart = new Chart(chartsBox, { key: OVERLAY, title: "reward functions: mean and weighted contribution", before: place(training, OVERLAY), series });
    charts.set(OVERLAY, chart);
    resort(training);
  }

  async function loadCharts() {
    const metrics = await api(`/runs/${runId}/metrics`, { params: { max_points: 1000 } });
    for (const group of [training, evaluation]) {  // what the charts have: every series from the stored points
      for (const chart of group.charts.values()) chart.series.forEach((s, i) => { if (s.key in metrics) chart.setPoints(i, metrics[s.key]); });
    }
    const keys = Object.keys(metrics).filter(shown);
    for (const key of keys.filter(k => !isEval(k)).sort(byRank(training))) if (!charts.has(key)) addChart(key, metrics);
    for (const key of [...new Set(keys.filter(isEval).map(chartOf))].sort(byRank(evaluation))) if (!evaluation.charts.has(key)) addChart(key, metrics);
    for (const key of keys.filter(k => byImages(k) !== null)) addCount(key, metrics[key]);
    addOverlay(metrics);
    // how many loads from the store have finished: what a script (or a browser test) waits on after the run ends
    document.body.dataset.chartLoads = String(Number(document.body.dataset.chartLoads || 0) + 1);
  }

  function onMetrics(step, values) {
    const fresh = new Set(), counts = [];
    for (const key of Object.keys(values)) {
      if (!shown(key)) continue;
      const chartKey = chartOf(key);
      if (!groupOf(chartKey).charts.has(chartKey)) fresh.add(chartKey);
      else if (chartKey === BY_IMAGES && !evaluation.charts.get(BY_IMAGES).series.some(s => s.key === key)) counts.push(key);
    }
    CollageCharts.ingest(runId, step, values);
    const points = Object.fromEntries(Object.entries(values).map(([k, v]) => [k, [[step, v]]]));
    for (const chartKey of [...fresh].filter(k => !isEval(k)).sort(byRank(training))) addChart(chartKey, points);
    for (const chartKey of [...fresh].filter(isEval).sort(byRank(evaluation))) addChart(chartKey, points);
    for (const key of counts) addCount(key, points[key]);
    if (!charts.has(OVERLAY)) addOverlay(points);
  }

  // A resume continues from the newest checkpoint; a run that ended without one (it failed at step 0, or before its
  // first save) starts again from step 0, so its button says so instead of promising a resume.
  let resumeAsked = null;
  async function resumeLabel(r) {
    const button = document.getElementById("resume");
    if (!["failed", "cancelled"].includes(r.status)) { button.textContent = "Resume"; button.title = ""; return; }
    const key = `${r.id}:${r.attempt}`;
    if (resumeAsked === key) return;
    resumeAsked = key;
    let saved = r.progress.step > 0;
    try { saved = (await api(`/runs/${runId}/checkpoints`)).items.length > 0; }
    catch { /* no list (an old server): judge by the step */ }
    button.textContent = saved ? "Resume" : "Run again";
    button.title = saved ? "continue from the newest checkpoint, as a new attempt"
      : "the run has no checkpoint: a new attempt starts again from step 0";
    button.dataset.fromCheckpoint = String(saved);
  }

  // ---- events, stream

  // One load at a time: a status and a progress event arriving together would otherwise both ask for the events
  // after the same id and show the new ones (a run's terminal event) twice.
  let eventsLoading = Promise.resolve();
  function loadEvents() {
    eventsLoading = eventsLoading.then(loadNewEvents, loadNewEvents);
    return eventsLoading;
  }

  async function loadNewEvents() {
    const page = await api(`/runs/${runId}/events`, { params: { after: lastEvent } });
    const list = document.getElementById("events");
    for (const e of page.items) {
      if (list.querySelector(`li[data-event-id="${e.id}"]`)) continue;
      list.append(el("li", { class: "event level-" + e.level, "data-event-id": String(e.id) },
        el("time", { text: new Date(e.time).toLocaleTimeString() }), " ",
        el("span", { class: "level", text: e.level }), " ",
        el("pre", { text: e.message })));
    }
    lastEvent = page.last_id;
  }

  function stream() {
    if (source) source.close();
    source = new EventSource(`/api/v1/runs/${runId}/stream`);
    const mine = source;
    source.addEventListener("metrics", e => {
      const { step, ...values } = parseEvent(e.data);
      onMetrics(step, values);
    });
    const refresh = async () => { render(await api("/runs/" + runId)); loadEvents(); histogram.refresh(); };
    source.addEventListener("progress", refresh);
    source.addEventListener("status", async e => {
      await refresh();
      if (ENDED.includes(parseEvent(e.data).status)) { mine.close(); loadCharts(); }
    });
    // the token or session behind the page ended (revoked, logged out): stop and say so instead of retrying
    source.addEventListener("unauthorized", () => {
      mine.close(); source = null;
      showError({ body: { detail: "Your session ended (logged out, or its token was revoked): log in again to follow this run." } });
    });
    source.onerror = () => {
      mine.close();
      setTimeout(() => { if (source === mine && !ENDED.includes(run?.status)) stream(); }, 3000);
    };
  }

  // ---- confirmation dialog (a real step in the page: window.confirm can be suppressed by the browser)

  function ask({ title, text, yes, no }) {
    const dialog = document.getElementById("confirm");
    document.getElementById("confirm-title").textContent = title;
    document.getElementById("confirm-text").textContent = text;
    const yesBtn = document.getElementById("confirm-yes"), noBtn = document.getElementById("confirm-no");
    yesBtn.textContent = yes; noBtn.textContent = no;
    return new Promise(resolve => {
      const done = answer => { yesBtn.onclick = noBtn.onclick = dialog.oncancel = null; dialog.close(); resolve(answer); };
      yesBtn.onclick = () => done(true);
      noBtn.onclick = () => done(false);
      dialog.oncancel = e => { e.preventDefault(); done(false); };  // Escape keeps things as they are
      dialog.showModal();
      noBtn.focus();
    });
  }

  async function act(path, method = "POST") {
    try { await api(`/runs/${runId}${path}`, { method }); render(await api("/runs/" + runId)); loadEvents(); }
    catch (err) { showError(err); }
  }
  function showError(err) {
    const box = document.getElementById("error");
    const detail = err.body?.detail;
    box.textContent = typeof detail === "string" ? detail : Array.isArray(detail) ? detail.map(d => `${d.path}: ${d.message}`).join("; ") : String(err);
    box.hidden = false;
  }

  document.getElementById("cancel").onclick = async () => {
    const queued = run?.status === "queued";
    const ok = await ask({
      title: "Cancel this run?",
      text: queued ? "It has not started yet: it is cancelled at once." : "The worker saves a checkpoint at its next step, then stops. You can resume it later from that checkpoint.",
      yes: "Cancel run", no: "Keep running",
    });
    if (ok) await act("/cancel");
  };
  document.getElementById("resume").onclick = async () => { await act("/resume"); stream(); };
  document.getElementById("delete").onclick = async () => {
    const ok = await ask({ title: "Delete this run?", text: "Its metrics, rollouts and checkpoints are deleted. This cannot be undone.", yes: "Delete run", no: "Keep it" });
    if (!ok) return;
    try { await api("/runs/" + runId, { method: "DELETE" }); location.href = "/runs"; }
    catch (err) { showError(err); }
  };

  // ---- tags and notes (PATCH /runs/{id})

  const form = document.getElementById("meta-form"), view = document.getElementById("meta-view");
  function renderMeta(r) {
    const tags = document.getElementById("tags");
    tags.replaceChildren(...(r.tags || []).map(t => el("span", { class: "badge tag", text: t })));
    if (!(r.tags || []).length) tags.append(el("span", { class: "muted", text: "none" }));
    const notes = document.getElementById("notes");
    notes.textContent = r.notes || "";
    notes.classList.toggle("muted", !r.notes);
    if (!r.notes) notes.textContent = "none";
  }
  const parseTags = text => text.split(",").map(t => t.trim()).filter(Boolean);
  function clearErrors() {
    for (const node of form.querySelectorAll("[data-error-for]")) node.textContent = "";
    const box = document.getElementById("meta-error"); box.hidden = true; box.textContent = "";
  }
  document.getElementById("edit-meta").onclick = () => {
    document.getElementById("tags-input").value = (run.tags || []).join(", ");
    document.getElementById("notes-input").value = run.notes || "";
    clearErrors();
    view.hidden = true; form.hidden = false;
    document.getElementById("tags-input").focus();
  };
  document.getElementById("cancel-meta").onclick = () => { form.hidden = true; view.hidden = false; };
  form.addEventListener("submit", async e => {
    e.preventDefault();
    clearErrors();
    const tags = parseTags(document.getElementById("tags-input").value);
    const body = { tags, notes: document.getElementById("notes-input").value };
    try {
      render(await api("/runs/" + runId, { method: "PATCH", body }));
      form.hidden = true; view.hidden = false;
    } catch (err) {
      const detail = err.body?.detail;
      if (Array.isArray(detail)) {
        for (const d of detail) {
          const m = /^(?:body\.)?(tags|notes)(?:\[(\d+)\])?/.exec(d.path || "");
          const target = m && form.querySelector(`[data-error-for="${m[1]}"]`);
          const where = m && m[2] !== undefined ? `tag ${Number(m[2]) + 1} (${tags[Number(m[2])] ?? ""}): ` : "";
          if (target) target.textContent = (target.textContent ? target.textContent + " " : "") + where + d.message;
          else { const box = document.getElementById("meta-error"); box.hidden = false; box.textContent += `${d.path}: ${d.message} `; }
        }
      } else {
        const box = document.getElementById("meta-error");
        box.hidden = false;
        box.textContent = err.status === 403 ? `Not saved: ${detail || "you may only change your own runs"}`
          : err.status === 405 || err.status === 404 && !detail?.includes?.("run") ? "Not saved: this server cannot edit runs yet."
          : `Not saved: ${typeof detail === "string" ? detail : String(err)}`;
      }
    }
  });

  // ---- start

  bindSmoothing(document.getElementById("smoothing"), document.getElementById("smoothing-value"));
  (async () => {
    render(await api("/runs/" + runId));
    histogram = new Histogram(document.getElementById("histograms"), runId, { field: "completion_length", title: "Completion length" });
    await Promise.all([loadCharts(), loadEvents(), histogram.load()]);
    if (!ENDED.includes(run.status)) stream();
  })();
})();
