"""Scripted tool calls for the playground's tests with tools (tests/support/scripted_turns/sitecustomize.py): the
environment that makes the processes started with it answer a prompt holding ``marker`` with the given turns."""

from __future__ import annotations

import json
import os
from pathlib import Path

from collage.training.tools.calls import format_call
from collage.training.tools.types import ToolCall

FOLDER = Path(__file__).parent / "scripted_turns"
SCRIPT_ENV = "COLLAGE_TEST_SCRIPTED_TURNS"


def call(name: str, **arguments) -> str:
    """A tool call as the model writes it (Qwen's format)."""
    return format_call(ToolCall(name, arguments))


def scripted_env(marker: str, turns: list[str], pythonpath: str | None = None) -> dict[str, str]:
    """``PYTHONPATH`` (this folder, then ``pythonpath``, by default this process's) and the script, for the
    environment of the processes to start."""
    rest = os.environ.get("PYTHONPATH", "") if pythonpath is None else pythonpath
    path = os.pathsep.join(p for p in (str(FOLDER), rest) if p)
    return {"PYTHONPATH": path, SCRIPT_ENV: json.dumps({"marker": marker, "turns": turns})}
