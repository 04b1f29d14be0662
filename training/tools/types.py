"""The values a multi-turn rollout passes around: a parsed tool call, a tool's result, one turn of a trajectory.

A trajectory is what a person reads on the rollout page and what rewards see: the model's turns (its text and the
tool call it made) and the tool turns (the result's text and images, or the error the model was shown), in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from the model's text: ``name`` and JSON ``arguments``; ``error`` when the call could not
    be read (malformed JSON, no name): the model is shown that error instead of a result."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclass
class ToolImage:
    """An image a tool returned. ``source``: where it came from, ``{"image": k, "bbox_2d": [x1, y1, x2, y2]}`` in
    the pixel coordinates of the rollout's image ``k`` (numbered in order of appearance: the row's images, then
    every earlier tool image); None when a tool made it from nothing it can point at."""

    image: Any  # PIL.Image.Image, RGB
    source: dict[str, Any] | None = None


@dataclass
class ToolResult:
    """What one tool call gave: text and/or images, or ``error`` (the text the model sees instead)."""

    text: str = ""
    images: list[ToolImage] = field(default_factory=list)
    error: str | None = None


@dataclass
class Turn:
    """One turn of a trajectory. ``role``: ``assistant`` (``text`` is what the model generated, ``tool_call`` the
    call it made, if any) or ``tool`` (``text`` the result's text or the error, ``images`` what the tool returned,
    ``tool_call`` the call it answers, ``error`` when the call failed)."""

    role: str
    text: str
    tool_call: ToolCall | None = None
    images: list[ToolImage] = field(default_factory=list)
    error: str | None = None
