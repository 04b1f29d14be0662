"use strict";
// The colour scheme: light, dark, or auto (follows the system's prefers-color-scheme). Loaded from <head> without
// `defer`, so the choice is on <html> before the first paint (the pages' Content-Security-Policy allows no inline
// script). The choice is kept in localStorage["collage-theme"] ("light" or "dark"; absent means auto).
//   <html data-theme="light|dark">  only when chosen; collage.css otherwise follows the media query
//   <html data-scheme="light|dark"> always: the scheme in effect, for scripts
// A change (the header's toggle, the system's setting in auto, another tab) fires `collage:theme` on document,
// with detail {choice, scheme}: charts redraw with the new colours.
(() => {
  const KEY = "collage-theme";
  const CHOICES = ["auto", "light", "dark"];
  const root = document.documentElement;
  const systemDark = window.matchMedia("(prefers-color-scheme: dark)");

  function stored() {
    try {
      const value = localStorage.getItem(KEY);
      return value === "light" || value === "dark" ? value : "auto";
    } catch (e) {
      return "auto"; // storage disabled: follow the system
    }
  }

  function apply(choice) {
    const scheme = choice === "auto" ? (systemDark.matches ? "dark" : "light") : choice;
    if (choice === "auto") root.removeAttribute("data-theme"); else root.setAttribute("data-theme", choice);
    const changed = root.dataset.scheme !== scheme;
    root.dataset.scheme = scheme;
    const select = document.getElementById("theme");
    if (select && select.value !== choice) select.value = choice;
    if (changed) document.dispatchEvent(new CustomEvent("collage:theme", { detail: { choice, scheme } }));
  }

  function choose(choice) {
    if (!CHOICES.includes(choice)) throw new Error("theme must be one of " + CHOICES.join(", ") + ", not " + choice);
    try {
      if (choice === "auto") localStorage.removeItem(KEY); else localStorage.setItem(KEY, choice);
    } catch (e) { /* storage disabled: the choice lasts for this page only */ }
    apply(choice);
  }

  apply(stored());
  systemDark.addEventListener("change", () => apply(stored()));
  window.addEventListener("storage", event => { if (event.key === KEY || event.key === null) apply(stored()); });
  document.addEventListener("DOMContentLoaded", () => {
    const select = document.getElementById("theme");
    if (!select) return;
    select.value = stored();
    select.addEventListener("change", () => choose(select.value));
  });
  window.CollageTheme = { choose, choice: stored, scheme: () => root.dataset.scheme };
})();
