"""Checks of a run config beyond its types: may it run here (app.trust), and do the named rewards, tools, model
and dataset exist?

Torch-free on purpose: the API runs these on its request path. Hub ids cannot be checked offline, so they are
accepted when well formed; a local path must lie under the operator's roots (checked first, so that nothing is
said about paths outside them) and then exist.
"""

from __future__ import annotations

from pathlib import Path

from collage.app.core.settings import Settings, get_settings
from collage.app.core.trust import (
    dataset_violation,
    environment_violation,
    is_local,
    model_violation,
    reward_violation,
    split_violation,
    tool_violation,
)
from collage.training.config import RunConfig
from collage.training.data.loader import split_problem
from collage.training.data.synth import TASKS, Task
from collage.training.models.families import TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS
from collage.training.rewards.registry import IMPORT_PATH

UNKNOWN_REWARD = (
    "built-ins are {builtins}; a user function is 'package.module:function' from a module the operator "
    "allowlists (COLLAGE_REWARD_MODULES); a text reward model is an absolute path to a local checkpoint folder"
)


def check_model(path: str, settings: Settings) -> str | None:
    if path.startswith("tiny:"):
        family = path.removeprefix("tiny:")
        return (
            None
            if family in TINY_FAMILIES
            else f"unknown tiny family {family!r}: choose one of {', '.join(TINY_FAMILIES)}"
        )
    if (message := model_violation(path, settings)) is not None:
        return message
    if is_local(path) and not (Path(path).expanduser() / "config.json").is_file():
        return f"{path} is not a model folder (no config.json)"
    return None


def check_dataset(source: str, min_images: int, max_images: int, settings: Settings) -> str | None:
    if source.startswith("synth:"):
        task = source.removeprefix("synth:")
        if task not in TASKS:
            return f"unknown synthetic task {task!r}: choose one of {', '.join(TASKS)}"
        spec: Task = TASKS[task]
        if max_images < spec.min_needed and not (min_images == 0 and max_images == 0):
            return f"synthetic task {task} needs max_images >= {spec.min_needed}"
        return None
    if (message := dataset_violation(source, settings)) is not None:
        return message
    if is_local(source) and not Path(source).expanduser().exists():
        return f"{source} does not exist"
    return None


def check_reward(name: str, settings: Settings) -> str | None:
    if name in BUILTINS:
        return None
    if (message := reward_violation(name, settings)) is not None:
        return message
    if is_local(name):
        return None if (Path(name).expanduser() / "config.json").is_file() else f"{name} is not a reward model folder"
    if IMPORT_PATH.match(name):
        return None  # allowlisted; imported on the worker, which may have packages this host lacks
    return f"unknown reward {name!r}: " + UNKNOWN_REWARD.format(builtins=", ".join(sorted(BUILTINS)))


def tool_errors(tools: object, environment: object, settings: Settings) -> list[tuple[str, str]]:
    """``tools[k].name`` and ``environment`` against the operator's tool allowlist (COLLAGE_TOOL_MODULES). An
    allowlisted import path is not imported here: the worker imports it (and checks what it finds), and it may have
    packages this host lacks. ``tools`` may be raw JSON (a config that failed type validation): entries without a
    usable name are left to the schema's errors."""
    errors = []
    for k, tool in enumerate(tools if isinstance(tools, list) else []):
        name = tool.get("name") if isinstance(tool, dict) else getattr(tool, "name", None)
        if isinstance(name, str) and (message := tool_violation(name, settings)) is not None:
            errors.append((f"tools[{k}].name", message))
    if isinstance(environment, str) and (message := environment_violation(environment, settings)) is not None:
        errors.append(("environment", message))
    return errors


def semantic_errors(config: RunConfig, settings: Settings | None = None) -> list[tuple[str, str]]:
    """Every ``(key path, message)`` that keeps ``config`` from running; ``settings`` default to the environment's
    (the API passes its app's)."""
    settings = settings or get_settings()
    errors = []
    if (message := check_model(config.model.path, settings)) is not None:
        errors.append(("model.path", message))
    d = config.dataset
    if (message := check_dataset(d.source, d.min_images, d.max_images, settings)) is not None:
        errors.append(("dataset.source", message))
    if (message := split_violation(d.split)) is not None:
        errors.append(("dataset.split", message))
    # held-out data (evaluation) is read on the worker like the training data: the same checks
    if d.eval_source is not None and (message := check_dataset(d.eval_source, d.min_images, d.max_images, settings)):
        errors.append(("dataset.eval_source", message))
    if d.eval_split is not None and (message := split_violation(d.eval_split)) is not None:
        errors.append(("dataset.eval_split", message))
    if not errors:  # every path is allowed and exists: do the splits name files there?
        errors.extend(split_errors(config, settings))
    for k, reward in enumerate(config.rewards):
        if (message := check_reward(reward.name, settings)) is not None:
            errors.append((f"rewards[{k}].name", message))
    errors.extend(tool_errors(config.tools, config.environment, settings))
    return errors


def split_errors(config: RunConfig, settings: Settings) -> list[tuple[str, str]]:
    """The splits of a local dataset folder that name no file there: ``dataset.split`` and ``dataset.eval_split``
    (read from ``eval_source`` when set, else from ``source``), probed from the folder's layout at submit so that
    a wrong held-out split is refused with its field instead of failing the run on the worker."""
    d = config.dataset
    roots = settings.allowed_data_roots()
    probes = [("dataset.split", d.source, d.split)]
    if d.eval_split is not None:
        probes.append(("dataset.eval_split", d.eval_source or d.source, d.eval_split))
    errors = []
    for key, source, split in probes:
        if is_local(source) and (message := split_problem(source, split, data_roots=roots,
                                                          config_name=d.config_name)) is not None:  # fmt: skip
            errors.append((key, message))
    return errors


def raw_semantic_errors(data: object, settings: Settings | None = None) -> list[tuple[str, str]]:
    """The same checks on a config that failed type validation, for the fields whose values are usable, so
    that one answer lists every problem."""
    if not isinstance(data, dict):
        return []
    settings = settings or get_settings()
    errors = []
    model, dataset, rewards = data.get("model"), data.get("dataset"), data.get("rewards")
    model = model if isinstance(model, dict) else {}
    if isinstance(model.get("path"), str) and (message := check_model(model["path"], settings)) is not None:
        errors.append(("model.path", message))
    dataset = dataset if isinstance(dataset, dict) else {}
    if isinstance(dataset.get("source"), str):
        lo, hi = dataset.get("min_images", 0), dataset.get("max_images", 3)
        if (
            isinstance(lo, int)
            and isinstance(hi, int)
            and (message := check_dataset(dataset["source"], lo, hi, settings))
        ):
            errors.append(("dataset.source", message))
    for key in ("split", "eval_split"):
        if isinstance(dataset.get(key), str) and (message := split_violation(dataset[key])) is not None:
            errors.append((f"dataset.{key}", message))
    if isinstance(dataset.get("eval_source"), str) and (message := dataset_violation(dataset["eval_source"], settings)):
        errors.append(("dataset.eval_source", message))
    rewards = rewards if isinstance(rewards, list) else []
    for k, reward in enumerate(rewards):
        name = reward.get("name") if isinstance(reward, dict) else None
        if isinstance(name, str) and (message := check_reward(name, settings)) is not None:
            errors.append((f"rewards[{k}].name", message))
    errors.extend(tool_errors(data.get("tools"), data.get("environment"), settings))
    return errors
