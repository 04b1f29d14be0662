"""Tool calls read from the model's text, in the family's tool-call format.

The default is Qwen's (and Hermes'): each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, as
Qwen2.5-VL's and Qwen3-VL's real chat templates describe to the model; the tiny models' templates use it too. A call
that cannot be read (no closing tag, malformed JSON, no name, arguments that are not an object) is still a call: it
comes back with ``error`` set, and the model is shown that error as the tool's result, so it can learn the format;
it never fails the run.
"""

from __future__ import annotations

import json
import re

from .types import ToolCall

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|\Z)", re.DOTALL)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call in ``text``, in order; empty when the model called no tool (its answer turn)."""
    calls = []
    for match in _CALL.finditer(text):
        body, closed = match.group(1).strip(), bool(match.group(2))
        if not closed:
            calls.append(ToolCall("", {}, f"the tool call has no closing {CLOSE}"))
            continue
        calls.append(_read_call(body))
    return calls


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def _read_call(body: str) -> ToolCall:
    try:
        # NaN and Infinity are not JSON: Python reads them, PostgreSQL's JSON refuses them in the stored trajectory
        value = json.loads(body, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        return ToolCall("", {}, f"the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
    except ValueError as exc:
        return ToolCall("", {}, f"the tool call is not valid JSON ({exc})")
    if not isinstance(value, dict):
        return ToolCall("", {}, 'the tool call must be a JSON object {"name": ..., "arguments": {...}}')
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall("", {}, 'the tool call has no "name"')
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments, parse_constant=_no_constant)
        except ValueError:
            return ToolCall(name, {}, f"the arguments of {name} are not a JSON object")
    if not isinstance(arguments, dict):
        return ToolCall(name, {}, f"the arguments of {name} must be a JSON object")
    return ToolCall(name, arguments)


def format_call(call: ToolCall) -> str:
    """The text of ``call`` in the default format (what a scripted policy or a test writes)."""
    return OPEN + json.dumps({"name": call.name, "arguments": call.arguments}) + CLOSE
