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
      if (path === "algorithm" || path.startsWith("reward.")) continue;
      if (path.startsWith("model.lora.") && !document.getElementById("lora-on").checked) continue;
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
    return out;
  }

  function addReward(name = "", weight = 1, mode = "error") {
    const index = rewardsBox.children.length;
    const row = el("div", { class: "reward field", "data-path": `rewards[${index}]` },
      el("input", { name: "reward.name", list: "reward-options", value: name, placeholder: "built-in, package.module:function, or a reward-model folder", "aria-label": "reward name" }),
      el("label", {}, "weight ", el("input", { name: "reward.weight", value: String(weight), size: 4, "aria-label": "reward weight" })),
      el("label", {}, "images for a text reward model ", el("select", { name: "reward.on_images" }, el("option", { value: "error", text: "refuse" }), el("option", { value: "drop", text: "drop with a warning" }))),
      el("button", { type: "button", class: "link", text: "remove", onclick: () => { row.remove(); renumber(); } }),
      el("span", { class: "error", "data-error-for": `rewards[${index}].name` }),
      el("span", { class: "error", "data-error-for": `rewards[${index}].weight` }));
    row.querySelector("select").value = mode;
    rewardsBox.append(row);
  }

  function renumber() {
    [...rewardsBox.children].forEach((row, i) => {
      row.dataset.path = `rewards[${i}]`;
      const [n, w] = row.querySelectorAll(".error");
      n.dataset.errorFor = `rewards[${i}].name`; w.dataset.errorFor = `rewards[${i}].weight`;
    });
  }

  function clearErrors() {
    for (const e of form.querySelectorAll("[data-error-for]")) e.textContent = "";
    for (const f of form.querySelectorAll(".field.invalid")) f.classList.remove("invalid");
    document.getElementById("form-error").hidden = true;
  }

  function showErrors(detail) {
    const unplaced = [];
    for (const { path, message } of detail) {
      const slot = form.querySelector(`[data-error-for="${CSS.escape(path)}"]`);
      if (slot) { slot.textContent = message; slot.closest(".field")?.classList.add("invalid"); }
      else unplaced.push(`${path}: ${message}`);
    }
    const top = document.getElementById("form-error");
    if (unplaced.length) { top.textContent = unplaced.join("; "); top.hidden = false; }
    form.querySelector(".field.invalid input, .field.invalid select")?.focus();
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
      const source = form.querySelector('[name="dataset.source"]').value.trim();
      const seq = ++rowsSeq;  // the check of a Preview still running is kept: only the rows are asked again
      loadRows(seq, rowsBox, source, config(), source.startsWith("synth:")).then(() => {
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

  async function preview() {
    const box = document.getElementById("preview");
    const button = document.getElementById("preview-btn");
    const seq = ++previewSeq;
    const source = form.querySelector('[name="dataset.source"]').value.trim();
    const c = config();
    const synth = source.startsWith("synth:");
    const progress = progressNode("Reading and checking the dataset…");
    const rowsBox = el("div", { class: "preview-rows-box" });
    const reportBox = el("div", { class: "preview-report" });
    box.setAttribute("aria-busy", "true");
    box.replaceChildren(progress.node, reportBox, rowsBox);
    button.disabled = true;
    const rowsDone = loadRows(++rowsSeq, rowsBox, source, c, synth).then(data => {
      if (!data) return;
      setColumnChoices(data.column_names);
      // the guess replaces the defaults until the user picks a column; Preview and check run again with it once
      // this check has answered (two at once would pass the server's dataset requests per user)
      if (!mappingTouched && !c.dataset.columns && Object.keys(data.guess || {}).length) {
        setColumnChoices(data.column_names, data.guess);
        rerunWithGuess = true;
      }
    });
    const checkDone = api("/datasets/check", { method: "POST", body: {
      source, split: c.dataset.split, model: c.model.path, max_prompt_length: c.train.max_prompt_length || null,
      rows: c.dataset.rows, min_images: c.dataset.min_images, max_images: c.dataset.max_images, seed: c.dataset.seed,
      columns: c.dataset.columns, prompt_template: c.dataset.prompt_template || null,
      system_prompt: c.dataset.system_prompt || null, config_name: c.dataset.config_name || null,
      check: c.dataset.check || "auto",
    } }).then(report => {
      if (seq !== previewSeq) return;
      const parts = [el("p", { class: report.ok ? "ok" : "error", text: report.summary })];
      if (report.errors.length) parts.push(el("ul", { class: "problems" }, report.errors.slice(0, 50).map(e => el("li", { text: `row ${e.row}: ${e.message}` }))));
      reportBox.replaceChildren(...parts);
    }, err => { if (seq === previewSeq) reportBox.replaceChildren(el("p", { class: "error", text: errorText(err) })); });
    await Promise.allSettled([rowsDone, checkDone]);
    progress.stop();
    if (seq !== previewSeq) return;
    progress.node.remove();
    box.removeAttribute("aria-busy");
    box.dataset.done = String(seq);
    button.disabled = false;
    if (rerunWithGuess) { rerunWithGuess = false; preview(); }
  }

  function enlarge(image) {
    Collage.modal(el("figure", {}, el("img", { src: image.url, alt: "image " + image.sha256, class: "full" }), el("figcaption", { text: `${image.width}x${image.height}` })));
  }

  function previewRows(rows) {
    return el("table", { class: "preview-rows" },
      el("thead", {}, el("tr", {}, ["Row", "Images", "Prompt", "Columns"].map(h => el("th", { text: h })))),
      el("tbody", {}, rows.map(r => el("tr", { "data-row": String(r.row) },
        el("td", { text: "row " + r.row }),
        el("td", { class: "thumbs" }, r.images.map((im, i) => el("img", { src: im.thumb_url, alt: `image ${i + 1}`, class: "thumb", width: 56, onclick: () => enlarge(im) }))),
        el("td", {}, r.error ? el("span", { class: "error", text: r.error }) : promptNode(r.prompt, r.images)),
        el("td", { class: "muted", text: Object.entries(r.columns).map(([k, v]) => `${k}=${JSON.stringify(v)}`).join(" ").slice(0, 300) }),
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
    showAlgorithmFields();
  }

  form.addEventListener("change", e => {
    if (e.target.name === "algorithm" || e.target.name === "train.loss_type") showAlgorithmFields();
    if (e.target.dataset.column) { mappingTouched = true; livePreview(); }
  });
  for (const name of ["dataset.prompt_template", "dataset.system_prompt"]) {
    form.querySelector(`[name="${name}"]`)?.addEventListener("input", livePreview);
  }
  document.getElementById("lora-on").addEventListener("change", e => { document.getElementById("lora").hidden = !e.target.checked; });
  document.getElementById("add-reward").addEventListener("click", () => addReward());
  document.getElementById("preview-btn").addEventListener("click", preview);
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
  })();
})();
