"use strict";
// The rollout table: server-side filters, sorts (the total reward or any one reward function) and paging; rows
// grouped by prompt group with the group's mean/std and zero-variance flag; each row's dataset columns beside its
// completion; an image gallery (arrow keys or j/k, Escape closes); a group view (one prompt, its completions side
// by side, ranked by reward); live: new steps are announced, never pushed under the reader; every filter and the
// sort live in the URL query under the API's own parameter names; a split selector shows the training rollouts
// or the held-out evaluation's (split=eval: the table, count, group view, gallery and exports follow it); the step
// slider walks the steps that have rows of the chosen split; a multi-turn rollout's trajectory turn by turn (the
// model's text and tool calls, each tool's images beside the thumbnail they were cropped from with the crop's box
// drawn on it, tool errors), and in the group view where each completion zoomed. Untrusted text is only ever shown
// as text.
(() => {
  const { api, el, num, promptNode } = Collage;
  const { gallery, boxFrame, validBox, boxText, trajectoryNode, toolBadges } = Trajectory;
  const ENDED = ["succeeded", "failed", "cancelled", "deleted"];
  const root = document.getElementById("rollouts");
  const runId = root.dataset.run;
  const rewardNames = root.dataset.rewards ? root.dataset.rewards.split(",") : [];
  const samplesEvery = Math.max(1, Number(root.dataset.samplesEvery) || 1);
  const form = document.getElementById("sample-filters");
  const body = document.getElementById("samples-body");
  const more = document.getElementById("more");
  const count = document.getElementById("count");
  const totalBox = document.getElementById("total");
  const slider = document.getElementById("step-slider");  // position i > 0: the i-th step with rows, 0: every step
  const stepField = form.querySelector('[name="step"]');  // the step itself, as the API and the URL name it
  const stepOut = document.getElementById("step-out");
  const formError = document.getElementById("filters-error");
  const newBar = document.getElementById("new-steps-bar");
  const newButton = document.getElementById("new-steps");
  const groupView = document.getElementById("group-view");
  const tableBox = document.getElementById("table-box");
  let cursor = null, shown = 0, lastGroup = null, seq = 0;
  let rowsPending = false;  // a new filter's first page is on its way: the rows on screen are not its rows
  let newestStep = 0;  // the newest step with rollout rows the page knows of
  let loadedTop = 0;   // ... and the newest one when the table was last loaded from the first page
  let group = null;    // {step, group} while the group view is open
  let stepList = [];   // the steps with rollout rows of the split shown, ascending: the slider's positions
  const splitField = form.querySelector('[name="split"]');
  const evaluation = () => splitField.value === "eval";
  // filters that mean nothing for evaluation rollouts (no advantage, no learning signal): off while they are shown
  const TRAIN_ONLY = ["advantage", "zero_std_groups"];

  // ------------------------------------------------------------------------------------- URL and filters

  function params() {
    const p = {};
    for (const [name, value] of new FormData(form)) {
      if (String(value).trim() === "") continue;
      if (name === "sort" && value === "step") continue;    // the API's default
      if (name === "split" && value === "train") continue;  // the API's default
      p[name] = value;
    }
    return p;
  }

  function writeUrl() {
    const query = new URLSearchParams(params());
    if (group) query.set("view", `group:${group.step}:${group.group}`);
    const search = query.toString();
    history.replaceState(null, "", location.pathname + (search ? "?" + search : "") + location.hash);
  }

  function readUrl() {
    const query = new URLSearchParams(location.search);
    for (const field of form.elements) {
      if (!field.name || !query.has(field.name)) continue;
      const value = query.get(field.name);
      if (field.tagName === "SELECT" && ![...field.options].some(o => o.value === value)) {
        field.append(el("option", { value, text: value }));  // shown as it is; the API says whether it is valid
      }
      field.value = value;
    }
    showStep();
    const view = /^group:(\d+):(\d+)$/.exec(query.get("view") || "");
    return view ? { step: Number(view[1]), group: Number(view[2]) } : null;
  }

  function showStep() {
    stepOut.textContent = stepField.value.trim() !== "" ? stepField.value : "all";
    slider.setAttribute("aria-valuetext", stepField.value.trim() !== "" ? `step ${stepField.value}` : "every step");
  }

  // "1 row", "2 rows", "1,234 rows"
  const plural = (n, word, words = word + "s") => `${n.toLocaleString("en")} ${n === 1 ? word : words}`;

  // The slider's positions: every step (0), then each step that has rows of the split shown. A step from a link
  // that has none keeps a position of its own (the table says it has no rows), as a select keeps an unknown value.
  function setSteps(steps) {
    const chosen = stepField.value.trim() === "" ? null : Number(stepField.value);
    stepList = [...steps];
    if (chosen !== null && Number.isInteger(chosen) && chosen >= 0 && !stepList.includes(chosen)) {
      stepList.push(chosen);
      stepList.sort((a, b) => a - b);
    }
    slider.max = String(stepList.length);
    slider.value = String(chosen === null ? 0 : stepList.indexOf(chosen) + 1);
    slider.disabled = stepList.length === 0;
    slider.dataset.steps = stepList.join(",");
    slider.title = stepList.length ? `${plural(stepList.length, "step")} with rows: ← → move between them` : "no rows yet";
    showStep();
  }

  function slide() {
    const at = Number(slider.value);
    stepField.value = at > 0 && at <= stepList.length ? String(stepList[at - 1]) : "";
    showStep();
  }

  // The split's look: the train-only filters disabled (a disabled field is not sent), the samples' export links
  // for this split, the page's state for styles and tests.
  function showSplit() {
    const ev = evaluation();
    for (const name of TRAIN_ONLY) {
      const field = form.elements.namedItem(name);
      field.disabled = ev;
      field.closest("label").title = ev ? "evaluation rollouts have no advantage: this filter applies to training rollouts" : "";
    }
    root.dataset.split = splitField.value;
    for (const link of document.querySelectorAll("a.export")) {
      const url = new URL(link.getAttribute("href"), location.origin);
      const samples = link.dataset.what === "samples";
      if (samples && ev) url.searchParams.set("split", "eval"); else url.searchParams.delete("split");
      link.href = url.pathname + url.search;
      link.textContent = `${samples && ev ? "eval " : ""}${link.dataset.what}.${link.dataset.format}`;
    }
  }

  function clearErrors() {
    for (const slot of form.querySelectorAll(".field-error")) slot.textContent = "";
    for (const field of form.querySelectorAll(".invalid")) field.classList.remove("invalid");
  }

  function problems(err) {
    const detail = err && err.body && err.body.detail;
    if (Array.isArray(detail)) return detail.map(d => ({ path: String(d.path || ""), message: String(d.message || d.msg || "") }));
    return [{ path: "", message: typeof detail === "string" ? detail : `the server could not be reached (${err && err.message})` }];
  }

  // the API's 422 names each bad parameter (query.min_reward): its message goes next to that field
  function showErrors(err) {
    for (const { path, message } of problems(err)) {
      const name = path.replace(/^query\./, "");
      const slot = [...form.querySelectorAll("[data-error-for]")].find(s => s.dataset.errorFor === name);
      const field = name ? form.elements.namedItem(name) : null;
      if (field && field.classList) field.classList.add("invalid");
      const target = slot || formError;
      const text = slot ? message : (path ? `${path}: ${message}` : message);
      target.textContent = target.textContent ? `${target.textContent} ${text}` : text;
    }
  }

  // ---------------------------------------------------------------------------------------------- rows

  // the dataset row's scalar columns (answer, ...), for judging the reward: "answer: 3"
  function columnsNode(columns) {
    const entries = Object.entries(columns || {});
    if (!entries.length) return null;
    return el("div", { class: "columns", "aria-label": "dataset columns" }, entries.map(([key, value]) =>
      el("span", { class: "column", "data-column": key }, el("b", { text: key + ": " }), value === null ? "–" : String(value))));
  }

  function thumbs(images) {
    return images.map((image, i) => el("img", {
      src: image.thumb_url, alt: `image ${i + 1} of ${images.length}`, class: "thumb", loading: "lazy",
      tabindex: "0", onclick: () => gallery(images, i),
      onkeydown: e => { if (e.key === "Enter") gallery(images, i); },
    }));
  }

  function advClass(advantage) { return advantage > 0 ? "pos" : advantage < 0 ? "neg" : "zero"; }

  const isEval = s => s.split === "eval";

  function groupRow(s) {
    const cols = 6 + rewardNames.length;
    // an evaluation's "group" is a held-out prompt: no advantage, so no learning signal to flag
    const head = isEval(s) ? `evaluated at step ${s.step} · held-out prompt ${s.group}` + (s.dataset_row === null ? "" : ` (row ${s.dataset_row})`)
      : `step ${s.step} · group ${s.group} · mean ${num(s.group_mean)} · std ${num(s.group_std)}`;
    return el("tr", { class: "group" + (s.zero_std && !isEval(s) ? " zero-std" : ""), "data-step": s.step, "data-group": s.group }, el("td", { colspan: cols },
      head,
      s.zero_std && !isEval(s) ? el("span", { class: "badge", text: "zero variance: no learning signal" }) : null,
      el("button", { type: "button", class: "link open-group", text: "view group side by side", onclick: () => openGroup(s.step, s.group) })));
  }

  // ------------------------------------------------------------------------------------------ trajectories
  // (trajectory.js: the turns, each tool image beside its source with the crop's box, the gallery)

  // The group view's "who zoomed where": each of the prompt's images with every completion's boxes on it (a box is
  // labelled with the completion's rank); crops of a tool's own image are in that completion's trajectory.
  function zoomMap(prompt, items) {
    const n = prompt.images.length;
    const boxes = prompt.images.map(() => []);
    items.forEach((s, rank) => {
      for (const t of s.trajectory || []) for (const image of t.images || []) {
        const src = image.source;
        if (src && Number.isInteger(src.image) && src.image >= 0 && src.image < n && validBox(src.bbox_2d)) {
          boxes[src.image].push({ box: src.bbox_2d, label: `#${rank + 1}`, id: s.id, title: `#${rank + 1} (completion ${s.index}): ${boxText(src.bbox_2d)}` });
        }
      }
    });
    if (!boxes.some(b => b.length)) return null;
    return el("div", { class: "zoom-map" },
      el("h3", { text: "where each completion zoomed" }),
      el("div", { class: "zoom-map-images" }, prompt.images.map((image, k) => el("figure", {},
        boxFrame(image, k, boxes[k], () => gallery(prompt.images, k)),
        el("figcaption", { class: "muted", text: `image ${k} · ${plural(boxes[k].length, "box", "boxes")}` })))));
  }

  // each number cell carries its column's name (data-label): on a narrow screen a row is a card and says it
  function sampleRow(s) {
    return el("tr", { class: "sample" + (isEval(s) ? " eval" : ""), "data-id": s.id, "data-split": s.split },
      el("td", { class: "position-cell" }, el("button", { type: "button", class: "link position", title: "view this group side by side", text: `${s.step}·${s.group}·${s.index}`, onclick: () => openGroup(s.step, s.group) }),
        isEval(s) ? el("small", { class: "muted evaluated-at", text: `evaluated at step ${s.step}` }) : null),
      el("td", { class: "thumbs" }, thumbs(s.images)),
      el("td", { class: "prompt-cell" }, promptNode(s.prompt, s.images)),
      el("td", { class: "completion-cell" }, el("pre", { class: "completion", text: s.completion }), s.truncated ? el("span", { class: "badge", text: "truncated" }) : null,
        s.completion_length === null || s.completion_length === undefined ? null : el("small", { class: "muted tokens", text: ` ${plural(s.completion_length, "token")}` }),
        toolBadges(s), trajectoryNode(s), columnsNode(s.columns)),
      rewardNames.map(n => el("td", { class: "num", "data-reward": n, "data-label": n, text: num(s.rewards[n]) })),
      el("td", { class: "num total", "data-label": "reward", text: num(s.reward) }),
      isEval(s) ? el("td", { class: "num advantage", "data-label": "advantage", title: "evaluation rollouts are not trained on: no advantage", text: "–" })
        : el("td", { class: "num advantage adv-" + advClass(s.advantage), "data-label": "advantage", text: num(s.advantage) }));
  }

  // How many rows match the filters (GET .../samples/count, capped): asked once per filter change, not per page.
  let total = null, totalSeq = 0, failed = false;
  async function loadTotal(query) {
    const mine = ++totalSeq;
    total = null;
    let answer;
    try {
      answer = await api(`/runs/${runId}/samples/count`, { params: query });
    } catch (err) {
      return;  // the page's own request reports a bad filter; the count just stays unknown
    }
    if (mine !== totalSeq) return;  // the filters changed meanwhile: a newer count is on its way
    total = answer;
    showCount();
  }

  function showCount() {
    if (failed) return;  // the filters are refused: no count under the error
    const of = total === null ? "" : total.capped ? ` of more than ${total.cap.toLocaleString("en")}` : ` of ${total.count.toLocaleString("en")}`;
    // the count can answer before the rows: never claim "0 of 12 rows shown" while they load
    // the noun agrees with the number next to it: "1 row shown", "1 of 12 rows shown", "1 of 1 row shown"
    const noun = total === null ? shown : total.capped ? total.cap : total.count;
    count.textContent = rowsPending ? "Loading rows…"
      : `${shown.toLocaleString("en")}${of} row${noun === 1 ? "" : "s"} shown` + (cursor && total === null ? " (more on the server)" : "");
    totalBox.textContent = total === null ? "" : total.capped ? `More than ${total.cap.toLocaleString("en")} rows match`
      : `${plural(total.count, "row")} match${total.count === 1 ? "es" : ""}`;
    totalBox.dataset.count = total === null ? "" : String(total.count);
    totalBox.dataset.capped = total === null ? "" : String(total.capped);
  }

  async function load(append = false) {
    const mine = ++seq;
    const query = params();
    if (!append) { writeUrl(); showSplit(); rowsPending = true; }
    let page;
    if (!append) { const { sort, ...filters } = query; loadTotal(filters); }  // a count has no order
    try {
      page = await api(`/runs/${runId}/samples`, { params: { ...query, limit: 100, cursor: append ? cursor : undefined } });
    } catch (err) {
      if (mine !== seq) return;
      clearErrors();
      failed = true;
      rowsPending = false;
      // no stale rows or count under an error: the table shows nothing until the filters are valid again
      body.replaceChildren();
      cursor = null; shown = 0; lastGroup = null;
      more.hidden = true;
      count.textContent = "";
      totalBox.textContent = "";
      showErrors(err);
      return;
    }
    if (mine !== seq) return;  // a newer request was made meanwhile: its answer wins
    clearErrors();
    failed = false;
    if (!append) {
      cursor = null; shown = 0; lastGroup = null; body.replaceChildren();
      loadedTop = newestStep;
      newBar.hidden = true;
    }
    cursor = page.next_cursor;
    more.hidden = !cursor || !!group;
    const grouped = (query.sort || "step").replace(/^[-+]/, "") === "step";
    for (const s of page.items) {
      const key = `${s.step}:${s.group}`;
      if (grouped && key !== lastGroup) body.append(groupRow(s));
      lastGroup = key;
      body.append(sampleRow(s));
    }
    shown += page.items.length;
    if (!append) rowsPending = false;
    showCount();
  }

  // ----------------------------------------------------------------------------------------- group view

  function rewardList(s) {
    return el("dl", { class: "rewards" },
      rewardNames.flatMap(n => [el("dt", { text: n }), el("dd", { class: "num", "data-reward": n, text: num(s.rewards[n]) })]),
      el("dt", { text: "reward" }), el("dd", { class: "num total", text: num(s.reward) }),
      isEval(s) ? null : [el("dt", { text: "advantage" }), el("dd", { class: "num adv-" + advClass(s.advantage), text: num(s.advantage) })]);
  }

  async function openGroup(step, groupIndex) {
    group = { step, group: groupIndex };
    writeUrl();
    const mine = group;
    tableBox.hidden = true;
    more.hidden = true;
    count.hidden = true;
    totalBox.hidden = true;
    groupView.hidden = false;
    const back = el("button", { type: "button", class: "back", text: "← back to the table", onclick: closeGroup });
    groupView.replaceChildren(back, el("p", { class: "muted", text: "loading…" }));
    let page;
    try {
      page = await api(`/runs/${runId}/samples`, { params: { step, group: groupIndex, sort: "-reward", limit: 500, split: splitField.value } });
    } catch (err) {
      if (group !== mine) return;
      groupView.replaceChildren(back, el("p", { class: "error", text: problems(err).map(p => p.message).join(" ") }));
      return;
    }
    if (group !== mine) return;
    const items = page.items;
    if (!items.length) {
      groupView.replaceChildren(back, el("p", { class: "muted", text: `No rows for step ${step}, group ${groupIndex}.` }));
      return;
    }
    const first = items[0];
    const ev = isEval(first);
    const rewards = items.map(s => s.reward).filter(r => r !== null);
    const mean = ev ? (rewards.length ? rewards.reduce((a, b) => a + b, 0) / rewards.length : null) : first.group_mean;
    groupView.dataset.split = first.split;
    groupView.replaceChildren(
      el("div", { class: "group-head" }, back,
        el("h2", { text: ev ? `evaluated at step ${step} · held-out prompt ${groupIndex} · ${plural(items.length, "completion")}, ranked by reward`
          : `step ${step} · group ${groupIndex} · ${plural(items.length, "completion")}, ranked by reward` }),
        el("span", { class: "muted", text: (ev ? `mean reward ${num(mean)}` : `mean ${num(first.group_mean)} · std ${num(first.group_std)}`) + (first.dataset_row === null ? "" : ` · dataset row ${first.dataset_row}`) }),
        first.zero_std && !ev ? el("span", { class: "badge", text: "zero variance: no learning signal" }) : null),
      el("div", { class: "group-prompt" },
        el("div", { class: "thumbs" }, thumbs(first.images)), promptNode(first.prompt, first.images), columnsNode(first.columns)),
      zoomMap(first, items),
      el("div", { class: "group-completions" }, items.map((s, rank) => el("article", { class: "group-completion adv-edge-" + advClass(s.advantage), "data-id": s.id },
        el("header", {}, el("b", { text: `#${rank + 1}` }), el("span", { class: "muted", text: ` completion ${s.index}`
          + (s.completion_length === null || s.completion_length === undefined ? "" : ` · ${plural(s.completion_length, "token")}`) }),
          s.truncated ? el("span", { class: "badge", text: "truncated" }) : null),
        el("pre", { class: "completion", text: s.completion }),
        toolBadges(s), trajectoryNode(s),
        rewardList(s)))));
  }

  function closeGroup() {
    group = null;
    groupView.hidden = true;
    groupView.replaceChildren();
    tableBox.hidden = false;
    count.hidden = false;
    totalBox.hidden = false;
    more.hidden = !cursor;
    writeUrl();
  }

  // --------------------------------------------------------------------------------------------- live

  function newSteps() {
    if (evaluation()) return newestStep > loadedTop ? 1 : 0;
    return Math.floor(newestStep / samplesEvery) - Math.floor(loadedTop / samplesEvery);
  }

  // The steps with rollout rows of a split, ascending (the histogram route lists them; one bin keeps it cheap).
  async function stepsOf(split) {
    return (await api(`/runs/${runId}/histogram`, { params: { bins: 1, split } })).steps;
  }
  const last = steps => steps.length ? steps[steps.length - 1] : 0;  // the newest of them (0: none yet)

  // The newest step with rollout rows of a split (0 when none): the cheap question each event of the stream asks.
  async function topStep(split) {
    const page = await api(`/runs/${runId}/samples`, { params: { sort: "-step", limit: 1, split } });
    return page.items.length ? page.items[0].step : 0;
  }

  let checking = false, again = false;
  async function checkNewSteps() {
    if (checking) { again = true; return; }
    checking = true;
    try {
      const split = splitField.value;
      const top = await topStep(split);
      if (split !== splitField.value) return;  // the split changed meanwhile: its own check follows
      if (top > newestStep) {  // new steps with rows: the slider gains their positions
        const steps = await stepsOf(split);
        if (split !== splitField.value) return;
        setSteps(steps);
        newestStep = Math.max(top, last(steps));
      }
      const n = newSteps();
      if (n > 0) {
        // evaluations come every eval_steps steps: say which step is new rather than count training steps
        newButton.textContent = split === "eval" ? `new evaluation rollouts (step ${newestStep}): show them`
          : `${plural(n, "new step")} with rollouts: show them`;
        newBar.hidden = false;
      }
    } catch (err) {
      // a failed check is repeated at the next event of the stream
    } finally {
      checking = false;
      if (again) { again = false; checkNewSteps(); }
    }
  }

  function listen() {
    const source = new EventSource(`/api/v1/runs/${runId}/stream`);
    source.addEventListener("progress", checkNewSteps);
    source.addEventListener("metrics", checkNewSteps);
    source.addEventListener("status", e => {
      let status = null;
      try { status = JSON.parse(e.data).status; } catch (err) { status = null; }
      if (ENDED.includes(status)) { source.close(); checkNewSteps(); }
    });
    source.onerror = () => {
      source.close();
      setTimeout(async () => {
        try { if (!ENDED.includes((await api("/runs/" + runId)).status)) listen(); } catch (err) { /* the run is gone */ }
      }, 3000);
    };
  }

  // ------------------------------------------------------------------------------------------- wiring

  slider.addEventListener("input", slide);  // before the form's own listener: the step field is set when it loads
  let timer = null;
  form.addEventListener("input", e => {
    if (e.target.tagName === "SELECT") return;  // a select loads on "change", at once
    clearTimeout(timer);
    timer = setTimeout(() => load(), 250);
  });
  form.addEventListener("change", async e => {
    if (e.target.tagName !== "SELECT") return;
    clearTimeout(timer);
    if (e.target === splitField) {  // another split: its own steps, and no group view of the other one
      if (group) closeGroup();
      newBar.hidden = true;
      const split = splitField.value;
      let steps = null;
      try { steps = await stepsOf(split); } catch (err) { /* load() reports it */ }
      if (split !== splitField.value) return;
      if (steps) {
        // a step the other split has and this one has not: every step of this one, rather than an empty table
        if (stepField.value.trim() !== "" && !steps.includes(Number(stepField.value))) stepField.value = "";
        setSteps(steps);
        newestStep = last(steps);
      }
    }
    load();
  });
  form.addEventListener("submit", e => { e.preventDefault(); clearTimeout(timer); load(); });
  more.addEventListener("click", () => load(true));
  newButton.addEventListener("click", () => { if (group) closeGroup(); load(); });
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      const select = form.querySelector('[name="sort"]');
      const key = th.dataset.sort;
      const value = select.value === "-" + key ? key : "-" + key;
      if (![...select.options].some(o => o.value === value)) select.append(el("option", { value, text: value }));
      select.value = value;
      load();
    });
  }
  (async () => {
    const view = readUrl();
    let run = null;
    try {
      run = await api("/runs/" + runId);
      const steps = await stepsOf(splitField.value);
      setSteps(steps);
      newestStep = last(steps);
    } catch (err) {
      showErrors(err);
    }
    await load();
    if (view) openGroup(view.step, view.group);
    if (run && !ENDED.includes(run.status) && window.EventSource) listen();
  })();
})();
