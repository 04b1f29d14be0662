"""Run one tool call: its arguments checked against the tool's schema, a time limit, every failure a tool error.

Whatever goes wrong in a call (an unknown tool, a malformed call, a missing or unknown argument, a wrong type, an
exception inside the tool, a time-out, a result that is neither text nor images) becomes a :class:`ToolResult` with
``error`` set: the model sees that text as the tool's answer and the step counts it (``tools/failure_frequency``);
the run goes on. A call that times out is abandoned in its (daemon) thread, never waited for: Python cannot stop a
thread, so a tool that loops forever keeps a core busy until the process ends; time limits protect the run's
progress, not the machine (docs/tools.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from PIL import Image

from .image_tools import ToolArgumentError
from .registry import Tool
from .types import ToolCall, ToolImage, ToolResult

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "string": (str,),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def argument_error(tool: Tool, arguments: dict[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the tool's schema (a required one missing, an unknown one, a wrong JSON type)."""
    params = tool.parameters
    properties: dict[str, Any] = params.get("properties", {})
    missing = [name for name in params.get("required", []) if name not in arguments]
    if missing:
        return f"{tool.name}: missing argument {', '.join(missing)}"
    unknown = [name for name in arguments if name not in properties]
    if unknown:
        return f"{tool.name}: unknown argument {', '.join(unknown)} (it takes {', '.join(properties) or 'none'})"
    for name, value in arguments.items():
        spec = properties[name]
        if value is None and spec.get("nullable"):
            continue
        kinds = spec.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds] if kinds else []
        allowed = tuple(t for k in kinds for t in _JSON_TYPES.get(k, (object,)))
        wrong_bool = isinstance(value, bool) and "boolean" not in kinds
        if allowed and (not isinstance(value, allowed) or wrong_bool):
            return f"{tool.name}: argument {name} must be {' or '.join(kinds)}, got {type(value).__name__}"
    return None


def as_result(value: Any, name: str) -> ToolResult:
    """A tool's return value as a :class:`ToolResult`: a ToolResult, text, a PIL image, or a list of those."""
    if isinstance(value, ToolResult):
        return value
    items = value if isinstance(value, (list, tuple)) else [value]
    texts, images = [], []
    for item in items:
        if isinstance(item, str):
            texts.append(item)
        elif isinstance(item, Image.Image):
            images.append(ToolImage(item.convert("RGB")))
        elif isinstance(item, ToolImage):
            images.append(item)
        elif item is None:
            continue
        elif isinstance(item, (int, float, bool)):
            texts.append(str(item))
        else:
            return ToolResult(error=f"{name} returned a {type(item).__name__}; a tool returns text and/or images")
    return ToolResult("\n".join(texts), images)


def run_tool_call(call: ToolCall, tools: Sequence[Tool], images: list[Any], row: dict[str, Any]) -> ToolResult:
    """The result of ``call`` among ``tools``, with the rollout's ``images`` so far and its dataset ``row``."""
    if call.error is not None:
        return ToolResult(error=call.error)
    tool = next((t for t in tools if t.name == call.name), None)
    if tool is None:
        return ToolResult(
            error=f"unknown tool {call.name!r}; the tools are {', '.join(t.name for t in tools) or 'none'}"
        )
    if (problem := argument_error(tool, call.arguments)) is not None:
        return ToolResult(error=problem)
    kwargs = {**tool.fixed, **call.arguments}
    if tool.accepts("images"):
        kwargs["images"] = list(images)
    if tool.accepts("row"):
        kwargs["row"] = dict(row)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = tool.fn(**kwargs)
        except ToolArgumentError as exc:  # the built-ins' own argument checks: the message says what to fix
            box["error"] = f"{tool.name}: {exc}"
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's feedback, never the run's end
            box["error"] = f"{tool.name} failed: {type(exc).__name__}: {exc}"

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout)
    if thread.is_alive():
        return ToolResult(error=f"{tool.name} timed out after {tool.timeout:g} s")
    if "error" in box:
        return ToolResult(error=box["error"][:2000])
    result = as_result(box.get("value"), tool.name)
    return result
