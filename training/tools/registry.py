"""Resolve a run's ``tools`` and ``environment`` to callables, under the operator's allowlist.

A tool is a built-in (:mod:`training.tools.image_tools`) or an import path ``package.module:function`` naming a
plain function with type hints and a Google-style docstring: its JSON schema (what the chat template shows the
model) is read from them with transformers' ``get_json_schema``, as TRL does. An environment is an import path
``package.module:Class``: one instance per rollout, ``reset(row)`` starts it, its public methods are tools.

Code named in a config runs on a worker, so with ``tool_modules`` (the operator's ``COLLAGE_TOOL_MODULES``; a
config from an API client) an import path must lie inside an allowlisted module before anything is imported, and
the object found must be defined there (docs/security.md). ``None`` trusts every name, as local ``collage train``.

Parameters a tool takes but the model never sees: ``images`` (every image of the rollout so far, PIL, in order of
appearance), ``row`` (the dataset row's columns) and, for built-ins, their settings; plus a tool's ``args`` from
the config. They are left out of the schema.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from collage.training.infra.errors import InputError

from ..rewards.registry import DENIED_MODULES, IMPORT_PATH, module_allowed
from .image_tools import BUILTIN_TOOLS

HIDDEN_PARAMETERS = ("images", "row", "coords", "max_side")
HOW_TO_ALLOW = (
    "the operator allows the functions and classes of a module (and of its submodules) as tools by listing it in "
    "COLLAGE_TOOL_MODULES (comma-separated) on the server and on every worker"
)


class UnknownToolError(InputError):
    """A tool or environment that cannot be used: unknown, not allowlisted, or without a usable schema."""


def tool_import_error(name: str, allowed: Sequence[str]) -> str | None:
    """Why the import path ``name`` may not be imported as a tool or environment under ``allowed``, or None.
    Decided on the name alone (the API's check at submit, the worker's before the import)."""
    if not IMPORT_PATH.match(name):
        return "a tool is a built-in name or an import path 'package.module:function'"
    module, _, attr = name.partition(":")
    if module.split(".")[0] in DENIED_MODULES:
        return f"module {module!r} never provides tools (the standard library and Collage's own stack are refused)"
    if attr.startswith("_") or any(part.startswith("_") for part in module.split(".")):
        return "private names (starting with _) are not tools"
    if not module_allowed(module, allowed):
        return f"module {module!r} is not allowlisted for tools: {HOW_TO_ALLOW}"
    return None


def tool_name_error(name: str, allowed: Sequence[str]) -> str | None:
    """Why ``name`` (an entry of ``tools``) may not run under the allowlist ``allowed``, or None."""
    if name in BUILTIN_TOOLS:
        return None
    if ":" not in name:
        return f"unknown tool {name!r}: built-ins are {', '.join(sorted(BUILTIN_TOOLS))}; yours are 'module:function'"
    return tool_import_error(name, allowed)


def _import(name: str, tool_modules: Sequence[str] | None, kind: str) -> Any:
    if tool_modules is not None and (problem := tool_import_error(name, tool_modules)) is not None:
        raise UnknownToolError(f"{kind} {name!r}: {problem}")
    if not IMPORT_PATH.match(name):
        raise UnknownToolError(
            f"{kind} {name!r}: an import path is 'package.module:{'Class' if kind == 'environment' else 'function'}'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UnknownToolError(f"{kind} {name!r}: cannot import module {module_name!r} ({exc})") from exc
    obj = getattr(module, attr, None)
    if obj is None:
        raise UnknownToolError(f"{kind} {name!r}: module {module_name!r} has no {attr!r}")
    want = inspect.isclass if kind == "environment" else inspect.isfunction
    if not want(obj):
        raise UnknownToolError(
            f"{kind} {name!r}: it is a {type(obj).__name__}, not a {'class' if kind == 'environment' else 'function'}"
        )
    if tool_modules is not None and not module_allowed(obj.__module__ or "", tool_modules):
        raise UnknownToolError(f"{kind} {name!r}: it is defined in {obj.__module__!r}, outside the allowlisted modules")
    return obj


def tool_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The function's JSON schema as chat templates take it (``{"type": "function", "function": {...}}``), read from
    its type hints and docstring, without the parameters Collage fills in (:data:`HIDDEN_PARAMETERS`)."""
    from transformers.utils import get_json_schema

    hidden = [p for p in inspect.signature(fn).parameters if p in HIDDEN_PARAMETERS or p == "self"]
    try:
        schema = get_json_schema(_without(fn, hidden))
    except Exception as exc:  # transformers' DocstringParsingException and TypeHintParsingException, among others
        raise UnknownToolError(
            f"tool {name or fn.__name__!r}: its JSON schema cannot be read from its signature and docstring ({exc}); "
            "a tool needs a type hint on every parameter and an Args: section describing each"
        ) from exc
    if name:
        schema["function"]["name"] = name
    return schema


def _without(fn: Callable[..., Any], hidden: list[str]) -> Callable[..., Any]:
    """A stand-in for ``fn`` whose signature and docstring leave out ``hidden`` parameters (for the schema only)."""
    signature = inspect.signature(fn)
    params = [p for n, p in signature.parameters.items() if n not in hidden]

    def stand_in(*args: Any, **kwargs: Any) -> Any:  # never called
        raise NotImplementedError

    stand_in.__name__ = fn.__name__
    stand_in.__doc__ = fn.__doc__
    stand_in.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    hints = dict(getattr(fn, "__annotations__", {}))
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception:  # noqa: BLE001 - string annotations that cannot be evaluated: keep them as written
        pass
    stand_in.__annotations__ = {k: v for k, v in hints.items() if k not in hidden}
    return stand_in


@dataclass
class Tool:
    """A tool the model may call. ``fixed``: keyword arguments Collage passes itself (settings, ``args``)."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]
    timeout: float
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def parameters(self) -> dict[str, Any]:
        return self.schema["function"].get("parameters", {})

    def accepts(self, parameter: str) -> bool:
        params = inspect.signature(self.fn).parameters
        return parameter in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def resolve_tools(tools: Sequence[Any], tool_modules: Sequence[str] | None, max_side: int | None) -> list[Tool]:
    """The run's ``tools`` entries (:class:`~training.config.ToolSettings`) as :class:`Tool` objects.
    ``max_side``: the longest side the model's processor takes, the built-ins' crop limit."""
    out = []
    for spec in tools:
        if spec.name in BUILTIN_TOOLS:
            builtin: Callable[..., Any] = BUILTIN_TOOLS[spec.name]
            # Collage's own settings last: a config's args cannot lift the crop limit
            fixed: dict[str, Any] = {**spec.args, "max_side": max_side}
            if spec.name == "image_zoom_in":
                fixed["coords"] = spec.coords
            out.append(Tool(spec.name, builtin, tool_schema(builtin), spec.timeout, fixed))
            continue
        if ":" not in spec.name:
            raise UnknownToolError(
                f"unknown tool {spec.name!r}: built-ins are {', '.join(sorted(BUILTIN_TOOLS))}; yours are 'module:function'"
            )
        fn = _import(spec.name, tool_modules, "tool")
        out.append(Tool(fn.__name__, fn, tool_schema(fn), spec.timeout, dict(spec.args)))
    return out


ENVIRONMENT_TIMEOUT = 10.0  # seconds a call of an environment's method may take


def resolve_environment(name: str | None, tool_modules: Sequence[str] | None) -> type | None:
    """The environment class named by the run (checked like a tool), or None."""
    if name is None:
        return None
    cls = _import(name, tool_modules, "environment")
    if not callable(getattr(cls, "reset", None)):
        raise UnknownToolError(f"environment {name!r}: it has no reset(row) method")
    for method in environment_methods(cls):
        tool_schema(method, method.__name__)  # every public method must have a schema: refused now, not mid-run
    return cls


def environment_methods(cls: type) -> list[Callable[..., Any]]:
    """The environment's tools: its public methods but ``reset`` and ``reward``."""
    return [
        member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "reward")
    ]


def environment_tools(instance: Any) -> list[Tool]:
    """The bound tools of one environment instance (one per rollout)."""
    tools = []
    for method in environment_methods(type(instance)):
        bound = getattr(instance, method.__name__)
        tools.append(Tool(method.__name__, bound, tool_schema(method, method.__name__), ENVIRONMENT_TIMEOUT))
    return tools
