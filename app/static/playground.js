"use strict";
// The playground: one or two models (a run's checkpoint from GET /runs/{id}/checkpoints, or a step typed in when
// that list is not available; or a base model), a prompt with uploaded images (POST /images) or a rollout row of the
// run (its prompt, images and dataset columns), sampling settings; Generate queues POST /generate and follows GET
// /generate/{id} (queue position, what it waits for, progress) until the completions come back, side by side with
// their rewards; Cancel stops it. Tools (the server's catalog, GET /rewards `tools`; the chosen run's own to start
// with) make each completion a multi-turn rollout, shown turn by turn with its crops (trajectory.js, as the rollouts
// page shows them). Prompts, completions and server messages are untrusted: inserted as text only.
(() => {
  const { api, el, num, promptNode } = Collage;
  const ENDED = ["succeeded", "failed", "cancelled"];
  const form = document.getElementById("playground");
  const maxImages = Number(form.dataset.maxImages) || 16;
  const errorBox = document.getElementById("pg-error");
  const statusBox = document.getElementById("pg-status");
  const results = document.getElementById("results");
  const generateButton = document.getElementById("generate");
  const cancelButton = document.getElementById("cancel");
  const thumbs = document.getElementById("thumbs");
  const promptBox = document.getElementById("prompt");
  const answerBox = document.getElementById("answer");
  const rowsSelect = document.getElementById("rows");
  const second = document.getElementById("second-on");
  let images = [];          // [{sha256, thumb_url, url, width, height}] in the order of [image 1], [image 2], ...
  let row = null;           // the rollout row taken: {prompt (its conversation), text (as shown), columns, images}
  let current = null;       // the generation followed: its id
  let polling = null;
  const slotBox = slot => form.querySelector(`.pg-model[data-slot="${slot}"]`);

  // ------------------------------------------------------------------------------------------- errors
  function showError(message) {
    errorBox.textContent = message || "";
    errorBox.hidden = !message;
  }

  function clearFieldErrors() {
    for (const slot of form.querySelectorAll(".pg-field-error")) slot.textContent = "";
    showError("");
  }

  // a 422 names each bad field (models[0].path, prompt, images[1], temperature): its message goes next to it
  function fieldFor(path) {
    const model = /^models\[(\d+)\]/.exec(path);
    if (model) return `models[${model[1]}]`;
    if (path.startsWith("images")) return "images";
    if (["prompt", "answer"].includes(path.split(/[.[]/)[0])) return path.split(/[.[]/)[0];
    if (["num_generations", "temperature", "top_p", "max_new_tokens", "seed"].includes(path)) return "sampling";
    if (path.startsWith("tools") || path === "max_tool_calling_iterations") return "tools";
    return null;
  }

  function showProblem(err) {
    const detail = err && err.body && err.body.detail;
    if (!Array.isArray(detail)) {
      showError(typeof detail === "string" ? detail : `the server could not be reached (${err && err.message})`);
      return;
    }
    const loose = [];
    for (const d of detail) {
      const slot = fieldFor(String(d.path || ""));
      const box = slot && form.querySelector(`[data-error-for="${slot}"]`);
      const text = `${d.path}: ${d.message}`;
      if (box) box.textContent = box.textContent ? box.textContent + "; " + text : text;
      else loose.push(text);
    }
    showError(loose.join("; "));
    const first = form.querySelector(".pg-field-error:not(:empty)");
    if (first) first.scrollIntoView({ block: "center" });
  }

  // ------------------------------------------------------------------------------------------- models
  function kind(slot) { return form.querySelector(`input[name="kind-${slot}"]:checked`).value; }

  function showKind(slot) {
    const box = slotBox(slot);
    box.querySelector(".pg-run").hidden = kind(slot) !== "run";
    box.querySelector(".pg-path").hidden = kind(slot) !== "path";
  }

  async function loadRuns() {
    let runs = [];
    try { runs = (await api("/runs", { params: { limit: 200 } })).items; }
    catch (err) { showProblem(err); }
    for (const slot of [0, 1]) {
      const select = document.getElementById(`run-${slot}`);
      const options = runs.map(r => el("option", { value: r.id, text: `${r.name} · ${r.id.slice(0, 8)} · ${r.status}` }));
      select.replaceChildren(...(options.length ? options : [el("option", { value: "", text: "no runs yet" })]));
      const wanted = form.dataset.run;
      if (slot === 0 && wanted && runs.some(r => r.id === wanted)) select.value = wanted;
      if (!runs.length) { form.querySelector(`input[name="kind-${slot}"][value="path"]`).checked = true; showKind(slot); }
      loadSteps(slot);
    }
    suggestPrompt();
  }

  // Whether this server lists a run's checkpoints (its API schema has the route): asked once, so that a server
  // without it gets no request that can only fail.
  let listsCheckpoints = null;
  async function checkpointRoute() {
    if (listsCheckpoints === null) {
      listsCheckpoints = api("/openapi.json").then(s => "/api/v1/runs/{run_id}/checkpoints" in (s.paths || {}), () => false);
    }
    return listsCheckpoints;
  }

  // The run's checkpoints (GET /runs/{id}/checkpoints): last, best and each step; where that list cannot be had,
  // a step typed in (a number, best or last) instead.
  async function loadSteps(slot) {
    const runId = document.getElementById(`run-${slot}`).value;
    const select = document.getElementById(`step-${slot}`);
    const text = document.getElementById(`step-text-${slot}`);
    const help = slotBox(slot).querySelector(".pg-step-help");
    if (!runId) { select.replaceChildren(el("option", { value: "last", text: "last" })); help.textContent = ""; return; }
    try {
      if (!(await checkpointRoute())) throw new Error("no checkpoints route");
      const data = await api(`/runs/${encodeURIComponent(runId)}/checkpoints`);
      const items = data.items || [];
      const options = [el("option", { value: "last", text: "last" })];
      if (items.some(c => c.best)) options.push(el("option", { value: "best", text: "best" }));
      for (const c of [...items].sort((a, b) => b.step - a.step)) {
        const metric = c.metric === null || c.metric === undefined ? "" : ` · ${num(c.metric)}`;
        options.push(el("option", { value: String(c.step), text: `step ${c.step} (${c.kind || "?"}${metric}${c.best ? ", best" : ""})` }));
      }
      select.replaceChildren(...options);
      select.hidden = false; text.hidden = true;
      help.textContent = items.length ? "" : "This run has no checkpoint yet: it saves one every save_steps and at its end.";
    } catch (err) {
      // no list of checkpoints here (an older server): type the step
      select.hidden = true; text.hidden = false;
      help.textContent = "A step number, best or last.";
    }
  }

  function stepOf(slot) {
    const select = document.getElementById(`step-${slot}`);
    const value = (select.hidden ? document.getElementById(`step-text-${slot}`).value : select.value).trim() || "last";
    return /^\d+$/.test(value) ? Number(value) : value;
  }

  function modelOf(slot) {
    if (kind(slot) === "path") return { path: document.getElementById(`path-${slot}`).value.trim() };
    return { run: document.getElementById(`run-${slot}`).value, step: stepOf(slot) };
  }

  async function loadModelOptions() {
    try {
      const models = await api("/models");
      document.getElementById("pg-model-options").replaceChildren(...[...models.tiny, ...models.local].map(m => el("option", { value: m })));
    } catch (_err) { /* suggestions only */ }
  }

  // ------------------------------------------------------------------------------------------- tools
  // The tools the model may call: a checkbox each for the server's built-ins, the chosen run's own tools and any
  // "package.module:function" added (when the operator allows tool modules); checked: the run's tools.
  const toolsList = document.getElementById("tools-list");
  const toolCalls = document.getElementById("max_tool_calling_iterations");
  let catalog = null;   // GET /rewards `tools`: {builtins: [{name, doc}], modules: [...]}
  let toolsSeq = 0;

  function toolBox(name, doc, checked) {
    const id = `tool-${toolsList.querySelectorAll("input").length}`;
    return el("label", { class: "pg-tool", for: id, title: doc || "" },
      el("input", { type: "checkbox", id, value: name, checked }),
      el("code", { text: name }), doc ? el("small", { class: "muted", text: ` ${doc}` }) : null);
  }

  function toolNames() { return [...toolsList.querySelectorAll("input:checked")].map(i => i.value); }

  function showTools(own, calls) {
    if (!catalog) return;
    const builtins = catalog.builtins.map(t => t.name);
    const names = new Set(own);
    toolsList.replaceChildren();
    for (const t of catalog.builtins) toolsList.append(toolBox(t.name, t.doc, names.has(t.name)));
    for (const name of own) if (!builtins.includes(name)) toolsList.append(toolBox(name, "the run's own tool", true));
    toolCalls.value = String(Math.max(1, Math.min(16, calls ?? 4)));
  }

  // the first model's own tools and tool-call limit: a run's from its config, none for a base model
  async function resetTools() {
    const mine = ++toolsSeq;
    const runId = document.getElementById("run-0").value;
    let own = [], calls = 4;
    if (kind(0) === "run" && runId) {
      try {
        const config = (await api(`/runs/${encodeURIComponent(runId)}`)).config || {};
        own = (config.tools || []).map(t => t.name);
        if (own.length && config.train && Number.isInteger(config.train.max_tool_calling_iterations)) calls = config.train.max_tool_calling_iterations;
      } catch (_err) { /* the run's page says what is wrong with it; no tools to start with */ }
    }
    if (mine === toolsSeq) showTools(own, calls);
  }

  async function loadCatalog() {
    try { catalog = (await api("/rewards")).tools; }
    catch (err) { toolsList.replaceChildren(el("span", { class: "error", text: "the server's tools could not be read" })); return; }
    const extra = document.getElementById("tool-extra-box");
    extra.hidden = !catalog.modules.length;
    document.getElementById("tool-extra-help").textContent = catalog.modules.length
      ? `A function of a module the operator allows (COLLAGE_TOOL_MODULES: ${catalog.modules.join(", ")}).` : "";
    showTools([], 4);
    resetTools();
  }

  function addTool() {
    const input = document.getElementById("tool-extra");
    const name = input.value.trim();
    if (!name) return;
    const known = [...toolsList.querySelectorAll("input")].find(i => i.value === name);
    if (known) known.checked = true;
    else toolsList.append(toolBox(name, "", true));
    input.value = "";
  }

  // ------------------------------------------------------------------------------------------- images
  function renderThumbs() {
    thumbs.replaceChildren(...images.map((image, i) => {
      const remove = el("button", { type: "button", class: "link pg-remove", "aria-label": `Remove image ${i + 1}`, text: "remove" });
      remove.addEventListener("click", () => {
        images.splice(i, 1);
        renderThumbs();
        (thumbs.querySelectorAll(".pg-remove")[Math.min(i, images.length - 1)] || document.getElementById("files")).focus();
      });
      return el("li", { class: "pg-thumb", "data-sha": image.sha256 },
        el("img", { src: image.thumb_url, alt: `image ${i + 1} (${image.width}x${image.height})`, class: "thumb" }),
        el("span", { class: "image-marker", text: `[image ${i + 1}]` }), remove);
    }));
  }

  async function uploadFile(file) {
    const body = new FormData();
    body.append("file", file, file.name);
    const response = await fetch("/api/v1/images", {
      method: "POST", body, credentials: "same-origin",
      headers: { Accept: "application/json", "X-CSRF-Token": document.querySelector('meta[name="csrf-token"]').content },
    });
    const data = await response.json().catch(() => null);
    if (!response.ok) {
      const detail = data && data.detail;
      const message = Array.isArray(detail) ? detail.map(d => d.message).join("; ") : detail || `HTTP ${response.status}`;
      throw new Error(`${file.name}: ${message}`);
    }
    return data;
  }

  async function onFiles(event) {
    const files = [...event.target.files];
    event.target.value = "";
    const box = form.querySelector('[data-error-for="images"]');
    box.textContent = "";
    const problems = [];
    for (const file of files) {
      if (images.length >= maxImages) { problems.push(`${file.name}: at most ${maxImages} images per prompt`); continue; }
      try { images.push(await uploadFile(file)); renderThumbs(); }
      catch (err) { problems.push(err.message); }
    }
    box.textContent = problems.join("; ");
    showUsage();
  }

  async function showUsage() {
    try {
      const usage = await api("/uploads", { params: { limit: 1 } });
      document.getElementById("usage").textContent = `Your uploads: ${(usage.used_bytes / 1048576).toFixed(1)} of ${(usage.quota_bytes / 1048576).toFixed(0)} MB.`;
    } catch (_err) { /* informative only */ }
  }

  // ------------------------------------------------------------------------------------------- a rollout row
  // A stored prompt (a conversation) as the text box shows it: each image part as its [image N] marker.
  function promptText(prompt) {
    if (typeof prompt === "string") return prompt;
    let k = 0;
    return (prompt || []).map(m => {
      const parts = typeof m.content === "string" ? [{ type: "text", text: m.content }] : (m.content || []);
      const text = parts.map(p => p.type === "image" ? `[image ${++k}]` : (p.text || "")).join("");
      return prompt.length > 1 ? `${m.role}: ${text}` : text;
    }).join("\n");
  }

  // A rollout row as an option: what tells rows of one task apart (their answer, reward, images) before the prompt
  // text, which is often the same for every row.
  function rowLabel(s) {
    const answer = s.columns && s.columns.answer !== undefined && s.columns.answer !== null ? ` · answer ${String(s.columns.answer).slice(0, 20)}` : "";
    return `step ${s.step} · group ${s.group}${answer} · reward ${num(s.reward)} · ${plural(s.images.length, "image")} · ` +
      promptText(s.prompt).slice(0, 60);
  }

  // The prompt box starts with the chosen run's own prompt (its newest rollout row's text, without image markers),
  // never a demo task's, unless the person already typed one.
  async function suggestPrompt() {
    const box = document.getElementById("prompt");
    const runId = document.getElementById("run-0").value;
    if (kind(0) !== "run" || !runId || (box.value.trim() && box.dataset.suggested !== box.value)) return;
    try {
      const page = await api(`/runs/${encodeURIComponent(runId)}/samples`, { params: { limit: 1, sort: "-step" } });
      const sample = page.items[0];
      if (!sample || (box.value.trim() && box.dataset.suggested !== box.value)) return;
      const text = promptText(sample.prompt).replace(/\[image \d+\]/g, "").trim();
      box.value = box.dataset.suggested = text;
    } catch (err) { /* no rows to suggest from: the box stays empty, its placeholder says what goes there */ }
  }

  async function loadRows() {
    const runId = document.getElementById("run-0").value;
    if (kind(0) !== "run" || !runId) { showError("Pick a run for the first model: its rollout rows are offered."); return; }
    try {
      const page = await api(`/runs/${encodeURIComponent(runId)}/samples`, { params: { limit: 50, sort: "-step" } });
      const seen = new Set();
      const rows = page.items.filter(s => { const key = `${s.step}:${s.group}`; if (seen.has(key)) return false; seen.add(key); return true; });
      rowsSelect.replaceChildren(el("option", { value: "", text: rows.length ? "choose a rollout row…" : "this run has no rollout rows yet" }),
        ...rows.map((s, i) => el("option", { value: String(i), text: rowLabel(s) })));
      rowsSelect.hidden = false;
      rowsSelect.rows = rows;
      rowsSelect.focus();
    } catch (err) { showProblem(err); }
  }

  function takeRow() {
    const sample = (rowsSelect.rows || [])[Number(rowsSelect.value)];
    if (!sample || rowsSelect.value === "") return;
    const text = promptText(sample.prompt);
    row = { prompt: sample.prompt, text, columns: sample.columns || {}, images: sample.images.map(i => i.sha256).join(",") };
    promptBox.value = text;
    images = sample.images.map(i => ({ sha256: i.sha256, thumb_url: i.thumb_url, url: i.url, width: i.width, height: i.height }));
    renderThumbs();
    const answer = (sample.columns || {}).answer;
    answerBox.value = answer === undefined || answer === null ? "" : String(answer);
  }

  // ------------------------------------------------------------------------------------------- generate
  function numberOf(id, integer) {
    const raw = document.getElementById(id).value.trim();
    if (raw === "") return undefined;
    return integer ? parseInt(raw, 10) : Number(raw);
  }

  function request() {
    const models = [modelOf(0)];
    if (second.checked) models.push(modelOf(1));
    const body = {
      models, prompt: promptBox.value, images: images.map(i => i.sha256),
      num_generations: numberOf("num_generations", true), temperature: numberOf("temperature"),
      top_p: numberOf("top_p"), max_new_tokens: numberOf("max_new_tokens", true),
    };
    const seed = numberOf("seed", true);
    if (seed !== undefined) body.seed = seed;
    if (catalog) {  // the tools as checked (none: []); before the catalog came, the server's default (the run's own)
      body.tools = toolNames();
      const calls = numberOf("max_tool_calling_iterations", true);
      if (body.tools.length && calls !== undefined) body.max_tool_calling_iterations = calls;
    }
    if (answerBox.value.trim() !== "") body.answer = answerBox.value.trim();
    // a rollout row's prompt, unedited and with its own images: sent as stored (exactly what the run trained on),
    // with its dataset columns for the rewards
    if (row && Array.isArray(row.prompt) && promptBox.value === row.text && body.images.join(",") === row.images) {
      body.prompt = row.prompt;
      const columns = Object.fromEntries(Object.entries(row.columns).filter(([k]) => k !== "answer"));
      if (Object.keys(columns).length) body.columns = columns;
    }
    return body;
  }

  async function generate(event) {
    event.preventDefault();
    clearFieldErrors();
    results.replaceChildren();
    generateButton.disabled = true;
    try {
      const created = await api("/generate", { method: "POST", body: request() });
      current = created.id;
      showStatus(created);  // the new generation's state at once, never the previous one's until the first poll
      history.replaceState(null, "", `${location.pathname}?id=${encodeURIComponent(current)}`);
      cancelButton.hidden = false;
      cancelButton.disabled = false;
      await follow();
    } catch (err) {
      showProblem(err);
      generateButton.disabled = false;
    }
  }

  async function follow() {
    clearTimeout(polling);
    if (!current) return;
    let job;
    try { job = await api(`/generate/${current}`); }
    catch (err) {
      showProblem(err);
      if (err.status === 404) { current = null; generateButton.disabled = false; cancelButton.hidden = true; return; }
      polling = setTimeout(follow, 3000);  // the server is briefly away: look again
      return;
    }
    showStatus(job);
    if (ENDED.includes(job.status)) {
      generateButton.disabled = false;
      cancelButton.hidden = true;
      if (job.status === "failed") showError(job.error || "the generation failed");
      if (job.status === "succeeded") showResults(job);
      current = null;
      return;
    }
    polling = setTimeout(follow, 1000);
  }

  function showStatus(job) {
    statusBox.hidden = false;
    const state = document.getElementById("pg-state");
    state.textContent = job.status;
    state.className = `status status-${job.status}`;
    const position = document.getElementById("pg-position");
    position.hidden = !job.queue_position;
    position.textContent = job.queue_position ? `position ${job.queue_position} in queue ${job.queue}` : "";
    document.getElementById("pg-message").textContent = job.message || "";
    document.getElementById("pg-bar").style.width = `${Math.round((job.progress || 0) * 100)}%`;
    statusBox.dataset.status = job.status;
    statusBox.dataset.job = job.id;
  }

  async function cancel() {
    if (!current) return;
    cancelButton.disabled = true;
    try { showStatus(await api(`/generate/${current}/cancel`, { method: "POST" })); }
    catch (err) { showProblem(err); }
    follow();
  }

  // ------------------------------------------------------------------------------------------- results
  function rewardList(result, i) {
    if (!result.rewards) return null;
    const list = el("dl", { class: "rewards" });
    for (const [name, values] of Object.entries(result.rewards)) {
      const weight = result.reward_weights ? result.reward_weights[name] : null;
      list.append(el("dt", { text: weight !== null && weight !== undefined && weight !== 1 ? `${name} (×${weight})` : name }),
        el("dd", { class: "num", "data-reward": name, text: num(values[i]) }));
    }
    return list;
  }

  function plural(count, word) { return `${count} ${word}${count === 1 ? "" : "s"}`; }

  // A completion's trajectory as trajectory.js shows a rollout row's: the prompt's images, then each tool image
  // (its PNG, carried in the answer) in order.
  function asRollout(job, trajectory) {
    const turns = trajectory.turns.map(t => ({ ...t, images: (t.images || []).map(image => {
      const src = image.png ? `data:image/png;base64,${image.png}` : null;
      return { url: src, thumb_url: src, width: image.width, height: image.height, source: image.source };
    }) }));
    return { images: job.images, trajectory: turns, turns: turns.length, tool_calls: trajectory.tool_calls,
      tool_errors: trajectory.tool_errors, capped: trajectory.capped };
  }

  function column(result, job) {
    const m = result.model;
    const meta = `${plural(result.prompt_tokens, "prompt token")} (${result.image_tokens} for images) · ${num(result.seconds, 1)} s · ` +
      `${result.reused ? "model already loaded" : "model loaded now"} · ${result.device}`;
    const box = el("article", { class: "column pg-column", "data-model": m.label },
      el("h2", { text: m.label }), el("p", { class: "muted pg-meta", text: meta }));
    if (result.reward_errors) {
      box.append(el("ul", { class: "pg-reward-errors" },
        Object.entries(result.reward_errors).map(([name, why]) => el("li", { class: "error", text: `${name}: ${why}` }))));
    }
    const list = el("ol", { class: "pg-completions" });
    result.completions.forEach((c, i) => {
      const head = el("header", {},
        el("b", { text: `#${i + 1}` }),
        c.reward === null || c.reward === undefined ? null : el("span", { class: "badge pg-total", text: `reward ${num(c.reward)}` }),
        el("span", { class: "muted", text: ` ${plural(c.tokens, "token")}` }),
        c.truncated ? el("span", { class: "badge", text: "truncated" }) : null,
        el("span", { class: "muted", text: ` · log-prob ${num(c.logprob, 2)}` }));
      const rollout = c.trajectory ? asRollout(job, c.trajectory) : null;
      list.append(el("li", { class: "pg-completion" }, head, el("pre", { class: "completion", text: c.text }),
        rollout ? Trajectory.toolBadges(rollout) : null, rollout ? Trajectory.trajectoryNode(rollout, true) : null,
        rewardList(result, i)));
    });
    box.append(list);
    return box;
  }

  function showResults(job) {
    const shown = job.results.map(result => column(result, job));
    const prompt = el("div", { class: "pg-asked" }, el("h2", { text: "Prompt" }), promptNode(job.prompt, job.images),
      el("div", { class: "pg-asked-images" }, job.images.map((image, i) =>
        el("img", { src: image.thumb_url, alt: `image ${i + 1} (${image.width}x${image.height})`, class: "thumb" }))),
      job.answer === null || job.answer === undefined ? null : el("p", { class: "muted", text: `answer: ${job.answer}` }),
      (job.sampling.tools || []).length ? el("p", { class: "muted pg-asked-tools", text: `tools: ${job.sampling.tools.join(", ")} · at most ${plural(job.sampling.max_tool_calling_iterations, "tool call")}` }) : null);
    results.replaceChildren(prompt, el("div", { class: "side-by-side pg-side" }, shown));
  }

  // ------------------------------------------------------------------------------------------- wiring
  for (const slot of [0, 1]) {
    for (const radio of form.querySelectorAll(`input[name="kind-${slot}"]`)) radio.addEventListener("change", () => showKind(slot));
    document.getElementById(`run-${slot}`).addEventListener("change", () => { loadSteps(slot); if (slot === 0) { suggestPrompt(); resetTools(); } });
    showKind(slot);
  }
  for (const radio of form.querySelectorAll('input[name="kind-0"]')) radio.addEventListener("change", resetTools);
  second.addEventListener("change", () => { slotBox(1).disabled = !second.checked; });
  document.getElementById("tool-add").addEventListener("click", addTool);
  document.getElementById("tool-extra").addEventListener("keydown", e => { if (e.key === "Enter") { e.preventDefault(); addTool(); } });
  document.getElementById("files").addEventListener("change", onFiles);
  document.getElementById("rows-load").addEventListener("click", loadRows);
  rowsSelect.addEventListener("change", takeRow);
  form.addEventListener("submit", generate);
  cancelButton.addEventListener("click", cancel);
  loadRuns().then(loadCatalog);
  loadModelOptions();
  showUsage();
  // ?id=<generation>: follow it (or show how it ended) again, after a reload or from a shared link
  const reopened = new URLSearchParams(location.search).get("id");
  if (reopened) {
    current = reopened;
    generateButton.disabled = true;
    cancelButton.hidden = false;
    follow();
  }
})();
