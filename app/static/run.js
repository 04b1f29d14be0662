"use strict";
// The run page: status, progress and time left, a live chart per metric (server-sent events, no reload),
// events with warnings highlighted, and the run's buttons.
(() => {
  const { api, el, num, duration, timeLeft, chart, appendPoint } = Collage;
  const runId = document.getElementById("run").dataset.run;
  const chartsBox = document.getElementById("charts");
  const charts = new Map();
  let lastEvent = null;
  let run = null;

  const ORDER = ["reward", "reward_std", "frac_reward_zero_std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean", "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "loss",
    "grad_norm", "learning_rate", "step_time"];
  const rank = k => { const i = ORDER.indexOf(k); return i === -1 ? (k.startsWith("rewards/") ? 0.5 : 100) : i; };

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
    document.getElementById("cancel").disabled = !["queued", "running"].includes(r.status);
    document.getElementById("resume").disabled = !["failed", "cancelled"].includes(r.status);
    document.getElementById("delete").disabled = !["succeeded", "failed", "cancelled"].includes(r.status);
  }

  async function loadCharts() {
    const metrics = await api(`/runs/${runId}/metrics`, { params: { max_points: 1000 } });
    const keys = Object.keys(metrics).filter(k => !k.startsWith("timing/") && k !== "num_tokens").sort((a, b) => rank(a) - rank(b) || a.localeCompare(b));
    for (const key of keys) {
      if (charts.has(key)) continue;
      charts.set(key, chart(chartsBox, key, [{ label: key, points: metrics[key] }]));
    }
  }

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
    const source = new EventSource(`/api/v1/runs/${runId}/stream`);
    source.addEventListener("metrics", async e => {
      const { step, ...values } = JSON.parse(e.data);
      for (const [key, value] of Object.entries(values)) {
        if (key.startsWith("timing/") || key === "num_tokens") continue;
        if (charts.has(key)) appendPoint(charts.get(key), step, value);
        else await loadCharts();
      }
    });
    const refresh = async () => { render(await api("/runs/" + runId)); loadEvents(); };
    source.addEventListener("progress", refresh);
    source.addEventListener("status", async e => {
      await refresh();
      if (["succeeded", "failed", "cancelled"].includes(JSON.parse(e.data).status)) { source.close(); loadCharts(); }
    });
    source.onerror = () => { source.close(); setTimeout(() => { if (!["succeeded", "failed", "cancelled"].includes(run?.status)) stream(); }, 3000); };
  }

  async function act(path, method = "POST") {
    try { await api(`/runs/${runId}${path}`, { method }); render(await api("/runs/" + runId)); loadEvents(); }
    catch (err) { alert(err.body?.detail || String(err)); }
  }
  document.getElementById("cancel").onclick = () => act("/cancel");
  document.getElementById("resume").onclick = async () => { await act("/resume"); stream(); };
  document.getElementById("delete").onclick = async () => {
    if (!confirm("Delete this run with its metrics and rollouts?")) return;
    await api("/runs/" + runId, { method: "DELETE" });
    location.href = "/runs";
  };

  (async () => {
    render(await api("/runs/" + runId));
    await Promise.all([loadCharts(), loadEvents()]);
    if (!["succeeded", "failed", "cancelled"].includes(run.status)) stream();
  })();
})();
