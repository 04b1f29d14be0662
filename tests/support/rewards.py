"""User-style reward functions imported by path (``tests.support.rewards:...``) in the training tests."""

from __future__ import annotations

import asyncio
import threading
import time

# re-exported on purpose: allowlisting this module must not make these foreign callables rewards (tests/test_trust.py)
from os import system  # noqa: F401 - a builtin
from subprocess import run as run_command  # noqa: F401 - a plain function, defined in another module

from collage.training.rewards.builtins import completion_text

DIGITS = set("0123456789")


def starts_with_digit(completions, **kwargs):
    """1.0 when the completion's first visible character is a digit: a target a tiny model can learn."""
    out = []
    for c in completions:
        text = completion_text(c).lstrip()
        out.append(1.0 if text and text[0] in DIGITS else 0.0)
    return out


def explode_on_two_images(completions, images, **kwargs):
    for sample_images in images:
        if len(sample_images) == 2:
            raise RuntimeError("this reward cannot handle two images")
    return [0.0] * len(completions)


def only_images(completions, images, **kwargs):
    """None (not applicable) for text-only samples."""
    return [None if not imgs else float(len(imgs)) for imgs in images]


def sees_columns(completions, answer, task, images, prompts, completion_ids, **kwargs):
    assert len(answer) == len(task) == len(images) == len(prompts) == len(completion_ids) == len(completions)
    return [1.0 if a is not None else 0.0 for a in answer]


ACTIVE = {"now": 0, "peak": 0}
_lock = threading.Lock()


async def slow_async_a(completions, **kwargs):
    return await _slow(len(completions))


async def slow_async_b(completions, **kwargs):
    return await _slow(len(completions))


async def _slow(n):
    with _lock:
        ACTIVE["now"] += 1
        ACTIVE["peak"] = max(ACTIVE["peak"], ACTIVE["now"])
    await asyncio.sleep(0.05)
    with _lock:
        ACTIVE["now"] -= 1
    return [0.5] * n


def sleepy(completions, delay=0.01, **kwargs):
    """Paces a run (``args: {delay: seconds}``) so that tests can act on it mid-run."""
    time.sleep(delay)
    return [0.0] * len(completions)


def always_fails(completions, **kwargs):
    raise ValueError("this reward always fails")


class NotAReward:
    """A class of an allowlisted module: calling it builds an object, so it is never a reward."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs


def _private_helper(completions, **kwargs):
    return [0.0] * len(completions)
