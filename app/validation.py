"""Checks of a run config beyond its types: do the named rewards, model and dataset exist?

Torch-free on purpose: the API runs these on its request path. Hub ids cannot be checked offline, so they are
accepted when well formed; anything that looks like a local path must exist.
"""

from __future__ import annotations

import re
from pathlib import Path

from collage.training.config import RunConfig
from collage.training.data.synth import TASKS, Task
from collage.training.models.families import TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
IMPORT_PATH = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$")


def _looks_local(value: str) -> bool:
    return value.startswith(("/", ".", "~")) or Path(value).expanduser().exists()


def check_model(path: str) -> str | None:
    if path.startswith("tiny:"):
        family = path.removeprefix("tiny:")
        return (
            None
            if family in TINY_FAMILIES
            else f"unknown tiny family {family!r}: choose one of {', '.join(TINY_FAMILIES)}"
        )
    if _looks_local(path):
        folder = Path(path).expanduser()
        if not (folder / "config.json").is_file():
            return f"{path} is not a model folder (no config.json)"
        return None
    return None if HUB_ID.match(path) else f"{path!r} is neither tiny:<family>, a local model folder nor a hub id"


def check_dataset(source: str, min_images: int, max_images: int) -> str | None:
    if source.startswith("synth:"):
        task = source.removeprefix("synth:")
        if task not in TASKS:
            return f"unknown synthetic task {task!r}: choose one of {', '.join(TASKS)}"
        spec: Task = TASKS[task]
        if max_images < spec.min_needed and not (min_images == 0 and max_images == 0):
            return f"synthetic task {task} needs max_images >= {spec.min_needed}"
        return None
    if _looks_local(source):
        return None if Path(source).expanduser().exists() else f"{source} does not exist"
    return None if HUB_ID.match(source) else f"{source!r} is neither synth:<task>, a local path nor a hub id"


def check_reward(name: str) -> str | None:
    if name in BUILTINS:
        return None
    if _looks_local(name):
        return None if (Path(name).expanduser() / "config.json").is_file() else f"{name} is not a reward model folder"
    if IMPORT_PATH.match(name):
        return None  # imported on the worker, which may have packages this host lacks
    return (
        f"unknown reward {name!r}: built-ins are {', '.join(sorted(BUILTINS))}; a user function is "
        "'package.module:function'; a text reward model is a local checkpoint folder"
    )


def semantic_errors(config: RunConfig) -> list[tuple[str, str]]:
    errors = []
    if (message := check_model(config.model.path)) is not None:
        errors.append(("model.path", message))
    d = config.dataset
    if (message := check_dataset(d.source, d.min_images, d.max_images)) is not None:
        errors.append(("dataset.source", message))
    for k, reward in enumerate(config.rewards):
        if (message := check_reward(reward.name)) is not None:
            errors.append((f"rewards[{k}].name", message))
    return errors


def raw_semantic_errors(data: object) -> list[tuple[str, str]]:
    """The same checks on a config that failed type validation, for the fields whose values are usable, so
    that one answer lists every problem."""
    if not isinstance(data, dict):
        return []
    errors = []
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if isinstance(model.get("path"), str) and (message := check_model(model["path"])) is not None:
        errors.append(("model.path", message))
    dataset = data.get("dataset") if isinstance(data.get("dataset"), dict) else {}
    if isinstance(dataset.get("source"), str):
        lo, hi = dataset.get("min_images", 0), dataset.get("max_images", 3)
        if isinstance(lo, int) and isinstance(hi, int) and (message := check_dataset(dataset["source"], lo, hi)):
            errors.append(("dataset.source", message))
    rewards = data.get("rewards") if isinstance(data.get("rewards"), list) else []
    for k, reward in enumerate(rewards):
        name = reward.get("name") if isinstance(reward, dict) else None
        if isinstance(name, str) and (message := check_reward(name)) is not None:
            errors.append((f"rewards[{k}].name", message))
    return errors
