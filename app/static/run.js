"use strict";
// The run page: status, progress and time left, a live chart per metric and one of every reward function's mean
// and weighted contribution (server-sent events, no reload), a per-step completion-length histogram, events with
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
    document.getElementById("time-left").textContent = left === null ? (r.finished_at ? "ended" : "–") : duration(left) + " left";
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
    document.getElementById("delete").disabled = !mayChange || !ENDED.includes(r.status);
    document.getElementById("edit-meta").disabled = !mayChange;
    renderMeta(r);
  }

  // ---- charts

  // The chart goes where its rank puts it among the charts already on the page.
  function place(key) {
    for (const [other, chart] of charts) if (rank(other) > rank(key) || (rank(other) === rank(key) && other.localeCompare(key) > 0)) return chart.box;
    return null;
  }
  function resort() {  // the map in page order, so place() finds the first chart ranked after a new one
    const sorted = [...charts.entries()].sort(([a], [b]) => rank(a) - rank(b) || a.localeCompare(b));
    charts.clear();
    for (const [k, c] of sorted) charts.set(k, c);
  }

  function addChart(key, points) {
    const chart = new Chart(chartsBox, { key, before: place(key), series: [{ label: key, key, run: runId, points }] });
    charts.set(key, chart);
    resort();
    return chart;
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
    const chart = new Chart(chartsBox, { key: OVERLAY, title: "reward functions: mean and weighted contribution", before: place(OVERLAY), series });
    charts.set(OVERLAY, chart);
    resort();
  }

  async function loadCharts() {
    const metrics = await api(`/runs/${runId}/metrics`, { params: { max_points: 1000 } });
    const keys = Object.keys(metrics).filter(shown).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    for (const key of keys) {
      if (charts.has(key)) charts.get(key).setPoints(0, metrics[key]);
      else addChart(key, metrics[key]);
    }
    addOverlay(metrics);
  }

  function onMetrics(step, values) {
    const fresh = {};
    for (const [key, value] of Object.entries(values)) {
      if (!shown(key)) continue;
      if (!charts.has(key)) fresh[key] = [[step, value]];
    }
    CollageCharts.ingest(runId, step, values);
    for (const key of Object.keys(fresh).sort((a, b) => rank(a) - rank(b) || a.localeCompare(b))) addChart(key, fresh[key]);
    if (!charts.has(OVERLAY)) addOverlay(Object.fromEntries(Object.entries(values).map(([k, v]) => [k, [[step, v]]])));
  }

  // ---- events, stream

  async function loadEvents() {
    const page = await api(`/runs/${runId}/events`, { params: { after: lastEvent } });
    const list = document.getElementById("events");
    for (const e of page.items) {
      list.append(el("li", { class: "event level-" + e.level },
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
