"use strict";
// The launch form: builds the run config from the fields, previews and checks the dataset, shows every field
// error the API returns next to its field. Launching goes through POST /api/v1/runs: the same validation.
(() => {
  const { api, el, toYaml, promptNode } = Collage;
  const form = document.getElementById("launch");
  const rewardsBox = document.getElementById("rewards");
  let rewardNames = [];

  function algorithm() { return form.querySelector('input[name="algorithm"]:checked').value; }

  function lossType() { return form.querySelector('[name="train.loss_type"]')?.value; }

  // the synthetic task's own fields (rows, images per row, its seed) apply to a synth:<task> source only: shown and
  // sent with one, left out of the config otherwise (the schema's defaults then, which a local dataset ignores)
  const SYNTH_ONLY = ["dataset.rows", "dataset.min_images", "dataset.max_images", "dataset.seed"];
  function sourceValue() { return form.querySelector('[name="dataset.source"]').value.trim(); }
  function isSynth(source = sourceValue()) { return source.startsWith("synth:"); }
  function showSourceFields() { document.getElementById("synth-fields").hidden = !isSynth(); }

  // a field of one algorithm, or of some loss types (sapo_*, vespo_*, delta), is shown and sent only with them
  function applies(field, algo) {
    if (field.dataset.algorithm && field.dataset.algorithm !== algo) return false;
    return !field.dataset.lossTypes || field.dataset.lossTypes.split(" ").includes(lossType());
  }

  function showAlgorithmFields() {
    for (const field of form.querySelectorAll("[data-algorithm], [data-loss-types]")) field.hidden = !applies(field, algorithm());
  }

  function setPath(obj, path, value) {
    const parts = path.split(".");
    let node = obj;
    for (const p of parts.slice(0, -1)) node = node[p] ??= {};
    node[parts[parts.length - 1]] = value;
  }

  function read(input) {
    const kind = input.dataset.kind || "text";
    const raw = input.type === "checkbox" ? input.checked : input.value.trim();
    if (kind === "bool") return input.checked;
    if (kind === "optional-bool") return raw === "" ? null : raw === "true";  // auto / true / false
    if (kind === "list") return raw ? raw.split(",").map(s => s.trim()).filter(Boolean) : [];
    if (raw === "") return kind.startsWith("optional") ? null : undefined;
    if (kind.endsWith("int") || kind.endsWith("float")) { const n = Number(raw); return Number.isNaN(n) ? raw : n; }
    return raw;
  }

  function config() {
    const out = { algorithm: algorithm() };
    for (const input of form.querySelectorAll("[name]")) {
      const path = input.name;
      if (path === "algorithm" || path.startsWith("reward.") || path.startsWith("tool.")) continue;
      if (path.startsWith("model.lora.") && !document.getElementById("lora-on").checked) continue;
      if (SYNTH_ONLY.includes(path) && !isSynth()) continue;
      const field = input.closest("[data-algorithm], [data-loss-types]");
      if (field && !applies(field, out.algorithm)) continue;
      const value = read(input);
      if (value !== undefined) setPath(out, path, value);
    }
    if (!document.getElementById("lora-on").checked) setPath(out, "model.lora", null);
    setPath(out, "dataset.columns", columnMap());
    if (!out.name) delete out.name;
    out.rewards = [...rewardsBox.querySelectorAll(".reward")].map(r => {
      const entry = { name: r.querySelector('[name="reward.name"]').value.trim(), weight: Number(r.querySelector('[name="reward.weight"]').value) };
      const mode = r.querySelector('[name="reward.on_images"]').value;
      if (mode !== "error") entry.on_images_for_text_reward = mode;
      return entry;
    });
    out.tools = tools();
    return out;
  }

  // the tools list: each checked built-in (image_zoom_in with the coords setting), then each import path of "your
  // tools"; the error slot of entry k (tools[k].name) is at the input that made it. A clone keeps the timeout and
  // args of the tools it had (the form has no field for them)
  let keptTools = {};
  const importsInput = document.getElementById("tool-imports");

  function tools() {
    const coords = form.querySelector('[name="tool.coords"]').value;
    const entries = [];
    for (const box of form.querySelectorAll('[name="tool.builtin"]')) {
      const slot = form.querySelector(`[data-tool="${CSS.escape(box.value)}"]`);
      if (!box.checked) { slot.removeAttribute("data-error-for"); slot.textContent = ""; continue; }
      slot.dataset.errorFor = `tools[${entries.length}].name`;
      entries.push({ ...keptTools[box.value], name: box.value, ...(box.value === "image_zoom_in" ? { coords } : {}) });
    }
    const names = importsInput.value.split(",").map(s => s.trim()).filter(Boolean);
    const wanted = names.map((_, i) => `tools[${entries.length + i}].name`);
    const field = importsInput.closest(".field");
    const slots = [...field.querySelectorAll(".error[data-import]")];
    if (slots.map(s => s.dataset.errorFor).join() !== wanted.join()) {
      for (const slot of slots) slot.remove();
      field.append(...wanted.map(path => el("span", { class: "error", "data-import": true, "data-error-for": path, "data-control": "tool-imports" })));
    }
    for (const name of names) entries.push({ ...keptTools[name], name });
    return entries;
  }

  function fillTools(list) {
    keptTools = Object.fromEntries(list.map(t => [t.name, t]));
    const builtins = [...form.querySelectorAll('[name="tool.builtin"]')];
    for (const box of builtins) box.checked = box.value in keptTools;
    if (keptTools.image_zoom_in?.coords) form.querySelector('[name="tool.coords"]').value = keptTools.image_zoom_in.coords;
    importsInput.value = list.map(t => t.name).filter(n => !builtins.some(b => b.value === n)).join(", ");
  }

  // a reward row has three inputs: each error slot names the one input its error is about (data-control), so
  // that a bad name marks the name alone, not the weight and the images choice beside it
  const REWARD_KEYS = { name: "reward.name", weight: "reward.weight", on_images_for_text_reward: "reward.on_images" };
  let rewardIds = 0;

  function addReward(name = "", weight = 1, mode = "error") {
    const index = rewardsBox.children.length;
    const id = ++rewardIds;
    const row = el("div", { class: "reward", "data-path": `rewards[${index}]` },
      el("input", { name: "reward.name", id: `reward-${id}-name`, list: "reward-options", value: name, placeholder: "built-in, package.module:function, or a reward-model folder", "aria-label": "reward name" }),
      el("label", {}, "weight ", el("input", { name: "reward.weight", id: `reward-${id}-weight`, value: String(weight), size: 4, "aria-label": "reward weight" })),
      el("label", {}, "images for a text reward model ", el("select", { name: "reward.on_images", id: `reward-${id}-on_images`, "aria-label": "images for a text reward model" }, el("option", { value: "error", text: "refuse" }), el("option", { value: "drop", text: "drop with a warning" }))),
      el("button", { type: "button", class: "link", text: "remove", onclick: () => { row.remove(); renumber(); } }),
      ...Object.entries(REWARD_KEYS).map(([key, input]) => el("span", { class: "error", "data-key": key,
        "data-error-for": `rewards[${index}].${key}`, "data-control": `reward-${id}-${input.slice(7)}` })));
    row.querySelector("select").value = mode;
    rewardsBox.append(row);
  }

  function renumber() {
    [...rewardsBox.children].forEach((row, i) => {
      row.dataset.path = `rewards[${i}]`;
      for (const slot of row.querySelectorAll(".error[data-key]")) slot.dataset.errorFor = `rewards[${i}].${slot.dataset.key}`;
    });
  }

  function clearErrors() {
    for (const e of form.querySelectorAll("[data-error-for]")) e.textContent = "";
    for (const f of form.querySelectorAll(".field.invalid")) f.classList.remove("invalid");
    for (const c of form.querySelectorAll('[aria-invalid="true"]')) c.removeAttribute("aria-invalid");
    document.getElementById("form-error").hidden = true;
  }

  function showErrors(detail) {
    const unplaced = [];
    const marked = [];
    for (const { path, message } of detail) {
      const slot = form.querySelector(`[data-error-for="${CSS.escape(path)}"]`);
      if (!slot) { unplaced.push(`${path}: ${message}`); continue; }
      slot.textContent = message;
      // the error's own input when the slot names it (a reward's name, one column of the mapping), else the
      // field's inputs; a collapsed group holding it opens, so that no error is out of sight
      const control = slot.dataset.control && document.getElementById(slot.dataset.control);
      const field = slot.closest(".field");
      if (!control && field) field.classList.add("invalid");
      const controls = control ? [control] : field ? [...field.querySelectorAll("input, select, textarea")] : [];
      for (const c of controls) { c.setAttribute("aria-invalid", "true"); marked.push(c); }
      for (let d = slot.closest("details"); d; d = d.parentElement.closest("details")) d.open = true;
    }
    const top = document.getElementById("form-error");
    if (unplaced.length) { top.textContent = unplaced.join("; "); top.hidden = false; }
    const first = marked.find(c => c.type !== "hidden");
    if (first) first.focus();
  }

  let previewSeq = 0;  // the newest Preview and check
  let rowsSeq = 0;  // the newest rows request (a Preview's, or a live re-render after a mapping change)
  let rerunWithGuess = false;  // Preview guessed a mapping: run it again with it when it ends
  let mappingTouched = false;  // once the user picks a column, Preview's guess no longer changes the mapping
  const mapSelects = [...form.querySelectorAll("select[data-column]")];

  function columnMap() {
    // dataset.columns from the dropdowns: a key left on its default is left out; null when none is mapped
    const out = {};
    for (const select of mapSelects) {
      const chosen = [...select.selectedOptions].map(o => o.value).filter(Boolean);
      if (!chosen.length) continue;
      out[select.dataset.column] = select.multiple && chosen.length > 1 ? chosen : chosen[0];
    }
    return Object.keys(out).length ? out : null;
  }

  function columnsParam(map) {
    // the preview's columns parameter: prompt=question,images=image_1+image_2
    return map ? Object.entries(map).map(([k, v]) => `${k}=${Array.isArray(v) ? v.join("+") : v}`).join(",") : undefined;
  }

  function setColumnChoices(names, selected = columnMap() || {}) {
    // the dropdowns list the dataset's columns (and any column already chosen), keeping the choices made
    for (const select of mapSelects) {
      const key = select.dataset.column;
      const want = [selected[key] ?? []].flat();
      const keep = [...select.options].filter(o => o.value === "");
      const options = [...new Set([...names, ...want])].map(n => el("option", { value: n, text: n }));
      select.replaceChildren(...keep, ...options);
      for (const option of select.options) option.selected = want.includes(option.value) && option.value !== "";
    }
  }

  function mappingParams(c) {
    const d = c.dataset;
    const out = { columns: columnsParam(d.columns), prompt_template: d.prompt_template || undefined,
                  system_prompt: d.system_prompt || undefined, config_name: d.config_name || undefined };
    return Object.fromEntries(Object.entries(out).filter(([, v]) => v !== undefined));
  }

  function loadRows(seq, rowsBox, source, c, synth) {
    // seq: this request's rowsSeq; an older answer than the newest request is dropped
    return api("/datasets/preview", { params: {
      source, split: c.dataset.split, rows: 5, ...mappingParams(c),
      ...(synth ? { dataset_rows: c.dataset.rows, min_images: c.dataset.min_images, max_images: c.dataset.max_images, seed: c.dataset.seed } : {}),
    } }).then(data => {
      if (seq !== rowsSeq) return null;
      const total = data.total_rows === null || data.total_rows === undefined ? "" : ` of ${data.total_rows}`;
      rowsBox.replaceChildren(el("h3", { text: `First ${data.rows.length} rows${total}` }),
        // where the preview stopped early (its image or byte budget) and why, said above the rows it did show
        ...(data.note ? [el("p", { class: "preview-note muted", text: data.note })] : []), previewRows(data.rows));
      return data;
    }, err => { if (seq === rowsSeq) rowsBox.replaceChildren(el("p", { class: "error", text: errorText(err) })); return null; });
  }

  let liveTimer = null;
  function livePreview() {
    // a changed mapping re-renders the previewed rows (not the whole check) a moment after the last change
    clearTimeout(liveTimer);
    liveTimer = setTimeout(() => {
      const rowsBox = document.querySelector("#preview .preview-rows-box");
      if (!rowsBox) return;
      const source = sourceValue();
      const seq = ++rowsSeq;  // the check of a Preview still running is kept: only the rows are asked again
      loadRows(seq, rowsBox, source, config(), isSynth(source)).then(() => {
        if (seq === rowsSeq) document.getElementById("preview").dataset.live = String(seq);
      });
    }, 300);
  }

  function progressNode(label) {
    // shown while the dataset is read and checked: an indeterminate bar and the seconds so far
    const started = Date.now();
    const seconds = el("span", { class: "elapsed", text: "0 s" });
    const node = el("div", { class: "preview-progress", role: "status", "aria-live": "polite" },
      el("progress", { "aria-label": label }), el("span", { text: label + " " }), seconds);
    const timer = setInterval(() => { seconds.textContent = Math.round((Date.now() - started) / 1000) + " s"; }, 500);
    return { node, stop: () => clearInterval(timer) };
  }

  function errorText(err) {
    const detail = err.body?.detail;
    if (!detail) return String(err);
    return typeof detail === "string" ? detail : detail.map(d => `${d.path}: ${d.message}`).join("; ");
  }

  function gib(bytes) { return (bytes / 2 ** 30).toFixed(2) + " GiB"; }

  const PLAN_PARTS = ["parameters", "gradients", "optimizer", "reference", "gathered", "activations", "logits",
    "generation_cache", "generation_weights", "host", "training_peak", "generation_peak", "peak"];

  function planNodes(plan) {
    // one column per strategy, one row per part (POST /plan: collage plan's figures)
    const m = plan.model, s = plan.strategies;
    const cell = (tag, text, cls) => el(tag, cls ? { class: cls, text } : { text });
    const head = el("tr", {}, cell("th", "per process"), ...s.map(f => cell("th", f.strategy)));
    const rows = PLAN_PARTS.map(p => el("tr", {}, cell("th", p.replace(/_/g, " ")), ...s.map(f => cell("td", gib(f[p])))));
    if (plan.gpu_memory != null) {
      rows.push(el("tr", {}, cell("th", `fits ${gib(plan.gpu_memory)}`),
        ...s.map(f => cell("td", f.fits ? "yes" : "no", f.fits ? "fits" : "error"))));
    }
    const about = `${m.model_type}: ${(m.parameters / 1e9).toFixed(3)}B parameters, ${(m.trainable / 1e9).toFixed(3)}B ` +
      `trainable, on ${plan.run.processes} process${plan.run.processes === 1 ? "" : "es"}`;
    return [el("p", { text: about }), el("table", { class: "plan-table" }, el("thead", {}, head), el("tbody", {}, ...rows))];
  }

  async function memoryPlan() {
    const box = document.getElementById("plan");
    const button = document.getElementById("plan-btn");
    const memory = document.getElementById("plan-memory").value.trim();
    button.disabled = true;
    box.replaceChildren(el("p", { class: "muted", text: "planning…" }));
    try {
      const plan = await api("/plan", { method: "POST", body: { config: config(), gpu_memory: memory || null } });
      box.replaceChildren(...planNodes(plan));
    } catch (err) {
      box.replaceChildren(el("p", { class: "error", text: errorText(err) }));
    } finally {
      button.disabled = false;
    }
  }

  async function preview() {
    const box = document.getElementById("preview");
    const button = document.getElementById("preview-btn");
    const seq = ++previewSeq;
    const source = sourceValue();
    const c = config();
    const synth = isSynth(source);
    const progress = progressNode("Reading and checking the dataset…");
    const rowsBox = el("div", { class: "preview-rows-box" });
    const reportBox = el("div", { class: "preview-report" });
    box.setAttribute("aria-busy", "true");
    box.replaceChildren(progress.node, reportBox, rowsBox);
    button.disabled = true;
    const rowsDone = loadRows(++rowsSeq, rowsBox, source, c, synth).then(data => {
      if (!data) return;
      setColumnChoices(data.column_names);
      // a dataset of its own: the mapping is what to look at next, so its group opens
      if (!synth && data.column_names.length) document.getElementById("columns-group").open = true;
      // the guess replaces the defaults until the user picks a column; Preview and check run again with it once
      // this check has answered (two at once would pass the server's dataset requests per user)
      if (!mappingTouched && !c.dataset.columns && Object.keys(data.guess || {}).length) {
        setColumnChoices(data.column_names, data.guess);
        rerunWithGuess = true;
      }
    });
    const evalBox = el("div", { class: "preview-eval-report" });
    const check = (src, split, into) => api("/datasets/check", { method: "POST", body: {
      source: src, split, model: c.model.path, max_prompt_length: c.train.max_prompt_length || null,
      ...(isSynth(src) ? { rows: c.dataset.rows, min_images: c.dataset.min_images, max_images: c.dataset.max_images, seed: c.dataset.seed } : {}),
      columns: c.dataset.columns, prompt_template: c.dataset.prompt_template || null,
      system_prompt: c.dataset.system_prompt || null, config_name: c.dataset.config_name || null,
      check: c.dataset.check || "auto",
    } }).then(report => { if (seq === previewSeq) into.replaceChildren(...reportNodes(report)); },
      err => { if (seq === previewSeq) into.replaceChildren(el("p", { class: "error", text: errorText(err) })); });
    // the held-out split (dataset.eval_split, read from eval_source when set) is checked too, after the training
    // split's check (the server takes two dataset requests of a user at once: the rows and one check)
    const evalSplit = c.dataset.eval_split;
    const evalSource = c.dataset.eval_source || source;
    const checkDone = check(source, c.dataset.split, reportBox).then(() => {
      if (!evalSplit || seq !== previewSeq) return null;
      reportBox.after(evalBox);
      evalBox.replaceChildren(el("h3", { text: `Held-out split ${evalSplit}` + (c.dataset.eval_source ? ` of ${evalSource}` : "") }),
        el("p", { class: "muted", text: "checking…" }));
      const body = el("div");
      return check(evalSource, evalSplit, body).then(() => { if (seq === previewSeq) evalBox.replaceChildren(evalBox.firstChild, ...body.childNodes); });
    });
    await Promise.allSettled([rowsDone, checkDone]);
    progress.stop();
    if (seq !== previewSeq) return;
    progress.node.remove();
    box.removeAttribute("aria-busy");
    box.dataset.done = String(seq);
    button.disabled = false;
    if (rerunWithGuess) { rerunWithGuess = false; preview(); }
  }

  function reportNodes(report) {
    // a check's answer: its summary, the images converted as the processor does, by kind, and the bad rows
    const parts = [el("p", { class: report.ok ? "ok" : "error", text: report.summary })];
    const kinds = Object.entries(report.conversions || {}).sort((a, b) => b[1] - a[1]);
    if (kinds.length) {
      parts.push(el("ul", { class: "conversions", "aria-label": "images converted, by kind" },
        kinds.map(([kind, n]) => el("li", {}, el("span", { class: "kind", text: kind }), el("span", { class: "count", text: `${n} image${n === 1 ? "" : "s"}` })))));
    }
    if (report.large_images?.length) {
      parts.push(el("p", { class: "muted", text: `${report.large_images.length} image(s) over 16 MP: ` +
        report.large_images.slice(0, 5).map(i => `row ${i.row} image ${i.image} (${i.width}x${i.height})`).join(", ") }));
    }
    if (report.errors.length) parts.push(el("ul", { class: "problems" }, report.errors.slice(0, 50).map(e => el("li", { text: `row ${e.row}: ${e.message}` }))));
    return parts;
  }

  // the preview's other columns, readable: an image struct ({bytes, path}) shows as an image marker, a list of
  // them as their count, a long value shortened (its whole text on hover)
  const VALUE_MAX = 80;
  function isImageStruct(v) {
    return v !== null && typeof v === "object" && !Array.isArray(v) && Object.keys(v).length > 0
      && Object.keys(v).every(k => k === "bytes" || k === "path") ;
  }
  function shorten(text) { return text.length > VALUE_MAX ? text.slice(0, VALUE_MAX - 1) + "…" : text; }
  function columnValue(v) {
    if (isImageStruct(v)) return el("span", { class: "col-image", title: v.path || "image bytes", text: "image" });
    if (Array.isArray(v) && v.length && v.every(isImageStruct)) {
      return el("span", { class: "col-image", title: v.map(i => i.path || "image bytes").join(", "), text: `${v.length} image${v.length === 1 ? "" : "s"}` });
    }
    const text = typeof v === "string" ? v : JSON.stringify(v);
    return el("span", { class: "col-value", title: text.length > VALUE_MAX ? text.slice(0, 2000) : null, text: shorten(text) });
  }
  function columnsNode(columns) {
    return el("dl", { class: "preview-columns" }, Object.entries(columns).flatMap(([k, v]) => [el("dt", { text: k }), el("dd", {}, columnValue(v))]));
  }

  function enlarge(image) {
    Collage.modal(el("figure", {}, el("img", { src: image.url, alt: "image " + image.sha256, class: "full" }), el("figcaption", { text: `${image.width}x${image.height}` })));
  }

  function previewRows(rows) {
    return el("table", { class: "preview-rows" },
      el("thead", {}, el("tr", {}, ["Row", "Images", "Prompt", "Columns"].map(h => el("th", { text: h })))),
      el("tbody", {}, rows.map(r => el("tr", { "data-row": String(r.row) },
        el("td", { class: "row-id", text: "row " + r.row }),
        el("td", { class: "thumbs", "data-label": "images" }, r.images.map((im, i) => el("img", { src: im.thumb_url, alt: `image ${i + 1}`, class: "thumb", width: 56, onclick: () => enlarge(im) }))),
        el("td", {}, r.error ? el("span", { class: "error", text: r.error }) : promptNode(r.prompt, r.images)),
        el("td", { class: "columns muted" }, columnsNode(r.columns)),
      ))));
  }

  function fill(cfg) {
    const flat = (obj, prefix = "") => Object.entries(obj).flatMap(([k, v]) =>
      v && typeof v === "object" && !Array.isArray(v) ? flat(v, prefix + k + ".") : [[prefix + k, v]]);
    form.querySelector(`input[name="algorithm"][value="${cfg.algorithm}"]`).checked = true;
    for (const [path, value] of flat(cfg)) {
      const input = form.querySelector(`[name="${CSS.escape(path)}"]`);
      if (!input) continue;
      if (input.type === "checkbox") input.checked = !!value;
      else input.value = Array.isArray(value) ? value.join(", ") : value ?? "";
    }
    const columns = cfg.dataset.columns || {};
    const chosen = Object.fromEntries(Object.entries(columns).filter(([, v]) => v !== null && v !== undefined));
    setColumnChoices([], chosen);
    mappingTouched = Object.keys(chosen).length > 0;
    document.getElementById("lora-on").checked = !!cfg.model.lora;
    document.getElementById("lora").hidden = !cfg.model.lora;
    form.querySelector('[name="name"]').value = cfg.name + "-clone";
    rewardsBox.replaceChildren();
    for (const r of cfg.rewards) addReward(r.name, r.weight, r.on_images_for_text_reward || "error");
    fillTools(cfg.tools || []);
    showAlgorithmFields();
    showSourceFields();
  }

  form.addEventListener("input", e => { if (e.target.name === "dataset.source") showSourceFields(); });
  document.getElementById("expand-all").addEventListener("click", e => {
    // every collapsed group at once (and back): to read or search the whole form
    const open = e.currentTarget.getAttribute("aria-pressed") !== "true";
    for (const d of form.querySelectorAll("details")) d.open = open;
    e.currentTarget.setAttribute("aria-pressed", String(open));
    e.currentTarget.textContent = open ? "Collapse the advanced settings" : "Show every setting";
  });
  form.addEventListener("change", e => {
    if (e.target.name === "dataset.source") showSourceFields();
    if (e.target.name === "algorithm" || e.target.name === "train.loss_type") showAlgorithmFields();
    if (e.target.dataset.column) { mappingTouched = true; livePreview(); }
  });
  for (const name of ["dataset.prompt_template", "dataset.system_prompt"]) {
    form.querySelector(`[name="${name}"]`)?.addEventListener("input", livePreview);
  }
  document.getElementById("lora-on").addEventListener("change", e => { document.getElementById("lora").hidden = !e.target.checked; });
  document.getElementById("add-reward").addEventListener("click", () => addReward());
  document.getElementById("preview-btn").addEventListener("click", preview);
  document.getElementById("plan-btn").addEventListener("click", memoryPlan);
  document.getElementById("yaml-btn").addEventListener("click", () => {
    const pre = document.getElementById("yaml");
    pre.textContent = toYaml(config()).trimStart();
    pre.hidden = !pre.hidden;
  });
  form.addEventListener("submit", async e => {
    e.preventDefault();
    clearErrors();
    const button = document.getElementById("launch-btn");
    button.disabled = true;
    try {
      // a clone goes through the clone route: the new run records the run it came from (its page links to it) and
      // keeps the config keys the form has no field for (dataset columns, ...), changed by everything the form says
      const clone = form.dataset.clone;
      const created = clone ? await api(`/runs/${clone}/clone`, { method: "POST", body: { overrides: config() } })
        : await api("/runs", { method: "POST", body: config() });
      location.href = "/runs/" + created.id;
    } catch (err) {
      if (err.status === 422) showErrors(err.body.detail);
      else showErrors([{ path: "", message: err.body?.detail || String(err) }]);
    } finally { button.disabled = false; }
  });

  (async () => {
    const [rewards, models] = await Promise.all([api("/rewards"), api("/models")]);
    rewardNames = rewards.builtins.map(r => r.name);
    document.getElementById("reward-docs").replaceChildren(...rewards.builtins.flatMap(r => [el("dt", { text: r.name }), el("dd", { text: r.doc })]),
      el("dt", { text: "your function" }), el("dd", { text: rewards.user_functions }),
      el("dt", { text: "text reward model" }), el("dd", { text: rewards.text_reward_models }));
    document.body.append(el("datalist", { id: "reward-options" }, rewardNames.map(n => el("option", { value: n }))));
    document.getElementById("model-options").replaceChildren(...[...models.tiny, ...models.local].map(m => el("option", { value: m })));
    const clone = form.dataset.clone;
    if (clone) fill((await api("/runs/" + clone)).config);
    else { addReward("accuracy", 1.0); addReward("numeric", 0.5); }
    showAlgorithmFields();
    showSourceFields();
  })();
})();
