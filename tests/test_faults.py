"""Faults with real parts: full disks (a real, small tmpfs file system) under real workers and training
processes."""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes and mounts")
