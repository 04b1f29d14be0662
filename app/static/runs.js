"use strict";
// The runs table: filters, auto-refresh that updates rows in place (the scroll position never jumps), a queued
// run's place in its queue, the latest and best held-out evaluation reward, and selection for comparing.
(() => {
  const { api, el, num, when, duration, timeLeft, sparkline } = Collage;
  const body = document.getElementById("runs-body");
  const form = document.getElementById("run-filters");
  const compare = document.getElementById("compare");
  const more = document.getElementById("more");
  const selected = new Set();
  let cursor = null;

  const params = () => Object.fromEntries(new FormData(form));

  function row(run) {
    const tr = el("tr", { "data-run": run.id, class: "status-" + run.status });
    const box = el("input", { type: "checkbox", "aria-label": "select " + run.name, onchange: e => {
      e.target.checked ? selected.add(run.id) : selected.delete(run.id);
      compare.disabled = selected.size < 2;
    } });
    box.checked = selected.has(run.id);
    const { step, max_steps } = run.progress;
    const left = timeLeft(run);
    const progress = el("div", { class: "progress" }, el("div", { class: "bar", style: `width:${max_steps ? 100 * step / max_steps : 0}%` }));
    tr.append(
      el("td", {}, box),
      el("td", {}, el("a", { href: "/runs/" + run.id, text: run.name })),
      el("td", { class: "status-cell" }, el("span", { class: "status", text: run.status }), el("small", { class: "queue-place muted" })),
      el("td", { text: run.algorithm }),
      el("td", { text: run.model }),
      el("td", { text: run.dataset }),
      el("td", {}, progress, el("small", { text: `${step}/${max_steps}` + (left !== null ? ` · ${duration(left)} left` : "") })),
      el("td", { class: "reward" }, el("span", { text: num(run.latest_reward) }), el("span", { class: "spark-slot" })),
      // held-out evaluation: "–" for a run without one (yet)
      el("td", { class: "num eval-reward", "data-label": "eval reward", text: num(run.eval_reward) }),
      el("td", { class: "num best-eval", "data-label": "best eval", text: num(run.best_eval_reward) }),
      el("td", { text: run.tags.join(", ") }),
      el("td", { text: when(run.created_at) }),
      el("td", { text: when(run.finished_at) }),
    );
    return tr;
  }

  async function spark(run, tr) {
    if (run.latest_reward === null) return;
    try {
      const metrics = await api(`/runs/${run.id}/metrics`, { params: { keys: "reward", max_points: 60 } });
      tr.querySelector(".spark-slot").replaceChildren(sparkline(metrics.reward || []));
    } catch (e) { /* a run deleted meanwhile: nothing to draw */ }
  }

  // A queued run's place in its queue and the estimated wait: on the run itself (GET /runs/{id}), asked for the
  // queued rows only.
  async function queuePlace(run, tr) {
    if (run.status !== "queued") return;
    try {
      const full = await api("/runs/" + run.id);
      if (full.status !== "queued" || !full.queue_position) return;
      const queue = full.config?.resources?.queue || "default";
      const wait = full.queue_estimate_s === null ? "" : ` · ~${duration(full.queue_estimate_s)} wait`;
      const slot = tr.querySelector(".queue-place");
      slot.textContent = ` #${full.queue_position} in ${queue}${wait}`;
      slot.title = `place ${full.queue_position} among the queued runs of queue ${queue}` + (wait ? ", with the estimated wait until a worker takes it" : "");
      tr.dataset.queuePosition = String(full.queue_position);
    } catch (e) { /* a run taken or deleted meanwhile: its next refresh shows it */ }
  }

  async function load(append = false) {
    const page = await api("/runs", { params: { ...params(), limit: 50, cursor: append ? cursor : undefined } });
    cursor = page.next_cursor;
    more.hidden = !cursor;
    const seen = new Set();
    for (const run of page.items) {
      seen.add(run.id);
      const fresh = row(run);
      const old = body.querySelector(`tr[data-run="${CSS.escape(run.id)}"]`);
      if (old) old.replaceWith(fresh); else body.append(fresh);
      spark(run, fresh);
      queuePlace(run, fresh);
    }
    if (!append) {
      // keep the order the server gives, without rebuilding rows that did not change
      for (const tr of [...body.children]) if (!seen.has(tr.dataset.run)) tr.remove();
      page.items.forEach((run, i) => { const tr = body.querySelector(`tr[data-run="${CSS.escape(run.id)}"]`); if (body.children[i] !== tr) body.insertBefore(tr, body.children[i]); });
    }
    document.getElementById("empty").hidden = body.children.length > 0;
  }

  form.addEventListener("input", () => { cursor = null; load(); });
  form.addEventListener("submit", e => e.preventDefault());
  more.addEventListener("click", () => load(true));
  compare.addEventListener("click", () => { location.href = "/compare?ids=" + [...selected].join(","); });
  load();
  setInterval(() => { if (!document.hidden && !cursor) load(); }, 5000);
})();
