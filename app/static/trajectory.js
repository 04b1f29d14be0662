"use strict";
// A multi-turn rollout's trajectory, shared by the rollouts page (rollouts.js) and the playground (playground.js):
// the turns in order (the model's text and its tool call, name and arguments; each tool's answer with its images
// and its error), each tool image beside the thumbnail of the image it was made from with the crop's box drawn on
// it, and the image gallery (arrow keys or j/k, Escape closes). A rollout here is `{images, trajectory, turns,
// tool_calls, tool_errors, capped?}`: the rollout row's shape (its images: {url, thumb_url, width, height, sha256?},
// a tool image's also its `source`). Untrusted text is only ever shown as text.
const Trajectory = (() => {
  const { el } = Collage;
  const plural = (n, word, words = word + "s") => `${Number(n).toLocaleString("en")} ${n === 1 ? word : words}`;

  // every image of a rollout: ← → or j/k to move (j: next, k: previous), Escape closes (Collage.modal)
  function gallery(images, start) {
    if (!images.length) return;
    let at = start;
    const img = el("img", { class: "full", alt: "" });
    const caption = el("figcaption", { class: "gallery-caption" });
    const prev = el("button", { type: "button", class: "gallery-prev", "aria-label": "previous image", text: "‹ previous" });
    const next = el("button", { type: "button", class: "gallery-next", "aria-label": "next image", text: "next ›" });
    const figure = el("figure", { class: "gallery" }, img, el("div", { class: "gallery-nav" }, prev, caption, next));
    const show = k => {
      at = Math.max(0, Math.min(images.length - 1, k));
      const image = images[at];
      if (image.url) img.src = image.url; else img.removeAttribute("src");
      img.alt = `image ${at + 1} of ${images.length}`;
      figure.dataset.index = String(at);
      caption.textContent = `image ${at + 1} of ${images.length} · ${image.width}x${image.height}` + (image.sha256 ? ` · ${image.sha256.slice(0, 12)}…` : "");
      prev.disabled = at === 0;
      next.disabled = at === images.length - 1;
    };
    prev.addEventListener("click", () => show(at - 1));
    next.addEventListener("click", () => show(at + 1));
    Collage.modal(figure);
    show(start);
    const box = document.getElementById("modal");
    const onKey = e => {
      if (box.hidden || !figure.isConnected) { document.removeEventListener("keydown", onKey); return; }
      if (e.altKey || e.ctrlKey || e.metaKey) return;
      if (e.key === "ArrowRight" || e.key === "j") { e.preventDefault(); show(at + 1); }
      else if (e.key === "ArrowLeft" || e.key === "k") { e.preventDefault(); show(at - 1); }
    };
    document.addEventListener("keydown", onKey);
    next.focus();
  }

  // Every image of a rollout in the order a tool's `source.image` numbers them: the row's own images first, then
  // each tool image of its trajectory, turn by turn.
  function rolloutImages(s) {
    return [...s.images, ...(s.trajectory || []).flatMap(t => t.images || [])];
  }

  // A box [x1, y1, x2, y2] in an image's pixels, placed on its shown thumbnail: percentages of the image's own
  // width and height, so the box scales with the thumbnail whatever size it is shown at (clamped to the image).
  function placeBox(node, box, width, height) {
    const clamp = (v, of) => Math.max(0, Math.min(of, Number(v)));
    const [x1, y1, x2, y2] = [clamp(box[0], width), clamp(box[1], height), clamp(box[2], width), clamp(box[3], height)];
    node.style.left = `${(100 * Math.min(x1, x2)) / width}%`;
    node.style.top = `${(100 * Math.min(y1, y2)) / height}%`;
    node.style.width = `${(100 * Math.abs(x2 - x1)) / width}%`;
    node.style.height = `${(100 * Math.abs(y2 - y1)) / height}%`;
    return node;
  }

  const validBox = b => Array.isArray(b) && b.length === 4 && b.every(v => Number.isFinite(Number(v)));
  const boxText = b => `[${b.map(v => String(Math.round(Number(v) * 10) / 10)).join(", ")}]`;

  // an image whose pixels did not come back (the playground keeps a bounded amount of them): said, not shown
  const missing = (cls, alt) => el("span", { class: `${cls} image-missing`, role: "img", "aria-label": alt, text: "not kept" });

  // A source image's thumbnail with boxes drawn on it: boxes [{box, label, id, title}] in the image's pixels.
  function boxFrame(image, index, boxes, onOpen) {
    const alt = `image ${index} (${image.width}x${image.height})`;
    const frame = el("span", { class: "box-frame", "data-image": index },
      image.thumb_url ? el("img", { src: image.thumb_url, class: "source-thumb", alt, loading: "lazy", tabindex: "0", onclick: onOpen,
        onkeydown: e => { if (e.key === "Enter" && onOpen) onOpen(); } }) : missing("source-thumb", alt));
    for (const b of boxes) {
      if (!validBox(b.box) || !(image.width > 0) || !(image.height > 0)) continue;
      frame.append(placeBox(el("span", { class: "crop-box", "data-bbox": b.box.join(","), "data-id": b.id, title: b.title },
        b.label ? el("span", { class: "crop-box-label", text: b.label }) : null), b.box, image.width, image.height));
    }
    return frame;
  }

  // One tool image: its thumbnail, and when it is a crop, the thumbnail of the image it was cropped from with the
  // crop's box on it. `index`: its place among the rollout's images (`all`).
  function toolImage(image, index, all) {
    const src = image.source;
    const from = src && Number.isInteger(src.image) && src.image >= 0 && src.image < all.length && src.image !== index ? all[src.image] : null;
    const open = k => () => gallery(all, k);
    const caption = `image ${index} · ${image.width}x${image.height}`
      + (src ? ` · cropped from image ${src.image}` + (validBox(src.bbox_2d) ? ` at ${boxText(src.bbox_2d)}` : "") : "");
    const alt = `image ${index}: ${from ? `crop of image ${src.image}` : "a tool's image"}`;
    return el("figure", { class: "tool-image" + (from ? " crop" : ""), "data-image": index },
      el("div", { class: "tool-image-pair" },
        image.thumb_url ? el("img", { src: image.thumb_url, class: "crop-thumb", alt, loading: "lazy", tabindex: "0", onclick: open(index),
          onkeydown: e => { if (e.key === "Enter") open(index)(); } }) : missing("crop-thumb", alt),
        from ? boxFrame(from, src.image, [{ box: src.bbox_2d, title: `the crop's box ${boxText(src.bbox_2d)} on image ${src.image}` }], open(src.image)) : null),
      el("figcaption", { class: "muted", text: caption }));
  }

  const trajectorySummary = s => `${plural(s.turns, "turn")} · ${plural(s.tool_calls, "tool call")}`
    + (s.tool_errors ? ` · ${plural(s.tool_errors, "tool error")}` : "")
    + (s.capped ? " · stopped at the tool-call limit" : "");

  // A multi-turn rollout turn by turn, folded under a summary (open: unfolded). Null for a rollout without tools.
  function trajectoryNode(s, open = false) {
    const turns = s.trajectory || [];
    if (!turns.length) return null;
    const all = rolloutImages(s);
    let at = s.images.length;  // the rollout's index of the next tool image
    const items = turns.map((t, k) => {
      const tool = t.role === "tool";
      const images = (t.images || []).map(image => toolImage(image, at++, all));
      return el("li", { class: `turn turn-${tool ? "tool" : "assistant"}` + (t.error ? " has-error" : ""), "data-turn": k },
        el("span", { class: "turn-role", text: tool ? "tool" : t.role }),
        t.text ? el("pre", { class: "turn-text", text: t.text }) : null,
        t.tool_call ? el("div", { class: "tool-call" }, "calls ", el("code", { class: "tool-name", text: String(t.tool_call.name) }),
          el("code", { class: "tool-args", text: JSON.stringify(t.tool_call.arguments ?? null) })) : null,
        images.length ? el("div", { class: "turn-images" }, images) : null,
        t.error ? el("p", { class: "tool-error", role: "note" }, el("b", { text: "tool error: " }), t.error) : null);
    });
    return el("details", { class: "trajectory", open },
      el("summary", { text: `trajectory: ${trajectorySummary(s)}` }), el("ol", { class: "turns" }, items));
  }

  // the counts beside the completion, a tool error flagged without opening the trajectory
  function toolBadges(s) {
    if (!s.turns) return null;
    return [el("span", { class: "badge tools", text: plural(s.tool_calls, "tool call") }),
      s.tool_errors ? el("span", { class: "badge tool-errors", text: plural(s.tool_errors, "tool error") }) : null];
  }

  return { gallery, rolloutImages, placeBox, validBox, boxText, boxFrame, toolImage, trajectorySummary, trajectoryNode, toolBadges, plural };
})();
