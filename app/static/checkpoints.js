"use strict";
// The run page's Checkpoints panel: every checkpoint of the run (step, attempt, size, when, adapter or full, the
// metric that picks the best, a badge on the best), a Download of each (a tar of its model folder) and an Export as a
// plain transformers folder, made by a worker (GET /exports/{id} followed until it ends, then its download). The list
// is read again while the run is live, so new checkpoints appear. Below it, the run's exports (GET
// /runs/{id}/exports: every token's, newest first, with step, merged or not, status, size, who, and a download once
// done), read from the server, so a finished export is still there after the tab is left or reloaded; this token's
// export still in flight is followed again on load. Every refusal (429: one export at a time per token, or too many
// downloads at once; 404; 409; 410) is shown in the panel, never swallowed.
(() => {
  const { api, el, num, when } = Collage;
  const runId = document.getElementById("run").dataset.run;
  const ENDED = ["succeeded", "failed", "cancelled"];
  const LIVE_EVERY = 5000;  // ms between looks at the list while the run may still write checkpoints
  const FOLLOW_EVERY = 1000;  // ms between looks at a running export
  const $ = id => document.getElementById(id);
  let timer = null;
  let following = null;
  let exportsTimer = null;

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KB", "MB", "GB", "TB"];
    let i = 0, v = n;
    while (v >= 1000 && i < units.length - 1) { v /= 1000; i += 1; }
    return (i ? v.toFixed(v >= 100 ? 0 : 1) : v) + " " + units[i];
  }

  function detail(err) {
    const d = err?.body?.detail;
    if (Array.isArray(d)) return d.map(x => (x.path ? x.path + ": " : "") + x.message).join("; ");
    return typeof d === "string" ? d : `the server answered ${err?.status ?? "nothing"}`;
  }

  function refuse(message) {
    const box = $("checkpoints-error");
    box.hidden = !message;
    box.textContent = message || "";
  }

  function render(list) {
    const items = list.items;
    const table = $("checkpoints-table");
    $("checkpoints-note").textContent = items.length ? (list.metric_for_best_model
      ? `Best by ${list.metric_for_best_model} (${list.greater_is_better ? "greater" : "smaller"} is better).`
      : "No train.metric_for_best_model: no checkpoint is marked best.") : "No checkpoint yet.";
    $("checkpoints-metric").textContent = list.metric_for_best_model || "Metric";
    $("merge-lora-label").hidden = !items.some(c => c.kind === "adapter");
    table.hidden = !items.length;
    table.tBodies[0].replaceChildren(...items.map(c => el("tr", { "data-step": c.step, class: c.best ? "best" : null },
      el("td", {}, String(c.step), c.best ? el("span", { class: "badge best-badge", text: "best" }) : null),
      el("td", { text: c.attempt ?? "–" }),
      el("td", { class: "num", text: bytes(c.bytes) }),
      el("td", { text: when(c.created_at) }),
      el("td", { text: c.kind ?? "–" }),
      el("td", { class: "num", text: num(c.metric, 4) }),
      el("td", {},
        el("button", { type: "button", class: "download", onclick: () => download(c.download_url) }, "Download"), " ",
        el("button", { type: "button", class: "export", onclick: () => startExport(c) }, "Export")),
    )));
  }

  async function load() {
    try {
      render(await api(`/runs/${runId}/checkpoints`));
    } catch (err) {
      refuse(`Checkpoints could not be read: ${detail(err)}`);
    }
    loadExports();
  }

  function weights(e) {
    if (e.merge_lora) return "LoRA merged";
    return e.kind ?? "–";
  }

  function renderExports(items) {
    const table = $("exports-table");
    $("exports-note").textContent = items.length ? "" : "No export yet.";
    $("exports-note").hidden = !!items.length;
    table.hidden = !items.length;
    table.tBodies[0].replaceChildren(...items.map(e => el("tr", { "data-export": e.id, "data-step": e.step ?? "" },
      el("td", { text: e.step ?? "–" }),
      el("td", { class: "weights", text: weights(e) }),
      el("td", {}, el("span", { class: "status status-" + e.status, text: e.status, title: e.error || e.removed || null })),
      el("td", { class: "num", text: e.status === "succeeded" ? bytes(e.bytes) : "–" }),
      el("td", { class: "who", text: e.created_by ?? "–" }),
      el("td", { text: when(e.created_at) }),
      el("td", { text: when(e.finished_at) }),
      el("td", {}, e.download_url
        ? el("a", { class: "button small download-export", href: e.download_url, download: "",
          onclick: ev => { ev.preventDefault(); download(e.download_url); } }, "Download")
        : el("span", { class: "muted", text: e.removed ? "removed" : "–", title: e.removed || null })),
    )));
  }

  // the run's exports; read again while one of them has not ended (another token's, too)
  async function loadExports() {
    let items;
    try {
      items = (await api(`/runs/${runId}/exports`)).items;
    } catch (err) {
      refuse(`Exports could not be read: ${detail(err)}`);
      return;
    }
    renderExports(items);
    clearTimeout(exportsTimer);  // one chain of re-reads, however many reads were in flight
    exportsTimer = null;
    const mineLive = items.find(e => e.mine && !ENDED.includes(e.status));
    if (mineLive && !following) follow(mineLive.id);  // this token's export in flight, after a reload
    if (items.some(e => !ENDED.includes(e.status))) exportsTimer = setTimeout(loadExports, LIVE_EVERY);
  }

  // A download is a plain link once the server said yes: asked first with fetch, so a refusal (429, 409, 410) is
  // shown here instead of becoming a downloaded error file. The first answer's body is not read (aborted at once).
  async function download(url) {
    refuse(null);
    const controller = new AbortController();
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin", signal: controller.signal });
    } catch {
      refuse("The download could not be started: the server did not answer.");
      return;
    }
    if (!response.ok) {
      let body = null;
      try { body = await response.json(); } catch { /* not JSON */ }
      refuse(`Not downloaded: ${detail({ status: response.status, body })}`);
      return;
    }
    controller.abort();
    const link = el("a", { href: url, download: "" });
    document.body.append(link);
    link.click();
    link.remove();
  }

  async function startExport(checkpoint) {
    refuse(null);
    const merge = $("merge-lora").checked && checkpoint.kind === "adapter";
    try {
      const made = await api(`/runs/${runId}/exports`, { method: "POST", body: { step: checkpoint.step, merge_lora: merge } });
      follow(made.id);
      loadExports();
    } catch (err) {
      refuse(`Not exported: ${detail(err)}`);
    }
  }

  function showExport(e) {
    $("export-box").hidden = false;
    $("export-title").textContent = `Export of step ${e.step}${e.merge_lora ? " (LoRA merged)" : ""}`;
    $("export-state").textContent = e.status;
    $("export-state").className = "status status-" + e.status;
    const where = e.status === "queued" && e.queue_position ? `#${e.queue_position} in its queue` : "";
    $("export-message").textContent = e.error || e.removed || where || e.message || "";
    $("export-bar").style.width = `${Math.round(100 * (e.progress || 0))}%`;
    $("export-cancel").hidden = ENDED.includes(e.status);
    const link = $("export-download");
    link.hidden = !e.download_url;
    if (e.download_url) {
      link.href = e.download_url;
      link.textContent = `Download export (${bytes(e.bytes)})`;
    }
  }

  async function follow(id) {
    following = id;
    while (following === id) {
      let e;
      try {
        e = await api(`/exports/${id}`);
      } catch (err) {
        if (err.status === 404) { $("export-box").hidden = true; following = null; return; }
        await new Promise(r => setTimeout(r, FOLLOW_EVERY));
        continue;
      }
      showExport(e);
      if (ENDED.includes(e.status)) { following = null; loadExports(); return; }
      await new Promise(r => setTimeout(r, FOLLOW_EVERY));
    }
  }

  $("export-cancel").addEventListener("click", async () => {
    if (!following) return;
    try {
      showExport(await api(`/exports/${following}/cancel`, { method: "POST" }));
    } catch (err) {
      refuse(`Not cancelled: ${detail(err)}`);
    }
  });

  // live while the run may still write checkpoints; the status badge (run.js keeps it current) says when
  function schedule() {
    clearInterval(timer);
    timer = null;
    if (!ENDED.includes($("status").textContent.trim())) timer = setInterval(load, LIVE_EVERY);
  }
  let seen = $("status").textContent.trim();
  new MutationObserver(() => {
    const now = $("status").textContent.trim();
    if (now === seen) return;  // run.js writes the badge on every update: act on a change only
    seen = now;
    load();
    schedule();
  }).observe($("status"), { childList: true, characterData: true, subtree: true });

  load();
  schedule();
})();
