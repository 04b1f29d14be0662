"""What the tests share: services and processes they start, waits with deadlines, the tier rules, helpers.

Nothing here is a test; each tier folder (tests/unit, tests/store, tests/training, tests/processes, tests/browser)
imports what it needs from these modules by name (``from tests.support.waiting import wait_for``).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout
API = "/api/v1"
