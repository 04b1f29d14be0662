"""Fixtures of the browser tests: Chromium (one per module) and a logged-in page on the module's `collage serve`
(tests/support/browser.py, tests/support/serve.py)."""

from tests.support.browser import browser, page  # noqa: F401 - fixtures
