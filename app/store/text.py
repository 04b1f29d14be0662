"""Text on its way into the store, and tracebacks on their way out of it.

NUL: PostgreSQL refuses U+0000 in ``text`` (``DataError``) and in ``jsonb``, while SQLite keeps it (and its string
functions then stop at it). So that both databases store the same thing, every string a run writes (completions,
prompts, columns, event messages, errors, metric and reward keys) has its NULs replaced by U+FFFD, and the writer
counts them so the run says how many were replaced.

Tracebacks: a traceback names server paths and code; only admins see one (an event of level
:data:`TRACEBACK_LEVEL`). Everyone sees the message and the exception's line (``RuntimeError: out of memory``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

NUL = "\x00"
REPLACEMENT = "\ufffd"
TRACEBACK_LEVEL = "traceback"  # an event level only admins read (GET /runs/{id}/events, RunOut.error_detail)
SUMMARY_MAX = 500


def clean_text(value: str) -> tuple[str, int]:
    """``value`` with every NUL replaced by U+FFFD, and how many were replaced."""
    count = value.count(NUL)
    return (value.replace(NUL, REPLACEMENT), count) if count else (value, 0)


def clean_json(value: Any) -> tuple[Any, int]:
    """A JSON-like value (dicts, lists, strings, numbers) with NULs replaced in every string and key, and the
    count. Containers are copied only when something changed."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, Mapping):
        total, out = 0, {}
        for key, item in value.items():
            new_key, n_key = clean_text(key) if isinstance(key, str) else (key, 0)
            new_item, n_item = clean_json(item)
            out[new_key] = new_item
            total += n_key + n_item
        return (out, total) if total else (value, 0)
    if isinstance(value, (list, tuple)):
        cleaned = [clean_json(item) for item in value]
        total = sum(n for _, n in cleaned)
        return ([item for item, _ in cleaned], total) if total else (value, 0)
    return value, 0


def nul_note(count: int, what: str) -> str:
    return (
        f"{count} NUL character{'s' if count != 1 else ''} in {what} stored as U+FFFD (the store keeps no NUL: "
        "PostgreSQL refuses it)"
    )


_TRACEBACK_LINE = re.compile(r"^Traceback \(most recent call last\):[ \t]*$", re.MULTILINE)
_FRAME_LINE = re.compile(r'  File "')


def has_traceback(text: str | None) -> bool:
    """Whether ``text`` holds a Python traceback (alone, or after a message: a reward's error carries one)."""
    return bool(text) and _TRACEBACK_LINE.search(text) is not None  # type: ignore[arg-type]


def exception_line(traceback_text: str) -> str:
    """The line of a traceback that says what was raised (``ValueError: bad value``): the one after its last frame
    (the indented lines), at most :data:`SUMMARY_MAX` characters."""
    lines = [line for line in traceback_text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    # the last frame is a `  File "...", line N` line, followed by its source and caret lines (indented further);
    # the exception's text comes next (its own later lines may be indented too: a pydantic error's are)
    at = max((i for i, line in enumerate(lines) if _FRAME_LINE.match(line)), default=-1) + 1
    while at < len(lines) and lines[at].startswith("    "):
        at += 1
    line = (lines[at] if at < len(lines) else lines[-1]).strip()
    return line if len(line) <= SUMMARY_MAX else line[: SUMMARY_MAX - 1] + "…"


def split_traceback(text: str) -> tuple[str, str | None]:
    """``(what everyone may read, the whole text for admins)``: a text without a traceback is all public (and
    there is no detail); one with a traceback shows its message (what precedes the traceback) and the exception
    line, e.g. ``reward 'f' raised on dataset row 3: KeyError: 'answer'``."""
    found = _TRACEBACK_LINE.search(text)
    if found is None:
        return text, None
    head, last = text[: found.start()].strip(), exception_line(text[found.start() :])
    return (f"{head.rstrip(':')}: {last}" if head and last else head or last), text


def public_error(error: str | None) -> str | None:
    """What a run's ``error`` shows to someone who may not see tracebacks (errors stored before tracebacks moved to
    an admin-only event may hold one)."""
    return error if error is None else split_traceback(error)[0]
