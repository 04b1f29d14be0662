"use strict";
// Compare runs: metrics overlaid, configs side by side with differences highlighted, and the same prompt's
// rollouts from each run next to each other.
(() => {
  const { api, el, num, chart, PALETTE } = Collage;
  const ids = document.getElementById("compare").dataset.runs.split(",");
  for (const s of document.querySelectorAll(".swatch")) s.style.background = PALETTE[Number(s.dataset.index) % PALETTE.length];

  function flat(obj, prefix = "") {
    return Object.entries(obj || {}).flatMap(([k, v]) => v && typeof v === "object" && !Array.isArray(v) ? flat(v, prefix + k + ".") : [[prefix + k, v]]);
  }

  async function sideBySide(runs) {
    const stepSel = document.getElementById("prompt-step"), rowSel = document.getElementById("prompt-row");
    const box = document.getElementById("side-by-side");
    const show = async () => {
      const cols = await Promise.all(runs.map(r => api(`/runs/${r.id}/samples`, { params: { step: stepSel.value, limit: 200 } })));
      const row = Number(rowSel.value);
      box.replaceChildren(...runs.map((r, i) => {
        const samples = cols[i].items.filter(s => s.dataset_row === row);
        return el("div", { class: "column" }, el("h3", { text: r.name }),
          samples.length ? null : el("p", { class: "muted", text: "no completion of this prompt at this step" }),
          samples[0] ? el("div", { class: "thumbs" }, samples[0].images.map(im => el("img", { src: im.thumb_url, class: "thumb", alt: "image" }))) : null,
          samples.map(s => el("div", { class: "cmp-sample" }, el("pre", { class: "completion", text: s.completion }),
            el("small", { text: `reward ${num(s.reward)} · advantage ${num(s.advantage)}` }))));
      }));
    };
    const first = await Promise.all(runs.map(r => api(`/runs/${r.id}/samples`, { params: { limit: 500 } })));
    const steps = [...new Set(first.flatMap(p => p.items.map(s => s.step)))].sort((a, b) => a - b);
    stepSel.replaceChildren(...steps.map(s => el("option", { value: s, text: s })));
    const refreshRows = async () => {
      const page = await api(`/runs/${runs[0].id}/samples`, { params: { step: stepSel.value, limit: 200 } });
      const rows = [...new Set(page.items.map(s => s.dataset_row))];
      rowSel.replaceChildren(...rows.map(r => el("option", { value: r, text: r })));
      await show();
    };
    stepSel.onchange = refreshRows; rowSel.onchange = show;
    if (steps.length) await refreshRows();
  }

  (async () => {
    const runs = await Promise.all(ids.map(id => api("/runs/" + id)));
    const metrics = await Promise.all(ids.map(id => api(`/runs/${id}/metrics`, { params: { max_points: 500 } })));
    const keys = [...new Set(metrics.flatMap(m => Object.keys(m)))].filter(k => !k.startsWith("timing/") && k !== "num_tokens").sort();
    const box = document.getElementById("charts");
    for (const key of ["reward", ...keys.filter(k => k !== "reward")]) {
      if (!keys.includes(key)) continue;
      chart(box, key, runs.map((r, i) => ({ label: r.name, points: metrics[i][key] || [] })));
    }
    const configs = runs.map(r => Object.fromEntries(flat(r.config)));
    const allKeys = [...new Set(configs.flatMap(c => Object.keys(c)))].sort();
    const table = document.getElementById("config-diff");
    table.append(el("tr", {}, el("th", { text: "key" }), runs.map(r => el("th", { text: r.name }))));
    for (const key of allKeys) {
      const values = configs.map(c => JSON.stringify(c[key] ?? null));
      const differs = new Set(values).size > 1;
      table.append(el("tr", { class: differs ? "differs" : "" }, el("td", { text: key }), values.map(v => el("td", { text: v }))));
    }
    await sideBySide(runs);
  })();
})();
