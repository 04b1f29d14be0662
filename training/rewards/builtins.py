"""Built-in reward functions.

Every reward function takes keyword arguments in TRL's convention: ``prompts`` (conversations),
``completions`` (each a list with one ``{"role": "assistant", "content": text}`` message),
``completion_ids``, ``images`` (each sample's list of PIL images, possibly empty) and every other dataset
column as a list, and returns one ``float`` or ``None`` (not applicable) per sample.
"""

from __future__ import annotations

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


BUILTINS: dict[str, Callable[..., Any]] = {
    "accuracy": accuracy,
    "format": format,
    "numeric": numeric,
    "closeness": closeness,
    "length": length,
    "red_count": red_count,
}
