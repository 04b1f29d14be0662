"use strict";
// Starts Swagger UI (vendored in /static/vendor/swagger-ui-*) on /api/v1/docs: an external script, so the page's
// Content-Security-Policy allows only Collage's own scripts, as on every other page; no request leaves the server.
(() => {
  // Swagger UI's stylesheet has a dark variant under html.dark-mode: it follows Collage's theme (theme.js)
  const html = document.documentElement;
  const follow = () => html.classList.toggle("dark-mode", html.dataset.scheme === "dark");
  follow();
  document.addEventListener("collage:theme", follow);
  const root = document.getElementById("swagger-ui");
  window.ui = SwaggerUIBundle({
    url: root.dataset.openapiUrl,
    dom_id: "#swagger-ui",
    layout: "BaseLayout",
    deepLinking: true,
    showExtensions: true,
    showCommonExtensions: true,
    presets: [SwaggerUIBundle.presets.apis],
    validatorUrl: null, // the public validator badge would call out to validator.swagger.io
  });
})();
