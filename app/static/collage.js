// Shared helpers of the Collage pages. Everything from the server or a model is inserted as text
// (textContent / attribute values), never as HTML: prompts and completions are untrusted.
"use strict";

const Collage = (() => {
  const csrf = () => document.querySelector('meta[name="csrf-token"]').content;

  async function api(path, { method = "GET", body, params } = {}) {
    const url = new URL("/api/v1" + path, location.origin);
    for (const [k, v] of Object.entries(params || {})) {
      if (v !== undefined && v !== null && v !== "") url.searchParams.set(k, v);
    }
    const headers = { Accept: "application/json" };
    if (method !== "GET") headers["X-CSRF-Token"] = csrf();
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(url, {
      method, headers, credentials: "same-origin",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
    if (response.status === 401) { location.href = "/login?next=" + encodeURIComponent(location.pathname + location.search); }
    const text = await response.text();
    const data = text ? JSON.parse(text) : null;
    if (!response.ok) { const err = new Error("HTTP " + response.status); err.status = response.status; err.body = data; throw err; }
    return data;
  }

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === undefined || v === null || v === false) continue;
      if (k === "class") node.className = v;
      else if (k === "text") node.textContent = v;
      else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v === true ? "" : v);
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  // A prompt (a string, or chat messages whose content is text and image parts) as text, each image's position
  // marked where its placeholder stands ("[image 2]", its size in the title). Untrusted: text nodes only.
  function promptNode(prompt, images = []) {
    let k = 0;
    const out = el("div", { class: "prompt" });
    const messages = typeof prompt === "string" ? [{ role: "user", content: prompt }] : Array.isArray(prompt) ? prompt : [{ role: "?", content: JSON.stringify(prompt) }];
    for (const m of messages) {
      const line = el("div", {}, el("b", { text: (m?.role ?? "?") + ": " }));
      const content = m?.content;
      const parts = typeof content === "string" ? [{ type: "text", text: content }] : Array.isArray(content) ? content : [{ type: "text", text: JSON.stringify(content ?? "") }];
      for (const part of parts) {
        if (part?.type === "image") {
          k += 1;
          const image = images[k - 1];
          line.append(el("span", { class: "image-marker", text: `[image ${k}]`, title: image ? `${image.width}x${image.height}` : "" }));
        } else line.append(document.createTextNode(typeof part?.text === "string" ? part.text : ""));
      }
      out.append(line);
    }
    return out;
  }

  const num = (x, digits = 3) => (x === null || x === undefined || Number.isNaN(x)) ? "–" : Number(x).toFixed(digits);

  function when(iso) {
    if (!iso) return "–";
    const d = new Date(iso);
    return d.toLocaleString(undefined, { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit" });
  }

  function duration(seconds) {
    if (!Number.isFinite(seconds) || seconds < 0) return "–";
    if (seconds < 90) return Math.round(seconds) + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }

  // The time left of a running run, from its current attempt's recent step time (the training process measures it:
  // a resumed run's earlier attempt, or its first slow steps, never skew it); "estimating" until the attempt has
  // finished a step, null when the run is not training.
  function timeLeft(run) {
    const { step, max_steps } = run.progress;
    if (step >= max_steps || !["running", "cancelling"].includes(run.status)) return null;
    if (run.seconds_per_step === null || run.seconds_per_step === undefined) return "estimating";
    return run.seconds_per_step * (max_steps - step);
  }

  // "· 3 min left", "· estimating time left", or "" (see timeLeft)
  function leftText(run) {
    const left = timeLeft(run);
    if (left === null) return "";
    return left === "estimating" ? " · estimating time left" : ` · ${duration(left)} left`;
  }

  function sparkline(points, width = 90, height = 22) {
    const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
    svg.setAttribute("width", width); svg.setAttribute("height", height); svg.setAttribute("class", "spark");
    const values = points.map(p => p[1]).filter(v => v !== null);
    if (values.length < 2) return svg;
    const lo = Math.min(...values), hi = Math.max(...values), span = hi - lo || 1;
    const x0 = points[0][0], xs = (points[points.length - 1][0] - x0) || 1;
    const path = points.filter(p => p[1] !== null)
      .map(p => `${((p[0] - x0) / xs * (width - 2) + 1).toFixed(1)},${(height - 1 - (p[1] - lo) / span * (height - 2)).toFixed(1)}`)
      .join(" ");
    const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
    line.setAttribute("points", path);
    svg.append(line);
    return svg;
  }

  function toYaml(value, indent = "") {
    if (value === null || value === undefined) return "null";
    if (Array.isArray(value)) {
      if (!value.length) return "[]";
      if (value.every(v => typeof v !== "object" || v === null)) return "[" + value.map(v => toYaml(v)).join(", ") + "]";
      return value.map(v => "\n" + indent + "- " + toYaml(v, indent + "  ").replace(/^\n\s*/, "")).join("");
    }
    if (typeof value === "object") {
      const keys = Object.keys(value);
      if (!keys.length) return "{}";
      return keys.map(k => {
        const v = value[k];
        const rendered = toYaml(v, indent + "  ");
        const block = typeof v === "object" && v !== null && Object.keys(v).length && !rendered.startsWith("[");
        return "\n" + indent + k + ":" + (block ? rendered : " " + rendered);
      }).join("");
    }
    // quoted when bare it would read as another type: YAML 1.1 (PyYAML) also takes yes/no/on/off/y/n for booleans
    // (eval_strategy: "no")
    if (typeof value === "string") return /^[\w.:\/-]+$/.test(value) && !/^(true|false|null|yes|no|on|off|y|n|[\d.e+-]+)$/i.test(value) ? value : JSON.stringify(value);
    return String(value);
  }

  function modal(content) {
    const box = document.getElementById("modal");
    const body = box.querySelector(".modal-content");
    body.replaceChildren(content);
    box.hidden = false;
    // keyboard users land on the close button, and go back where they were when it closes
    const before = document.activeElement;
    box.querySelector(".close").focus();
    const close = () => {
      box.hidden = true; body.replaceChildren();
      if (before && before.isConnected && typeof before.focus === "function") before.focus();
    };
    box.querySelector(".close").onclick = close;
    box.onclick = e => { if (e.target === box) close(); };
    document.addEventListener("keydown", function esc(e) { if (e.key === "Escape") { close(); document.removeEventListener("keydown", esc); } });
  }

  // Light-scheme series colours, kept for old callers; seriesColor(i) follows the theme (--series-1..8).
  const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#be185d", "#4d7c0f"];

  // The value of a theme variable of collage.css (e.g. cssVar("--chart-axis")), as the current scheme has it.
  function cssVar(name, fallback = "") {
    const value = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
    return value || fallback;
  }
  const seriesColor = i => cssVar(`--series-${(i % PALETTE.length) + 1}`, PALETTE[i % PALETTE.length]);
  const scheme = () => document.documentElement.dataset.scheme || "light";

  // uPlot draws on canvases: its colours are functions of the theme, re-read at each draw; a theme change
  // (`collage:theme`, fired by theme.js) redraws every chart still on the page.
  const plots = new Set();
  document.addEventListener("collage:theme", () => {
    for (const plot of [...plots]) {
      if (!plot.root.isConnected) { plots.delete(plot); continue; }
      plot.redraw(false, true);
    }
  });
  function themed(plot) { plots.add(plot); return plot; }
  const axisColors = () => ({
    stroke: () => cssVar("--chart-axis"),
    grid: { stroke: () => cssVar("--chart-grid"), width: 1 },
    ticks: { stroke: () => cssVar("--chart-grid"), width: 1 },
  });

  // One small line chart per metric; `series` is [{label, points: [[step, value], ...]}].
  function chart(container, title, series) {
    const steps = [...new Set(series.flatMap(s => s.points.map(p => p[0])))].sort((a, b) => a - b);
    const index = new Map(steps.map((s, i) => [s, i]));
    const data = [steps, ...series.map(s => {
      const ys = new Array(steps.length).fill(null);
      for (const [x, y] of s.points) ys[index.get(x)] = y;
      return ys;
    })];
    const box = el("div", { class: "chart", "data-metric": title }, el("h3", { text: title }));
    container.append(box);
    const opts = {
      width: Math.max(280, Math.min(420, container.clientWidth / 2 - 24)), height: 170,
      legend: { show: series.length > 1 }, cursor: { drag: { x: true, y: false } },
      scales: { x: { time: false } },
      series: [{ label: "step" }, ...series.map((s, i) => ({ label: s.label, stroke: () => seriesColor(i), width: 1.5, spanGaps: true }))],
      axes: [{ size: 30, ...axisColors() }, { size: 56, ...axisColors(), values: (u, vals) => vals.map(v => v === null ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-2) ? v.toExponential(1) : +v.toPrecision(3)) }],
    };
    const plot = themed(new uPlot(opts, data, box));
    return { plot, series, box };
  }

  function appendPoint(handle, step, value, seriesIndex = 0) {
    const [xs, ...ys] = handle.plot.data;
    const x = [...xs], y = ys.map(c => [...c]);
    let i = x.indexOf(step);
    if (i === -1) { x.push(step); y.forEach(c => c.push(null)); i = x.length - 1; }
    y[seriesIndex][i] = value;
    handle.plot.setData([x, ...y]);
  }

  return {
    api, el, num, when, duration, timeLeft, leftText, sparkline, toYaml, modal, chart, appendPoint, PALETTE, promptNode,
    cssVar, seriesColor, scheme, themed, axisColors,
  };
})();
