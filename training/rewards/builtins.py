"""Built-in reward functions.

Every reward function takes keyword arguments in TRL's convention: ``prompts`` (conversations),
``completions`` (each a list with one ``{"role": "assistant", "content": text}`` message),
``completion_ids``, ``images`` (each sample's list of PIL images, possibly empty) and every other dataset
column as a list, and returns one ``float`` or ``None`` (not applicable) per sample. Multi-turn rollouts (a run
with ``tools``) also pass ``trajectories``: per completion its list of :class:`~collage.training.tools.types.Turn`
(assistant and tool turns, in order; empty without tools). The tool rewards read it and take a missing one (None,
an older caller) as "no tool calls".
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

ANSWER_RE = re.compile(r"<answer>\s*(.*?)\s*</answer>", re.DOTALL)
FULL_FORMAT_RE = re.compile(r"^\s*<answer>\s*\S.*?</answer>\s*$", re.DOTALL)
NUMBER_RE = re.compile(r"-?\d+")


def completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):
            return "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return str(completion)


def prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    parts = []
    for message in prompt:
        content = message.get("content", "")
        if isinstance(content, str):
            parts.append(content)
        else:
            parts.extend(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return " ".join(parts)


def extract_answer(text: str) -> str:
    """The text inside ``<answer>...</answer>`` if present, else the first word."""
    found = ANSWER_RE.search(text)
    if found:
        return found.group(1).strip()
    words = text.strip().split()
    return words[0] if words else ""


def _normalise(answer: Any) -> str:
    return str(answer).strip().strip(".").lower()


def accuracy(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float | None]:
    """1.0 when the completion's answer (inside ``<answer></answer>``, else its first word) equals the row's
    ``answer`` column (a string or a number; a list: any of its acceptable answers), ignoring case and a trailing
    full stop; 0.0 otherwise; ``None`` for rows without an ``answer`` (or without the column)."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        if expected is None or isinstance(expected, (list, tuple)) and not expected:
            out.append(None)
            continue
        accepted = {_normalise(e) for e in expected} if isinstance(expected, (list, tuple)) else {_normalise(expected)}
        out.append(1.0 if _normalise(extract_answer(completion_text(completion))) in accepted else 0.0)
    return out


def format(completions: list[Any], **_: Any) -> list[float]:
    """1.0 for a completion that is exactly ``<answer>...</answer>`` (whitespace allowed around it), 0.5 for
    one that starts with ``<answer>`` or holds an answer block somewhere, else 0.0."""
    out = []
    for completion in completions:
        text = completion_text(completion)
        if FULL_FORMAT_RE.match(text):
            out.append(1.0)
        elif text.lstrip().startswith("<answer>") or ANSWER_RE.search(text):
            out.append(0.5)
        else:
            out.append(0.0)
    return out


def numeric(completions: list[Any], **_: Any) -> list[float]:
    """Shaping for tasks whose answer is a number: 1.0 for a bare integer (optionally inside
    ``<answer></answer>``; whitespace around it allowed), else half the share of the completion's non-space
    characters that are digits: ``"12 12 12"`` earns 0.5, never the 1.0 of ``"12"``, so a policy is not paid to
    repeat numbers instead of answering one."""
    out = []
    for completion in completions:
        text = (
            extract_answer(completion_text(completion))
            if ANSWER_RE.search(completion_text(completion))
            else completion_text(completion)
        )
        if re.fullmatch(r"-?\d+", text.strip()):
            out.append(1.0)
            continue
        chars = [c for c in text if not c.isspace()]
        out.append(0.5 * sum(c.isdigit() for c in chars) / len(chars) if chars else 0.0)
    return out


def closeness(completions: list[Any], answer: list[Any] | None = None, **_: Any) -> list[float | None]:
    """Partial credit for numeric answers: ``1 / (1 + |n - answer|)`` for the first integer ``n`` of the
    completion's answer (inside ``<answer></answer>``, else its first word), 0.0 when it has none; ``None`` for
    rows whose ``answer`` is not an integer (or without the column). A count that is off by one earns 0.5, so
    a policy is told which wrong answers are nearly right (dense where ``accuracy`` is all or nothing)."""
    if answer is None:
        return [None] * len(completions)
    out: list[float | None] = []
    for completion, expected in zip(completions, answer, strict=True):
        target = NUMBER_RE.fullmatch(_normalise(expected)) if expected is not None else None
        if target is None:
            out.append(None)
            continue
        number = NUMBER_RE.fullmatch(extract_answer(completion_text(completion)).strip().strip("."))
        out.append(1.0 / (1.0 + abs(int(number.group()) - int(target.group()))) if number else 0.0)
    return out


def length(
    completion_ids: list[list[int]], max_completion_length: int = 32, target: int | None = None, **_: Any
) -> list[float]:
    """Length shaping in [0, 1]. Without ``target``: ``1 - tokens / max_completion_length`` (shorter is
    better). With ``target``: ``1 - |tokens - target| / max_completion_length``."""
    out = []
    for ids in completion_ids:
        n = len(ids)
        gap = n if target is None else abs(n - target)
        out.append(float(max(0.0, 1.0 - gap / max(1, max_completion_length))))
    return out


def is_red(image: Any, threshold: float = 0.05) -> bool:
    """Whether at least ``threshold`` of the image's pixels are strongly red."""
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16).reshape(-1, 3)
    r, g, b = pixels[:, 0], pixels[:, 1], pixels[:, 2]
    red = (r > 150) & (g < 90) & (b < 90)
    return bool(red.mean() >= threshold)


def red_count(completions: list[Any], images: list[list[Any]], prompts: list[Any], **_: Any) -> list[float | None]:
    """A visual reward: counts the red images of the sample itself (from the pixels, not from any label) and
    gives 1.0 when the completion's number equals that count, else 0.0. ``None`` for samples without images
    or whose prompt does not ask about red."""
    out: list[float | None] = []
    for completion, sample_images, prompt in zip(completions, images, prompts, strict=True):
        if not sample_images or "red" not in prompt_text(prompt).lower():
            out.append(None)
            continue
        reds = sum(is_red(image) for image in sample_images)
        number = NUMBER_RE.search(extract_answer(completion_text(completion)))
        out.append(1.0 if number is not None and int(number.group()) == reds else 0.0)
    return out


# --- tool rewards: they read the rollout's trajectory (training.tools.types.Turn objects, or their dict form)


def _field(obj: Any, name: str) -> Any:
    return obj.get(name) if isinstance(obj, dict) else getattr(obj, name, None)


def _trajectories(trajectories: list[Any] | None, n: int) -> list[list[Any]]:
    if trajectories is None:
        return [[] for _ in range(n)]
    if len(trajectories) != n:
        raise ValueError(f"got {len(trajectories)} trajectories for {n} completions")
    return [list(t or []) for t in trajectories]


def tool_calls(trajectory: list[Any]) -> list[Any]:
    """The tool calls a trajectory made, in order: the calls its tool turns answer, and the call of a model turn no
    tool turn answered (one the rollout did not run: the call limit or the length limit came first). A model turn
    records only its first call; each call it ran has its own tool turn."""
    made: list[Any] = []
    pending = None  # the last model turn's call, until a tool turn answers it
    for turn in trajectory:
        role, call = _field(turn, "role"), _field(turn, "tool_call")
        if role == "assistant":
            if pending is not None:
                made.append(pending)
            pending = call
        elif role == "tool":
            pending = None
            if call is not None:
                made.append(call)
    if pending is not None:
        made.append(pending)
    return made


def _succeeded(turn: Any) -> bool:
    """A tool turn whose call parsed and ran: no error on the turn nor on the call it answers."""
    if _field(turn, "role") != "tool" or _field(turn, "error") is not None:
        return False
    call = _field(turn, "tool_call")
    return call is None or _field(call, "error") is None


def tool_format(completions: list[Any], trajectories: list[Any] | None = None, **_: Any) -> list[float | None]:
    """Whether the model's tool calls were well-formed: 1.0 when the rollout made at least one tool call and every
    one of them parsed (a ``<tool_call>`` whose JSON has a name and arguments), 0.0 when any call was malformed
    (unreadable JSON, no name: the calls the model was shown a parse error for), ``None`` when it made no call
    (not applicable: answering without a tool is neither good nor bad format). A call that parsed but whose tool
    then failed (an unknown tool, a box outside the image, a timeout) is well-formed here; ``tool_bonus`` asks for a call that
    worked. Rollouts without tools (or without ``trajectories``) score ``None``."""
    out: list[float | None] = []
    for trajectory in _trajectories(trajectories, len(completions)):
        calls = tool_calls(trajectory)
        if not calls:
            out.append(None)
        else:
            out.append(0.0 if any(_field(c, "error") is not None for c in calls) else 1.0)
    return out


def tool_bonus(
    completions: list[Any], answer: list[Any] | None = None, trajectories: list[Any] | None = None, **_: Any
) -> list[float | None]:
    """DeepEyes' tool bonus: 1.0 when the final answer is right (the ``accuracy`` check against the ``answer``
    column) and the rollout made at least one successful tool call (a tool turn without an error), else 0.0, so a
    tool is paid for only when the answer it led to is right; ``None`` for rows without an ``answer`` (or
    without the column). Weight it below ``accuracy`` (DeepEyes: accuracy 1.0, format 0.5, tool bonus 0.5)."""
    right = accuracy(completions, answer)
    out: list[float | None] = []
    for ok, trajectory in zip(right, _trajectories(trajectories, len(completions)), strict=True):
        if ok is None:
            out.append(None)
        else:
            out.append(1.0 if ok == 1.0 and any(_succeeded(t) for t in trajectory) else 0.0)
    return out


def _region(value: Any) -> tuple[float, float, float, float] | None:
    if value is None:
        return None
    if isinstance(value, str):  # a column read from a CSV-like source
        value = json.loads(value)
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 4
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise ValueError(f"a region is [x1, y1, x2, y2] in pixels, got {value!r}")
    x1, y1, x2, y2 = (float(v) for v in value)
    return x1, y1, x2, y2


# where a rollout image lies in a row image: (row image index, x offset, y offset, x scale, y scale)
_Placement = tuple[int, float, float, float, float]


def _zoom_source(source: Any, placed: list[_Placement | None]) -> tuple[_Placement, tuple[float, ...]] | None:
    """The placement of the image a zoom cropped and the crop's box in that image's pixels, or None."""
    if not isinstance(source, dict):
        return None
    index = source.get("image", 0)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(placed):
        return None
    parent = placed[index]
    try:
        box = _region(source.get("bbox_2d"))
    except ValueError:
        return None
    return (parent, box) if parent is not None and box is not None else None


def zoom_boxes(trajectory: list[Any], row_images: int = 1) -> list[tuple[int, float, float, float, float]]:
    """The boxes the trajectory's successful ``image_zoom_in`` calls looked at, each ``(k, x1, y1, x2, y2)`` in the
    pixel coordinates of the row's image ``k``: read from the tool images' ``source`` (``{"image": j, "bbox_2d":
    [...]}``, image ``j`` numbered in order of appearance: the row's ``row_images`` images, then every earlier tool
    image), a zoom into an earlier crop mapped back through that crop. Images of other tools (a rotation) are not
    mapped, nor zooms into them."""
    placed: list[_Placement | None] = [(k, 0.0, 0.0, 1.0, 1.0) for k in range(row_images)]
    boxes = []
    for turn in trajectory:
        if _field(turn, "role") != "tool":
            continue
        call = _field(turn, "tool_call")
        zoom = _succeeded(turn) and (call is None or _field(call, "name") == "image_zoom_in")
        for tool_image in _field(turn, "images") or []:
            found = _zoom_source(_field(tool_image, "source"), placed) if zoom else None
            if found is None:
                placed.append(None)
                continue
            (k, ox, oy, sx, sy), (x1, y1, x2, y2) = found
            boxes.append((k, ox + sx * x1, oy + sy * y1, ox + sx * x2, oy + sy * y2))
            width, height = getattr(_field(tool_image, "image"), "size", (0, 0))
            fits = width > 0 and height > 0
            placed.append(
                (k, ox + sx * x1, oy + sy * y1, sx * (x2 - x1) / width, sy * (y2 - y1) / height) if fits else None
            )
    return boxes


def zoom_hit(
    completions: list[Any],
    region: list[Any] | None = None,
    trajectories: list[Any] | None = None,
    images: list[list[Any]] | None = None,
    **_: Any,
) -> list[float | None]:
    """Whether the model looked in the right place, for rows with a ``region`` column (``[x1, y1, x2, y2]`` in the
    pixel coordinates of the row's first image, as ``synth:find-digit`` writes): 1.0 when some successful
    ``image_zoom_in`` call's box (its result's ``source.bbox_2d``, in pixels; a zoom into an earlier crop counts in
    the original image's coordinates) contains the centre of the region, borders included; 0.0 when calls were made
    but none did, and 0.0 when no call was made; ``None`` for rows without a region (or without the column). The
    centre, not an overlap ratio: a generous box that holds the target counts as much as a tight one."""
    if region is None:
        return [None] * len(completions)
    counts = [len(i) for i in images] if images is not None else [1] * len(completions)
    out: list[float | None] = []
    for target, trajectory, row_images in zip(
        region, _trajectories(trajectories, len(completions)), counts, strict=True
    ):
        box = _region(target)
        if box is None:
            out.append(None)
            continue
        cx, cy = (box[0] + box[2]) / 2, (box[1] + box[3]) / 2
        hit = any(
            k == 0 and x1 <= cx <= x2 and y1 <= cy <= y2
            for k, x1, y1, x2, y2 in zoom_boxes(trajectory, max(1, row_images))
        )
        out.append(1.0 if hit else 0.0)
    return out


def environment_reward(completions: list[Any], environments: list[Any] | None = None, **_: Any) -> list[float | None]:
    """The rollout's environment's own score: ``reward()`` of the environment instance that ran the rollout (a run
    with ``environment`` whose class defines ``reward()``, TRL's environment_factory pattern); None for a rollout
    without one, or when ``reward()`` returns None."""
    envs = environments or [None] * len(completions)
    out: list[float | None] = []
    for env in envs:
        method = getattr(env, "reward", None)
        value = method() if callable(method) else None
        out.append(None if value is None else float(value))
    return out


BUILTINS: dict[str, Callable[..., Any]] = {
    "accuracy": accuracy,
    "format": format,
    "numeric": numeric,
    "closeness": closeness,
    "length": length,
    "red_count": red_count,
    "tool_format": tool_format,
    "tool_bonus": tool_bonus,
    "zoom_hit": zoom_hit,
    "environment_reward": environment_reward,
}
