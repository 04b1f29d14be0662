"use strict";
// The rollout table: server-side filters, sorts and paging; rows grouped by prompt group with the group's
// mean/std and zero-variance flag; images as thumbnails (click to enlarge); untrusted text shown as text.
(() => {
  const { api, el, num } = Collage;
  const root = document.getElementById("rollouts");
  const runId = root.dataset.run;
  const rewardNames = root.dataset.rewards ? root.dataset.rewards.split(",") : [];
  const form = document.getElementById("sample-filters");
  const body = document.getElementById("samples-body");
  const more = document.getElementById("more");
  const slider = form.querySelector('[name="step_slider"]');
  let cursor = null, shown = 0, lastGroup = null;

  function params() {
    const p = Object.fromEntries([...new FormData(form)].filter(([k]) => k !== "step_slider"));
    if (Number(slider.value) > 0) p.step = slider.value;
    return p;
  }

  function promptNode(prompt, images) {
    // the prompt as text, with each image's position marked where its placeholder stands
    let k = 0;
    const out = el("div", { class: "prompt" });
    const messages = typeof prompt === "string" ? [{ role: "user", content: prompt }] : prompt;
    for (const m of messages) {
      const line = el("div", {}, el("b", { text: m.role + ": " }));
      const parts = typeof m.content === "string" ? [{ type: "text", text: m.content }] : m.content;
      for (const part of parts) {
        if (part.type === "image") line.append(el("span", { class: "image-marker", text: `[image ${++k}]`, title: images[k - 1] ? `${images[k - 1].width}x${images[k - 1].height}` : "" }));
        else line.append(document.createTextNode(part.text || ""));
      }
      out.append(line);
    }
    return out;
  }

  function enlarge(image) {
    Collage.modal(el("figure", {}, el("img", { src: image.url, alt: "image " + image.sha256, class: "full" }), el("figcaption", { text: `${image.width}x${image.height} · ${image.sha256.slice(0, 12)}…` })));
  }

  function groupRow(s) {
    const cols = 6 + rewardNames.length;
    return el("tr", { class: "group" + (s.zero_std ? " zero-std" : "") }, el("td", { colspan: cols },
      `step ${s.step} · group ${s.group} · mean ${num(s.group_mean)} · std ${num(s.group_std)}`,
      s.zero_std ? el("span", { class: "badge", text: "zero variance: no learning signal" }) : null));
  }

  function sampleRow(s) {
    const adv = s.advantage > 0 ? "pos" : s.advantage < 0 ? "neg" : "zero";
    return el("tr", { class: "sample", "data-id": s.id },
      el("td", { text: `${s.step}·${s.group}·${s.index}` }),
      el("td", { class: "thumbs" }, s.images.map((im, i) => el("img", { src: im.thumb_url, alt: `image ${i + 1}`, class: "thumb", onclick: () => enlarge(im) }))),
      el("td", {}, promptNode(s.prompt, s.images)),
      el("td", {}, el("pre", { class: "completion", text: s.completion }), s.truncated ? el("span", { class: "badge", text: "truncated" }) : null, el("small", { class: "muted", text: ` ${s.completion_length} tokens` })),
      rewardNames.map(n => el("td", { class: "num", text: num(s.rewards[n]) })),
      el("td", { class: "num", text: num(s.reward) }),
      el("td", { class: "num adv-" + adv, text: num(s.advantage) }));
  }

  async function load(append = false) {
    if (!append) { cursor = null; shown = 0; lastGroup = null; body.replaceChildren(); }
    const page = await api(`/runs/${runId}/samples`, { params: { ...params(), limit: 100, cursor: append ? cursor : undefined } });
    cursor = page.next_cursor;
    more.hidden = !cursor;
    const grouped = (params().sort || "step").replace("-", "") === "step";
    for (const s of page.items) {
      const key = `${s.step}:${s.group}`;
      if (grouped && key !== lastGroup) body.append(groupRow(s));
      lastGroup = key;
      body.append(sampleRow(s));
    }
    shown += page.items.length;
    document.getElementById("count").textContent = `${shown} rows shown` + (cursor ? " (more on the server)" : "");
  }

  slider.addEventListener("input", () => { document.getElementById("step-out").textContent = Number(slider.value) > 0 ? slider.value : "all"; });
  let timer = null;
  form.addEventListener("input", () => { clearTimeout(timer); timer = setTimeout(() => load(), 250); });
  form.addEventListener("submit", e => e.preventDefault());
  more.addEventListener("click", () => load(true));
  for (const th of document.querySelectorAll("th[data-sort]")) {
    th.addEventListener("click", () => {
      const select = form.querySelector('[name="sort"]');
      const key = th.dataset.sort;
      select.value = select.value === "-" + key ? key : "-" + key;
      if (![...select.options].some(o => o.value === select.value)) select.append(el("option", { value: select.value, text: select.value }));
      select.value = select.value;
      load();
    });
  }
  (async () => {
    const run = await api("/runs/" + runId);
    slider.max = run.progress.step;
    load();
  })();
})();
