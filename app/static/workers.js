"use strict";
// The operations page: the live workers from GET /api/v1/workers, refreshed every 5 s (rows replaced in place,
// keyed by worker name). Names, hosts and run names are inserted as text only.
(() => {
  const { api, el, when } = Collage;
  const body = document.getElementById("workers-body");
  const empty = document.getElementById("workers-empty");
  const error = document.getElementById("workers-error");

  function age(seconds) {
    if (seconds < 1) return "just now";
    if (seconds < 90) return `${Math.round(seconds)} s ago`;
    return `${Math.round(seconds / 60)} min ago`;
  }

  function meter(fraction, label) {
    const pct = Math.max(0, Math.min(100, fraction * 100));
    const bar = el("div", { class: "bar" });
    bar.style.width = pct.toFixed(0) + "%";
    return el("div", { class: "meter", role: "meter", "aria-label": label, "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": pct.toFixed(0) }, bar);
  }

  function gpuCell(w) {
    if (!w.gpu_slots.length) return el("span", { class: "muted", text: "none (CPU)" });
    if (!w.gpus) return el("span", { class: "muted", text: `slot ${w.gpu_slots.join(", ")}: no details reported` });
    return w.gpus.map(g => {
      const parts = [el("span", { text: `GPU ${g.index}: ${g.name}` })];
      parts.push(g.utilization === null || g.utilization === undefined ? el("span", { class: "muted", text: "util –" }) : meter(g.utilization / 100, `GPU ${g.index} utilisation`));
      const memory = g.memory_total_mb ? `${g.memory_used_mb ?? "?"} / ${g.memory_total_mb} MiB` : "memory –";
      const util = g.utilization === null || g.utilization === undefined ? "" : ` · ${g.utilization}% busy`;
      parts.push(el("small", { class: "gpu-memory", text: memory + util }));
      return el("div", { class: "gpu", "data-gpu": String(g.index) }, parts);
    });
  }

  function runCell(w) {
    if (!w.current_run) return el("span", { class: "muted", text: "idle" });
    const r = w.current_run;
    return el("span", {}, el("a", { href: "/runs/" + encodeURIComponent(r.id), class: "current-run", text: r.name || r.id }),
      r.status ? el("span", { class: `status status-${r.status}`, text: r.status }) : null);
  }

  function row(w, liveWithin) {
    const stale = w.heartbeat_age_s > liveWithin / 2;
    return el("tr", { "data-worker": w.name },
      el("td", { class: "worker-name", text: w.name }),
      el("td", { text: `${w.hostname} (pid ${w.pid})` }),
      el("td", {}, w.queues.map(q => el("span", { class: "queue", text: q }))),
      el("td", {}, runCell(w)),
      el("td", {}, gpuCell(w)),
      el("td", { class: "heartbeat" + (stale ? " stale" : ""), title: w.last_seen, text: age(w.heartbeat_age_s) }),
      el("td", { text: when(w.started_at) }));
  }

  async function refresh() {
    try {
      const data = await api("/workers");
      body.replaceChildren(...data.items.map(w => row(w, data.live_within_s)));
      empty.hidden = data.items.length > 0;
      error.hidden = true;
      body.dataset.loaded = "true";
    } catch (err) {
      error.textContent = "Could not list the workers: " + (err.body?.detail || String(err));
      error.hidden = false;
    }
  }

  refresh();
  setInterval(refresh, 5000);
})();
