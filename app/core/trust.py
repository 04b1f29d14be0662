"""What a run config from an API client may make a worker do: the operator's policy (docs/security.md).

- Code: an import-path reward (``module:function``) must name a function of a module the operator allowlists
  (``Settings.reward_modules``, COLLAGE_REWARD_MODULES); an import-path tool (``module:function``) or environment
  (``module:Class``) one of a module of the separate tool allowlist (``Settings.tool_modules``,
  COLLAGE_TOOL_MODULES). The worker checks again what the import yields.
- Paths: a local model, dataset or reward model must be absolute (or start with ``~``) and lie under the operator's
  roots (COLLAGE_MODEL_ROOTS, COLLAGE_DATA_ROOTS; default COLLAGE_HOME) once ``~``, ``..`` and symlinks are resolved.
  A relative string is a hub id (``org/name``), never a file on the server. Confinement is decided before anything
  is said about existence, and the refusal reads the same whether an outside path exists or not.

Torch-free: the API applies :func:`config_violations` at submit, the worker child again before training.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from collage.app.core.settings import Settings
from collage.training.config import RunConfig
from collage.training.confine import folder_escape
from collage.training.infra.images import resolve_roots
from collage.training.models.families import TINY_FAMILIES
from collage.training.rewards.builtins import BUILTINS
from collage.training.rewards.registry import IMPORT_PATH, import_path_error
from collage.training.tools.registry import tool_import_error, tool_name_error

# \Z, not $ (which also matches before a trailing newline: "org/name\n"); .match then matches the whole value
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*\Z")  # org/name
# a split names a file inside the dataset folder (<split>.jsonl), or a hub split with a slice (train[:10%])
SPLIT = re.compile(r"^\w[\w.\[\]:%+-]*\Z")
LOCAL_PREFIXES = ("/", "~")
# tiny:<family> and synth:<task>, which Collage itself writes under COLLAGE_HOME
TINY, SYNTH = re.compile(r"^tiny:\w[\w-]*\Z"), re.compile(r"^synth:\w[\w-]*\Z")


def is_local(value: str) -> bool:
    """Whether an API value names a path on the server: absolute or ``~`` (a relative string never does)."""
    return value.startswith(LOCAL_PREFIXES)


def is_hub_id(value: str) -> bool:
    return bool(HUB_ID.match(value)) and ".." not in value


def confined(value: str, roots: Sequence[Path]) -> Path | None:
    """``value`` resolved (``~``, ``..``, symlinks) when it lies under one of ``roots``, else None.

    Never reports whether the path exists: a missing path resolves as far as its folders do."""
    try:
        path = Path(value).expanduser().resolve()
        resolved = [Path(root).expanduser().resolve() for root in roots]
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte, an unknown ~user
        return None
    return path if any(path == root or path.is_relative_to(root) for root in resolved) else None


def outside_message(kind: str, env: str, roots: Sequence[Path]) -> str:
    folders = ", ".join(str(r) for r in roots)
    return (
        f"a local {kind} must be an absolute path under {folders}; the operator chooses these folders with {env} "
        "(on the server and on every worker)"
    )


def neither_message(choices: str) -> str:
    return f"neither {choices} nor an absolute local path (a relative path is never read from the server)"


def model_violation(path: str, settings: Settings, kind: str = "model folder") -> str | None:
    """Why a model path from an API client may not be used, or None (``tiny:``, hub ids, folders under the roots
    whose every file stays under them)."""
    if TINY.match(path) or is_hub_id(path):
        return None
    if is_local(path):
        return local_model_violation(path, settings.allowed_model_roots(), kind)
    return neither_message("tiny:<family>, a hub id (org/name)")


def local_model_violation(path: str, roots: Sequence[Path], kind: str = "model folder") -> str | None:
    """Why the local model folder ``path`` may not be loaded, or None: it must lie under ``roots``, and so must
    every file in it (a ``chat_template.jinja`` or ``model.safetensors`` linked to a file outside is refused: the
    model's loader would read it)."""
    folder = confined(path, roots)
    if folder is None:
        return outside_message(kind, "COLLAGE_MODEL_ROOTS", roots)
    if folder.is_dir() and (escape := folder_escape(folder, resolve_roots(roots) or ())) is not None:
        return f"the {kind} {path} {escape} (COLLAGE_MODEL_ROOTS)"
    return None


def dataset_violation(source: str, settings: Settings) -> str | None:
    """Why a dataset source from an API client may not be read, or None (``synth:``, hub ids, paths under the roots)."""
    if SYNTH.match(source) or is_hub_id(source):
        return None
    if is_local(source):
        roots = settings.allowed_data_roots()
        return None if confined(source, roots) else outside_message("dataset", "COLLAGE_DATA_ROOTS", roots)
    return neither_message("synth:<task>, a hub id (org/name)")


def split_violation(split: str) -> str | None:
    if SPLIT.match(split) and ".." not in split:
        return None
    return "a split is a name like train or test[:100], never a path"


def reward_violation(name: str, settings: Settings) -> str | None:
    """Why a reward from an API client may not run on a worker, or None: built-ins, allowlisted import paths and
    text reward model folders under the model roots."""
    if name in BUILTINS:
        return None
    if is_local(name):
        return model_violation(name, settings, kind="reward model folder")
    if ":" in name:
        return import_path_error(name, settings.reward_modules)
    return None  # not a reward at all: app.validation says so


def tool_violation(name: str, settings: Settings) -> str | None:
    """Why a ``tools[k].name`` from an API client may not run on a worker, or None: built-ins and import paths
    inside a module of COLLAGE_TOOL_MODULES (never the standard library or Collage's own stack)."""
    return tool_name_error(name, settings.tool_modules)


def environment_violation(name: str, settings: Settings) -> str | None:
    """Why an ``environment`` from an API client may not be imported on a worker, or None: an import path
    ``package.module:Class`` inside a module of COLLAGE_TOOL_MODULES, as for a tool."""
    if not IMPORT_PATH.match(name):
        return "an environment is an import path 'package.module:Class'"
    return tool_import_error(name, settings.tool_modules)


def config_violations(config: RunConfig, settings: Settings) -> list[tuple[str, str]]:
    """Every ``(key path, message)`` of ``config`` that the operator's policy refuses; empty when it may run.

    The API calls it at submit (through app.validation) and the worker child before it builds the Trainer."""
    errors = []
    if (message := model_violation(config.model.path, settings)) is not None:
        errors.append(("model.path", message))
    if (message := dataset_violation(config.dataset.source, settings)) is not None:
        errors.append(("dataset.source", message))
    if (message := split_violation(config.dataset.split)) is not None:
        errors.append(("dataset.split", message))
    # held-out data is read on the worker exactly like the training data
    if config.dataset.eval_source is not None and (
        (message := dataset_violation(config.dataset.eval_source, settings)) is not None
    ):
        errors.append(("dataset.eval_source", message))
    if config.dataset.eval_split is not None and (message := split_violation(config.dataset.eval_split)) is not None:
        errors.append(("dataset.eval_split", message))
    for k, reward in enumerate(config.rewards):
        if (message := reward_violation(reward.name, settings)) is not None:
            errors.append((f"rewards[{k}].name", message))
    for k, tool in enumerate(config.tools):
        if (message := tool_violation(tool.name, settings)) is not None:
            errors.append((f"tools[{k}].name", message))
    if config.environment is not None and (message := environment_violation(config.environment, settings)) is not None:
        errors.append(("environment", message))
    return errors


def base_model_problem(path: str, settings: Settings) -> str | None:
    """Why a base model path may not be loaded by the playground, or None: ``tiny:<family>``, or an absolute folder
    under COLLAGE_MODEL_ROOTS. A hub id is never downloaded for the playground (nothing outside the roots)."""
    if TINY.match(path):
        family = path.removeprefix("tiny:")
        return (
            None if family in TINY_FAMILIES else f"no tiny model {path!r}: choose tiny:{', tiny:'.join(TINY_FAMILIES)}"
        )
    roots = settings.allowed_model_roots()
    if is_local(path):
        return local_model_violation(path, roots)
    what = "a hub id is not downloaded by the playground" if is_hub_id(path) else "a relative path is never read"
    return f"the playground loads tiny:<family> or an absolute model folder under the operator's roots ({what})"
