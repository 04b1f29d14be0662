"use strict";
// Charts of the run and compare pages, on uPlot: a legend with the step and every series' value under the cursor,
// EMA smoothing (the smoothed line bold, the raw line faint), a log-scale toggle per chart (refused, with the
// reason, while a series has a value <= 0), integer step ticks (a lone step: the steps around it), nice y ticks
// labelled as precisely as their step needs, a sensible y range for flat series, live updates batched per chart
// that keep a drag-zoom until the reader resets it, and a per-step histogram of a rollout column. Text from the
// server goes in as textContent.
const CollageCharts = (() => {
  const { api, el, PALETTE } = Collage;
  const SVG = "http://www.w3.org/2000/svg";
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 2500, 5000, 10000, 20000, 25000, 50000,
    100000, 200000, 250000, 500000, 1000000, 2000000, 5000000, 10000000];
  const registry = [];
  let smoothing = 0;

  // A value for the legend: six significant digits, exponents for very large or small magnitudes.
  function fmt(v) {
    if (v === null || v === undefined || Number.isNaN(v)) return "–";
    if (v !== 0 && (Math.abs(v) >= 1e6 || Math.abs(v) < 1e-4)) return v.toExponential(4);
    return String(Number(v.toPrecision(6)));
  }
  // A log axis's label (its ticks are 1..9 x 10^k: three significant digits tell them apart).
  const tick = v => v === null ? "" : Math.abs(v) >= 1e4 || (v !== 0 && Math.abs(v) < 1e-2) ? v.toExponential(1) : String(+v.toPrecision(3));

  // The ticks of a linear y axis between min and max: about `count` of them, a "nice" step apart (1, 2 or 5 x
  // 10^k), each a whole multiple of the step (so 6.7310, 6.7312, ... for a series that moves in the fourth decimal).
  function ticks(min, max, count = 5) {
    if (!Number.isFinite(min) || !Number.isFinite(max) || max < min) return [];
    if (max === min) return [min];
    const raw = (max - min) / Math.max(1, count);
    let exp = Math.floor(Math.log10(raw));
    const f = raw / Math.pow(10, exp);
    let m = f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10;
    if (m === 10) { m = 1; exp += 1; }
    const step = Number(`${m}e${exp}`), decimals = Math.min(100, Math.max(0, -exp));
    const first = Math.ceil(min / step - 1e-9), last = Math.floor(max / step + 1e-9), out = [];
    for (let k = first; k <= last && out.length < 1000; k++) {
      const v = Number((k * step).toFixed(decimals));
      if (out[out.length - 1] !== v) out.push(v);
    }
    return out;
  }

  // Labels of a linear axis's ticks: every tick with the same number of decimals, as many as it takes to write
  // each tick exactly and no more (6.7310, 6.7312 for ticks 0.0002 apart; 0, 20, 40 for ticks 20 apart), so that
  // distinct ticks never read the same; exponents (1.2e6, 5e-4) for magnitudes >= 1e6 or < 1e-3.
  function tickLabels(values) {
    const vs = values.filter(v => v !== null && Number.isFinite(v));
    if (!vs.length) return values.map(() => "");
    const maxAbs = Math.max(...vs.map(Math.abs));
    let step = Infinity;
    for (let i = 1; i < vs.length; i++) { const d = Math.abs(vs[i] - vs[i - 1]); if (d > 0 && d < step) step = d; }
    if (!Number.isFinite(step)) step = maxAbs || 1;  // a single tick: its own magnitude
    // p: the last decimal place any tick needs (-4: the fourth decimal), from the step's own place downwards
    const exact = q => vs.every(v => Math.abs(Math.round(v / Math.pow(10, q)) * Math.pow(10, q) - v) <= step * 1e-6);
    let p = Math.floor(Math.log10(step)) + 1;  // one place up: a step of 0.001 may be computed as 0.000999...
    for (let n = 0; n < 24 && !exact(p); n++) p -= 1;
    const sci = maxAbs >= 1e6 || maxAbs < 1e-3;
    return values.map(v => {
      if (v === null || !Number.isFinite(v)) return "";
      if (!sci) return v.toFixed(Math.min(100, Math.max(0, -p)));
      if (v === 0) return "0";
      return v.toExponential(Math.min(100, Math.max(0, Math.floor(Math.log10(Math.abs(v))) - p))).replace("e+", "e");
    });
  }

  // The x range of a chart's steps xs (ascending): every step; one step alone (a single evaluation, or every
  // series at the same step) gets a step on each side of it, so that its axis shows steps around it, not 0..100.
  function xRange(xs, min, max) {
    const known = (xs || []).filter(x => x !== null && Number.isFinite(x));
    if (known.length && known[0] === known[known.length - 1]) return [known[0] - 1, known[0] + 1];
    if (!Number.isFinite(min) || !Number.isFinite(max)) return [0, 1];
    return min === max ? [min - 1, max + 1] : [min, max];
  }

  // TensorBoard's / W&B's exponential moving average, debiased so the first points are not pulled towards 0.
  // Gaps (null) stay gaps and do not advance the average.
  function ema(values, alpha) {
    if (!(alpha > 0)) return values.slice();
    let last = 0, n = 0;
    return values.map(v => {
      if (v === null || v === undefined || !Number.isFinite(v)) return null;
      last = last * alpha + (1 - alpha) * v;
      n += 1;
      return last / (1 - Math.pow(alpha, n));
    });
  }

  // The y range drawn for data between min and max: a flat series gets a band around its value (a constant 0:
  // [-1, 1]; a constant c: c ± max(|c|·10%, 1e-3)); otherwise 8% padding, not crossing 0 for one-signed data.
  // On a log scale: whole decades around the data.
  function yRange(min, max, log = false) {
    if (min === null || max === null || !Number.isFinite(min) || !Number.isFinite(max)) return log ? [0.1, 10] : [-1, 1];
    if (log) {
      let lo = Math.pow(10, Math.floor(Math.log10(min))), hi = Math.pow(10, Math.ceil(Math.log10(max)));
      if (lo === hi) { lo /= 10; hi *= 10; }
      return [lo, hi];
    }
    // values that differ only by rounding (0.30000000000000004 and 0.3) are flat: a range below the float
    // resolution would have no representable ticks
    if (max - min <= 1e-9 * Math.max(Math.abs(min), Math.abs(max))) {
      min = max = (min + max) / 2;
      if (min === 0) return [-1, 1];
      const d = Math.max(Math.abs(min) * 0.1, 1e-3);
      return [min - d, max + d];
    }
    const pad = (max - min) * 0.08;
    let lo = min - pad, hi = max + pad;
    if (min >= 0 && lo < 0) lo = 0;
    if (max <= 0 && hi > 0) hi = 0;
    return [lo, hi];
  }

  const css = name => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  // A series colour: an index into the theme's --series-1..8 (collage.css), or a CSS colour as is.
  const colour = c => typeof c === "number" ? css(`--series-${(c % PALETTE.length) + 1}`) || PALETTE[c % PALETTE.length] : c;
  function faint(color) {
    const m = /^#([0-9a-f]{6})$/i.exec(color);
    if (!m) return color;
    const n = parseInt(m[1], 16);
    return `rgba(${n >> 16}, ${(n >> 8) & 255}, ${n & 255}, 0.28)`;
  }

  let flushTimer = null;
  const dirty = new Set();
  function schedule(chart) {
    dirty.add(chart);
    if (flushTimer === null) flushTimer = setTimeout(() => { flushTimer = null; for (const c of dirty) c.update(); dirty.clear(); }, 80);
  }

  // One chart. `series`: [{label, key, run, scale, color, dash, faint, markers, points: [[step, value], ...]}];
  // `key` and `run` say which metric of which run feeds the series live (see ingest), `scale` multiplies it
  // (weighted rewards), `faint` draws it thin and pale (a reference: training beside evaluation), `markers` marks
  // each of its points (a metric logged at some steps only, as evaluations are; the line joins them).
  class Chart {
    constructor(container, { key, title, series, before = null }) {
      this.key = key;
      this.series = series.map((s, i) => ({ scale: 1, color: i, ...s, values: new Map() }));
      for (const s of this.series) for (const [x, y] of s.points || []) s.values.set(x, y === null ? null : y * s.scale);
      this.log = false;
      this.zoom = null;  // [min, max] steps the reader dragged to; kept through live updates until reset
      this.logBox = el("input", { type: "checkbox", class: "log-input" });
      this.logLabel = el("label", { class: "log-toggle" }, this.logBox, " log");
      this.resetButton = el("button", { type: "button", class: "link zoom-reset", hidden: true, title: "show every step (or double-click the chart)", text: "reset zoom" });
      this.note = el("small", { class: "chart-note", hidden: true });
      this.host = el("div", { class: "chart-plot" });
      this.box = el("div", { class: "chart", "data-metric": key },
        el("div", { class: "chart-head" }, el("h3", { text: title || key }), el("span", { class: "chart-tools" }, this.resetButton, this.logLabel)), this.host, this.note);
      this.box.chart = this;
      this.resetButton.addEventListener("click", () => this.resetZoom());
      this.logBox.addEventListener("change", () => this.setLog(this.logBox.checked));
      this.logLabel.addEventListener("click", () => { if (this.logBox.disabled) this.explain(); });
      container.insertBefore(this.box, before);
      this.width = Math.max(280, Math.min(420, container.clientWidth / 2 - 24));
      registry.push(this);
      this.build();
    }

    // Another series at position `at` (default: last), drawn at once (the evaluation's per-image-count chart
    // gains one, in count order, when a new count appears).
    addSeries(series, at = this.series.length) {
      const s = { scale: 1, color: this.series.length, ...series, values: new Map() };
      for (const [x, y] of series.points || []) s.values.set(x, y === null ? null : y * s.scale);
      this.series.splice(at, 0, s);
      this.build();
      return at;
    }

    steps() { return [...new Set(this.series.flatMap(s => [...s.values.keys()]))].sort((a, b) => a - b); }

    data() {
      const xs = this.steps();
      const cols = [xs];
      for (const s of this.series) {
        const raw = xs.map(x => s.values.has(x) ? s.values.get(x) : null);
        if (smoothing > 0) cols.push(raw, ema(raw, smoothing));
        else cols.push(raw);
      }
      return cols;
    }

    // The lowest value of any series, and whether a log scale can show them all.
    lowest() {
      let low = Infinity;
      for (const s of this.series) for (const v of s.values.values()) if (v !== null && Number.isFinite(v) && v < low) low = v;
      return low;
    }
    logReason() {
      const low = this.lowest();
      return low <= 0 ? `A log scale needs every value > 0: this chart has ${fmt(low)}.` : null;
    }
    explain() {
      this.note.textContent = this.logReason() || "";
      this.note.hidden = !this.note.textContent;
    }
    refreshLogToggle() {
      const reason = this.logReason();
      this.logBox.disabled = reason !== null;
      this.logLabel.classList.toggle("disabled", reason !== null);
      this.logLabel.title = reason || "y axis on a log scale";
      if (reason !== null && this.log) {  // a value <= 0 arrived: back to linear, and say why
        this.log = false;
        this.logBox.checked = false;
        this.explain();
        return true;
      }
      if (reason === null) this.note.hidden = true;
      return false;
    }
    setLog(on) {
      if (on && this.logReason() !== null) { this.logBox.checked = false; this.explain(); return; }
      this.log = on;
      this.logBox.checked = on;
      this.box.dataset.log = on ? "1" : "0";
      this.build();
    }

    build() {
      this.refreshLogToggle();
      this.box.dataset.log = this.log ? "1" : "0";
      if (this.plot) this.plot.destroy();
      // colours are functions of the theme, read at each draw: a theme change only redraws
      const fg = () => css("--chart-axis") || css("--fg") || "#4b5563", line = () => css("--chart-grid") || css("--line") || "#e5e7eb";
      const uSeries = [{ label: "step", value: (u, v) => v === null ? "–" : String(v) }];
      for (const s of this.series) {
        const base = { spanGaps: true, dash: s.dash, value: (u, v) => fmt(v) };
        const stroke = s.faint ? () => faint(colour(s.color)) : () => colour(s.color);
        // markers: every real point as a dot (on the raw values when smoothing draws a second line)
        const marks = s.markers ? { points: { show: true, size: 7, width: 1.5, stroke, fill: stroke } } : {};
        if (smoothing > 0) {
          uSeries.push({ ...base, label: s.label + " (raw)", stroke: () => faint(stroke()), width: 1, points: { show: false }, ...marks });
          uSeries.push({ ...base, label: s.label, stroke, width: s.faint ? 1.25 : 2.25, ...(s.markers ? { points: { show: false } } : {}) });
        } else {
          uSeries.push({ ...base, label: s.label, stroke, width: s.faint ? 1 : 1.5, ...marks });
        }
      }
      const box = this.box, log = this.log;
      const axis = { stroke: fg, grid: { stroke: line, width: 1 }, ticks: { stroke: line, width: 1 } };
      const opts = {
        width: this.width, height: 170,
        legend: { show: true, live: true },
        cursor: { drag: { x: true, y: false } },
        scales: {
          // uPlot widens a lone x value to a range of its own (20 → 0..40) before asking: the data decides
          x: { time: false, range: (u, min, max) => xRange(u.data && u.data[0], min, max) },
          y: { distr: log ? 3 : 1, log: 10, range: (u, min, max) => yRange(min, max, log) },
        },
        series: uSeries,
        axes: [
          { ...axis, size: 30, space: 40, incrs: STEP_INCRS,
            values: (u, splits) => {
              const labels = splits.map(v => Number.isInteger(v) && v >= 0 ? String(v) : "");
              box.dataset.xticks = labels.filter(Boolean).join(",");
              return labels;
            } },
          { ...axis, space: 30,
            // linear: nice ticks, labelled as precisely as their step needs (see ticks, tickLabels)
            ...(log ? {} : { splits: (u, i, min, max) => ticks(min, max, Math.max(2, Math.round(u.bbox.height / uPlot.pxRatio / 34))) }),
            size: (u, values) => values && values.length ? Math.max(40, Math.ceil(Math.max(...values.map(v => String(v).length)) * 6.6) + 18) : 56,
            values: (u, vals) => {
              const labels = log ? vals.map(tick) : tickLabels(vals);
              box.dataset.yticks = labels.filter(Boolean).join(",");
              return labels;
            } },
        ],
        hooks: {
          setScale: [(u, key) => {
            if (key === "y") box.dataset.yrange = `${u.scales.y.min},${u.scales.y.max}`;
            if (key === "x") this.noteZoom(u);
          }],
        },
      };
      const zoom = this.zoom;
      this.plot = new uPlot(opts, this.data(), this.host);
      this.built = smoothing;
      if (zoom) this.applyZoom(zoom);  // a rebuild (log scale, smoothing) keeps the reader's zoom
    }

    // The x range shown is a zoom when it leaves out steps the chart has (a drag selects one; uPlot's double-click
    // and the reset button show every step again).
    noteZoom(u) {
      const xs = u.data[0];
      const { min, max } = u.scales.x;
      const zoomed = xs.length > 1 && min !== null && max !== null && (min > xs[0] || max < xs[xs.length - 1]);
      this.zoom = zoomed ? [min, max] : null;
      this.box.dataset.zoom = zoomed ? `${min},${max}` : "";
      this.resetButton.hidden = !zoomed;
    }
    applyZoom([min, max]) { this.plot.setScale("x", { min, max }); }
    resetZoom() {
      this.zoom = null;
      if (this.plot) this.plot.setData(this.data());  // every step, the scales fitted to them
    }

    // New points: drawn without touching a zoom (setData would fit the scales to every step again)
    update() {
      if (this.refreshLogToggle() || this.built !== smoothing || !this.plot) return this.build();
      const zoom = this.zoom;
      this.plot.setData(this.data(), !zoom);
      if (zoom) this.applyZoom(zoom);
    }

    set(seriesIndex, step, value) {
      const s = this.series[seriesIndex];
      s.values.set(step, value === null || value === undefined ? null : value * s.scale);
      schedule(this);
    }
    setPoints(seriesIndex, points) {
      const s = this.series[seriesIndex];
      for (const [x, y] of points) s.values.set(x, y === null ? null : y * s.scale);
      schedule(this);
    }
  }

  // New values of a run's metrics at a step: every chart series fed by (run, key) gets its point. Returns the
  // keys no chart shows yet (the page decides whether to make a chart for them).
  function ingest(run, step, values) {
    const unseen = new Set(Object.keys(values));
    for (const chart of registry) {
      chart.series.forEach((s, i) => {
        if (s.run !== run || !(s.key in values)) return;
        chart.set(i, step, values[s.key]);
        if (s.scale === 1) unseen.delete(s.key);
      });
    }
    return [...unseen];
  }

  function setSmoothing(alpha) {
    smoothing = Math.min(0.99, Math.max(0, Number(alpha) || 0));
    for (const c of registry) c.build();
  }

  // The page's smoothing slider (0..0.99), remembered in this browser.
  function bindSmoothing(input, output) {
    const saved = Number(localStorage.getItem("collage.smoothing"));
    if (saved > 0 && saved <= 0.99) { input.value = saved; smoothing = saved; }
    const show = () => { output.textContent = Number(input.value).toFixed(2); };
    show();
    let timer = null;  // dragging the slider redraws once it rests, not at every tick
    input.addEventListener("input", () => {
      show();
      localStorage.setItem("collage.smoothing", input.value);
      clearTimeout(timer);
      timer = setTimeout(() => setSmoothing(input.value), 120);
    });
  }

  // The charts' colours come from the theme (collage.css): redrawn when it changes (theme.js fires collage:theme;
  // the system's scheme can change too).
  const redrawAll = () => { for (const c of registry) if (c.plot) c.plot.redraw(false, true); };
  document.addEventListener("collage:theme", redrawAll);
  matchMedia("(prefers-color-scheme: dark)").addEventListener("change", redrawAll);

  // A SSE payload as JSON; Python writes NaN and Infinity, which JSON.parse refuses: they become null.
  function parseEvent(text) {
    return JSON.parse(text.replace(/(?<=[:\[,]\s*)(-?Infinity|NaN)(?=\s*[,}\]])/g, "null"));
  }

  // A per-step histogram of a rollout column (GET /runs/{id}/histogram), with a step picker: "latest" follows
  // the newest step with rollout rows as the run goes on.
  class Histogram {
    constructor(container, runId, { field = "completion_length", title = "Completion length", bins = 20 } = {}) {
      this.runId = runId; this.field = field; this.bins = bins;
      this.select = el("select", { class: "hist-step", "aria-label": "step" }, el("option", { value: "", text: "latest" }));
      this.summary = el("small", { class: "muted hist-summary" });
      this.svg = document.createElementNS(SVG, "svg");
      this.svg.setAttribute("class", "hist-svg");
      this.box = el("div", { class: "chart histogram", "data-field": field },
        el("div", { class: "chart-head" }, el("h3", { text: `${title} per step` }), el("label", {}, "step ", this.select)),
        this.svg, this.summary);
      this.box.histogram = this;
      container.append(this.box);
      this.width = Math.max(280, Math.min(420, container.clientWidth / 2 - 24));
      this.steps = [];
      this.select.addEventListener("change", () => this.load());
    }

    async load() {
      const step = this.select.value;
      const h = await api(`/runs/${this.runId}/histogram`, { params: { field: this.field, bins: this.bins, step } });
      this.setSteps(h.steps);
      if (this.select.value !== step) return;  // the picker changed while loading
      this.draw(h);
    }

    setSteps(steps) {
      if (steps.length === this.steps.length && steps.every((s, i) => s === this.steps[i])) return;
      this.steps = steps;
      const chosen = this.select.value;
      this.select.replaceChildren(el("option", { value: "", text: steps.length ? `latest (${steps[steps.length - 1]})` : "latest" }),
        ...steps.map(s => el("option", { value: s, text: s })));
      this.select.value = steps.includes(Number(chosen)) ? chosen : "";
    }

    // Called when the run has a new step: reloads only when following the latest step.
    refresh() { if (this.select.value === "") return this.load(); return api(`/runs/${this.runId}/histogram`, { params: { field: this.field, bins: 1 } }).then(h => this.setSteps(h.steps)); }

    draw(h) {
      const W = this.width, H = 150, left = 34, bottom = 20, top = 8;
      const svg = this.svg;
      svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
      svg.replaceChildren();
      this.box.dataset.step = h.step ?? "";
      this.box.dataset.total = h.total;
      const add = (tag, attrs, text) => {
        const node = document.createElementNS(SVG, tag);
        for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
        if (text !== undefined) node.textContent = text;
        svg.append(node);
        return node;
      };
      if (!h.counts.length) {
        add("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "hist-empty" }, h.step === null ? "no rollouts yet" : "no values at this step");
        this.summary.textContent = "";
        return;
      }
      const peak = Math.max(...h.counts), n = h.counts.length, bw = (W - left - 4) / n, ph = H - top - bottom;
      const integer = ["completion_length", "num_images"].includes(this.field);
      const binLabel = i => {
        const lo = h.edges[i], hi = h.edges[i + 1];
        if (integer) return hi - lo === 1 ? String(lo) : `${lo}–${hi - 1}`;
        return `${fmt(lo)} – ${fmt(hi)}`;
      };
      add("line", { x1: left, y1: top + ph, x2: W - 4, y2: top + ph, class: "hist-axis" });
      add("text", { x: left - 4, y: top + 8, "text-anchor": "end", class: "hist-tick" }, String(peak));
      add("text", { x: left - 4, y: top + ph, "text-anchor": "end", class: "hist-tick" }, "0");
      h.counts.forEach((count, i) => {
        const bh = peak ? ph * count / peak : 0;
        const rect = add("rect", { x: left + i * bw + 1, y: top + ph - bh, width: Math.max(1, bw - 2), height: bh, class: "hist-bar",
          "data-count": count, "data-lo": h.edges[i], "data-hi": h.edges[i + 1] });
        const tip = document.createElementNS(SVG, "title");
        tip.textContent = `${binLabel(i)}: ${count} row${count === 1 ? "" : "s"}`;
        rect.append(tip);
      });
      const every = Math.ceil(n / Math.max(1, Math.floor((W - left) / 48)));
      for (let i = 0; i < n; i += every) {
        add("text", { x: left + (i + 0.5) * bw, y: H - 5, "text-anchor": "middle", class: "hist-tick" }, integer && h.edges[i + 1] - h.edges[i] === 1 ? String(h.edges[i]) : fmt(h.edges[i]));
      }
      const missing = h.missing ? ` · ${h.missing} without a value` : "";
      this.summary.textContent = `step ${h.step} · ${h.total} rows · mean ${fmt(h.mean)} · min ${fmt(h.min)} · max ${fmt(h.max)}${missing}`;
    }
  }

  return { Chart, Histogram, ema, yRange, xRange, ticks, tickLabels, fmt, ingest, setSmoothing, bindSmoothing, parseEvent, registry,
    get smoothing() { return smoothing; } };
})();
