"""Resolve reward specs to callables and score a batch of completions with all of them.

A reward is a built-in name, an import path ``package.module:function`` (sync or ``async def``), or the path
of a text reward model (a sequence-classification checkpoint). ``None`` means "not applicable".

A run config from an API client names code that runs on a worker, so :func:`resolve_reward` takes the operator's
allowlist (``reward_modules``): an import path then resolves only to a plain function defined inside an
allowlisted module (docs/security.md). ``None`` trusts every name, as local ``collage train`` does.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collage.training.infra.errors import InputError, RunError

from .builtins import BUILTINS, completion_text, prompt_text


class RewardError(RunError):
    """A reward function failed; the message names the function, the sample and carries the traceback."""

    def __init__(self, message: str, row: int | None = None, traceback_text: str = ""):
        self.row = row
        self.traceback_text = traceback_text
        super().__init__(message + (f"\n{traceback_text}" if traceback_text else ""))


class UnknownRewardError(InputError):
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


# \Z, not $: `$` also matches before a trailing newline, so "module:func\n" would pass
# (with \Z, .match is a full match for every caller)
IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*\Z")
# Never reward modules, whatever the allowlist says: the standard library and the packages Collage itself runs on,
# whose functions write files, run commands, migrate databases or unpickle (alembic.config:main, os:system, ...).
DENIED_MODULES = frozenset(sys.stdlib_module_names) | {
    "collage", "alembic", "celery", "kombu", "billiard", "uvicorn", "gunicorn", "fastapi", "starlette", "sqlalchemy",
    "sqlmodel", "psycopg", "psycopg2", "redis", "pip", "setuptools", "pkg_resources", "torch", "transformers",
    "accelerate", "peft", "datasets", "huggingface_hub", "numpy", "PIL", "yaml", "pydantic", "jinja2",
}  # fmt: skip
HOW_TO_ALLOW = (
    "the operator allows the functions of a module (and of its submodules) as rewards by listing it in "
    "COLLAGE_REWARD_MODULES (comma-separated) on the server and on every worker"
)


def module_allowed(module: str, allowed: Sequence[str]) -> bool:
    """Whether ``module`` is an allowlisted module or one of its submodules (denied modules never are)."""
    if module.split(".")[0] in DENIED_MODULES:
        return False
    return any(module == entry or module.startswith(entry + ".") for entry in allowed)


def import_path_error(name: str, allowed: Sequence[str]) -> str | None:
    """Why the import path ``module:function`` may not be imported under the allowlist ``allowed``, or None.

    Decided on the name alone, before anything is imported (the API's check at submit, the worker's before import).
    """
    if not IMPORT_PATH.match(name):
        return "an import path is 'package.module:function'"
    module, _, attr = name.partition(":")
    if module.split(".")[0] in DENIED_MODULES:
        return f"module {module!r} never provides rewards (the standard library and Collage's own stack are refused)"
    if attr.startswith("_") or any(part.startswith("_") for part in module.split(".")):
        return "private names (starting with _) are not rewards"
    if not module_allowed(module, allowed):
        return f"module {module!r} is not allowlisted for rewards: {HOW_TO_ALLOW}"
    return None


def reward_function_error(fn: object, allowed: Sequence[str]) -> str | None:
    """Why an imported object is not a reward under the allowlist: it must be a plain (sync or async) function
    defined in an allowlisted module, not a class, builtin, module or a callable another module re-exports."""
    if not inspect.isfunction(fn):
        return f"it is a {type(fn).__name__}, not a function"
    if not module_allowed(fn.__module__ or "", allowed):
        return f"it is defined in {fn.__module__!r}, outside the allowlisted modules"
    return None


def _looks_like_checkpoint(name: str, trusted: bool = True) -> bool:
    if not trusted and not name.startswith(("/", "~")):  # untrusted: never a path relative to the working folder
        return False
    path = Path(name).expanduser()
    return path.is_dir() and (path / "config.json").is_file()


def resolve_reward(
    name: str,
    weight: float = 1.0,
    args: dict[str, Any] | None = None,
    *,
    reward_modules: Sequence[str] | None = None,
    **model_options: Any,
) -> Reward:
    """The reward named ``name``. With ``reward_modules`` (the operator's allowlist; a config from an API client),
    an import path must pass :func:`import_path_error` before the import and :func:`reward_function_error` after;
    ``None`` trusts every name (local ``collage train``)."""
    args = dict(args or {})
    if name in BUILTINS:
        return Reward(name, BUILTINS[name], weight, args)
    trusted = reward_modules is None
    if ":" in name and not _looks_like_checkpoint(name, trusted):
        if reward_modules is not None and (problem := import_path_error(name, reward_modules)) is not None:
            raise UnknownRewardError(f"reward {name!r}: {problem}")
        module_name, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnknownRewardError(f"reward {name!r}: cannot import module {module_name!r} ({exc})") from exc
        fn = getattr(module, attr, None)
        if not callable(fn):
            raise UnknownRewardError(f"reward {name!r}: module {module_name!r} has no function {attr!r}")
        if reward_modules is not None and (problem := reward_function_error(fn, reward_modules)) is not None:
            raise UnknownRewardError(f"reward {name!r}: {problem}")
        return Reward(attr, fn, weight, args, is_async=inspect.iscoroutinefunction(fn))
    if _looks_like_checkpoint(name, trusted):
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
    # a run with tools: each completion's turns (training.tools.types.Turn) and its environment instance (or None)
    trajectories: list[list[Any]] | None = None
    environments: list[Any] | None = None

    def kwargs(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        pick = (lambda xs: [xs[i] for i in indices]) if indices is not None else (lambda xs: list(xs))
        out = {
            "prompts": pick(self.prompts),
            "completions": [[{"role": "assistant", "content": c}] for c in pick(self.completions)],
            "completion_ids": pick(self.completion_ids),
            "images": pick(self.images),
            **{k: pick(v) for k, v in self.columns.items()},
        }
        if self.trajectories is not None:  # only in runs with tools: older reward functions never see new keywords
            out["trajectories"] = pick(self.trajectories)
            out["environments"] = pick(self.environments or [None] * len(self.trajectories))
        return out


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
