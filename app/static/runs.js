"use strict";
// The runs table: filters, auto-refresh that updates rows in place (the scroll position never jumps), a queued
// run's place in its queue, the held-out metric it picks its best checkpoint by (latest and best) beside its
// weighted eval reward, and selection for comparing.
(() => {
  const { api, el, num, when, duration, leftText, sparkline } = Collage;
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
    const progress = el("div", { class: "progress" }, el("div", { class: "bar", style: `width:${max_steps ? 100 * step / max_steps : 0}%` }));
    tr.append(
      el("td", {}, box),
      el("td", {}, el("a", { href: "/runs/" + run.id, text: run.name }), el("small", { class: "muted cell-line", text: run.algorithm })),
      el("td", { class: "status-cell" }, el("span", { class: "status", text: run.status }), el("small", { class: "queue-place muted" })),
      el("td", { class: "clip" }, el("span", { class: "cell-line", title: run.model, text: run.model }),
        el("small", { class: "muted cell-line", title: run.dataset, text: run.dataset })),
      el("td", {}, progress, el("small", { text: `${step}/${max_steps}` + leftText(run) })),
      el("td", { class: "reward" }, el("span", { text: num(run.latest_reward) }), el("span", { class: "spark-slot" })),
      evaluation(run),
      el("td", { text: run.tags.join(", ") }),
      el("td", {}, el("span", { class: "cell-line", text: when(run.created_at) }),
        el("small", { class: "muted cell-line", text: run.finished_at ? when(run.finished_at) : "" })),
    );
    return tr;
  }

  // Held-out evaluation: the metric the run picks its best checkpoint by (named: accuracy, loss...), latest and
  // best, and the weighted eval/reward as such below it; "–" for a run without one (yet).
  function evaluation(run) {
    const td = el("td", { class: "num evaluation", "data-label": "evaluation" });
    const metric = run.eval_metric && run.eval_metric !== "eval/reward" ? run.eval_metric : null;
    const name = metric ? metric.slice("eval/".length) : "reward";
    const latest = metric ? run.eval_metric_value : run.eval_reward;
    const best = metric ? run.best_eval_metric : run.best_eval_reward;
    if (latest === null && best === null && run.eval_reward === null) {
      td.append(el("span", { class: "eval-latest", text: num(null) }));
      return td;
    }
    td.append(el("span", { class: "cell-line" }, el("span", { class: "eval-name muted", text: name + " " }),
      el("span", { class: "eval-latest", text: num(latest) })));
    td.append(el("small", { class: "cell-line muted" }, "best ", el("span", { class: "eval-best", text: num(best) })));
    if (metric && run.eval_reward !== null) {
      td.append(el("small", { class: "cell-line muted", title: "eval/reward: the weighted sum of the reward functions on held-out rows" },
        "reward ", el("span", { class: "eval-reward", text: num(run.eval_reward) })));
    }
    return td;
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
