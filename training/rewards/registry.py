"""Resolve reward specs to callables and score a batch of completions with all of them.

A reward is a built-in name, an import path ``package.module:function`` (sync or ``async def``), or the path
of a text reward model (a sequence-classification checkpoint). ``None`` means "not applicable".
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CollageError
from .builtins import BUILTINS, completion_text, prompt_text


class RewardError(CollageError, RuntimeError):
    """A reward function failed; the message names the function, the sample and carries the traceback."""

    def __init__(self, message: str, row: int | None = None, traceback_text: str = ""):
        self.row = row
        self.traceback_text = traceback_text
        super().__init__(message + (f"\n{traceback_text}" if traceback_text else ""))


class UnknownRewardError(CollageError, ValueError):
    pass


@dataclass
class Reward:
    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    args: dict[str, Any] = field(default_factory=dict)
    is_async: bool = False
    text_model: Any = None  # a TextRewardModel when the reward is a checkpoint

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.fn) or ""


def reward_docs() -> dict[str, str]:
    """Built-in rewards and their documentation."""
    return {name: inspect.getdoc(fn) or "" for name, fn in BUILTINS.items()}


def _looks_like_checkpoint(name: str) -> bool:
    path = Path(name).expanduser()
    return path.is_dir() and (path / "config.json").is_file()


def resolve_reward(name: str, weight: float = 1.0, args: dict[str, Any] | None = None, **model_options: Any) -> Reward:
    args = dict(args or {})
    if name in BUILTINS:
        return Reward(name, BUILTINS[name], weight, args)
    if ":" in name and not _looks_like_checkpoint(name):
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownRewardError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from None
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UnknownRewardError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
        return Reward(attr, fn, weight, args, is_async=inspect.iscoroutinefunction(fn))
    if _looks_like_checkpoint(name):
        from .reward_model import TextRewardModel

        model = TextRewardModel(name, **model_options)
        return Reward(Path(name).name, model, weight, args, text_model=model)
    raise UnknownRewardError(
        f"unknown reward {name!r}: built-ins are {', '.join(sorted(BUILTINS))}; a user function is "
        "'package.module:function'; a text reward model is a local checkpoint folder"
    )


def _check_output(reward: Reward, values: Any, n: int) -> list[float]:
    if not isinstance(values, (list, tuple)) or len(values) != n:
        got = f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        raise RewardError(f"reward {reward.name!r} must return a list of {n} floats or None, got {got}")
    out = []
    for v in values:
        if v is None:
            out.append(math.nan)
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            out.append(float(v))
        elif hasattr(v, "item"):
            out.append(float(v.item()))
        else:
            raise RewardError(f"reward {reward.name!r} returned a {type(v).__name__}, not a float or None")
    return out


@dataclass
class RewardBatch:
    """What reward functions see for N completions (prompts repeated per generation)."""

    prompts: list[Any]
    completions: list[str]
    completion_ids: list[list[int]]
    images: list[list[Any]]
    columns: dict[str, list[Any]]
    rows: list[int]

    def kwargs(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        pick = (lambda xs: [xs[i] for i in indices]) if indices is not None else (lambda xs: list(xs))
        return {
            "prompts": pick(self.prompts),
            "completions": [[{"role": "assistant", "content": c}] for c in pick(self.completions)],
            "completion_ids": pick(self.completion_ids),
            "images": pick(self.images),
            **{k: pick(v) for k, v in self.columns.items()},
        }


def _call_sync(reward: Reward, kwargs: dict[str, Any]) -> Any:
    return reward.fn(**kwargs, **reward.args)


def _describe_sample(batch: RewardBatch, i: int) -> str:
    prompt = prompt_text(batch.prompts[i])
    return (
        f"dataset row {batch.rows[i]} (prompt {prompt[:200]!r}, {len(batch.images[i])} images, "
        f"completion {completion_text(batch.completions[i])[:200]!r})"
    )


async def _awaited(result: Any) -> Any:
    return await result


def _blame(reward: Reward, batch: RewardBatch, exc: BaseException) -> RewardError:
    """Find the first sample on which the function raises alone, so the error can name it."""
    for i in range(len(batch.rows)):
        try:
            result = reward.fn(**batch.kwargs([i]), **reward.args)
            if inspect.isawaitable(result):
                asyncio.run(_awaited(result))
        except Exception as single:  # noqa: BLE001 - any exception from user code is reported
            tb = "".join(traceback.format_exception(type(single), single, single.__traceback__))
            return RewardError(f"reward {reward.name!r} raised on {_describe_sample(batch, i)}", batch.rows[i], tb)
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RewardError(f"reward {reward.name!r} raised on the batch of {len(batch.rows)} samples", None, tb)


def score(rewards: Sequence[Reward], batch: RewardBatch) -> list[list[float]]:
    """``rewards_per_func[i][k]``: reward ``k`` of completion ``i`` (NaN for ``None``).

    Sync functions run in order; ``async def`` functions run concurrently on one event loop.
    """
    n = len(batch.completions)
    kwargs = batch.kwargs()
    columns: list[list[float] | None] = [None] * len(rewards)
    pending: list[tuple[int, Reward]] = []
    for k, reward in enumerate(rewards):
        if reward.is_async:
            pending.append((k, reward))
            continue
        try:
            values = _call_sync(reward, kwargs)
        except Exception as exc:  # user code: re-raised naming the rows that broke it
            raise _blame(reward, batch, exc) from exc
        columns[k] = _check_output(reward, values, n)
    if pending:

        async def run_all():
            return await asyncio.gather(*(r.fn(**kwargs, **r.args) for _, r in pending), return_exceptions=True)

        results = asyncio.run(run_all())
        for (k, reward), values in zip(pending, results, strict=True):
            if isinstance(values, BaseException):
                raise _blame(reward, batch, values) from values
            columns[k] = _check_output(reward, values, n)
    return [[columns[k][i] for k in range(len(rewards))] for i in range(n)]  # type: ignore[index]
