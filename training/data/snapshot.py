"""The data files of a local snapshot of a Hub dataset repository (``huggingface-cli download --repo-type dataset``,
``git clone``), for a configuration and a split, found the way the Hub finds them.

- With a ``README.md`` whose YAML front matter has ``configs:``, the configuration named ``config_name`` (or the
  one marked ``default: true``, or ``default``, or the only one) gives each split's ``data_files`` patterns,
  relative to the snapshot's folder.
- Without ``configs:``, the Hub's own layout: ``data/<split>-*.parquet`` (``data/train-00000-of-00001.parquet``),
  ``data/<split>.<ext>``, or ``<config_name>/`` holding the same.

Patterns never leave the snapshot's folder. Torch-free.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from collage.training.infra.errors import InputError

DATA_SUFFIXES = (".parquet", ".jsonl", ".json", ".csv")


class SnapshotError(InputError):
    pass


def front_matter(readme: Path) -> dict[str, Any]:
    """The YAML between the first two ``---`` lines of a dataset card ({} when there is none or it is not YAML)."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    if end < 0:
        return {}
    try:
        data = yaml.safe_load(text[3:end])
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def configs_of(folder: Path) -> list[dict[str, Any]]:
    configs = front_matter(folder / "README.md").get("configs")
    return [c for c in configs if isinstance(c, dict)] if isinstance(configs, list) else []


def config_names(folder: Path) -> list[str]:
    """The configurations a snapshot's card declares (for the launch form and error messages)."""
    return [str(c.get("config_name", "default")) for c in configs_of(folder)]


def _pick_config(folder: Path, configs: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    names = [str(c.get("config_name", "default")) for c in configs]
    if name is not None:
        if name not in names:
            raise SnapshotError(
                f"{folder}: no configuration {name!r} in its README.md (configurations: {', '.join(names)})"
            )
        return configs[names.index(name)]
    marked = [c for c in configs if c.get("default") is True]
    if marked:
        return marked[0]
    if "default" in names:
        return configs[names.index("default")]
    if len(configs) == 1:
        return configs[0]
    raise SnapshotError(
        f"{folder}: its README.md declares several configurations ({', '.join(names)}): choose one with "
        "dataset.config_name"
    )


def _split_patterns(config: dict[str, Any], split: str, folder: Path) -> list[str]:
    data_files = config.get("data_files")
    if isinstance(data_files, (str, list)) and not (
        isinstance(data_files, list) and data_files and isinstance(data_files[0], dict)
    ):
        patterns = [data_files] if isinstance(data_files, str) else [str(p) for p in data_files]
        by_split = {"train": patterns}  # plain data_files: one split, train (the Hub's rule)
    elif isinstance(data_files, list):
        by_split = {}
        for entry in data_files:
            if isinstance(entry, dict) and "split" in entry and "path" in entry:
                path = entry["path"]
                by_split.setdefault(str(entry["split"]), []).extend([path] if isinstance(path, str) else list(path))
    else:
        by_split = {}
    if split not in by_split:
        name = config.get("config_name", "default")
        raise SnapshotError(
            f"{folder}: configuration {name!r} has no split {split!r} (splits: {', '.join(by_split) or 'none'})"
        )
    return by_split[split]


def _glob(folder: Path, pattern: str) -> list[Path]:
    if Path(pattern).is_absolute() or ".." in Path(pattern).parts:
        raise SnapshotError(f"{folder}: data file pattern {pattern!r} leaves the snapshot's folder")
    root = folder.resolve()
    found = []
    for path in sorted(folder.glob(pattern)):
        if path.is_file() and path.suffix in DATA_SUFFIXES and path.resolve().is_relative_to(root):
            found.append(path)
    return found


def snapshot_files(folder: Path, split: str, config_name: str | None = None) -> list[Path] | None:
    """The data files of ``split`` (in order), or None when ``folder`` is not laid out like a Hub snapshot (a plain
    folder of ``<split>.jsonl`` files is read by the loader's own rule)."""
    configs = configs_of(folder)
    if configs:
        config = _pick_config(folder, configs, config_name)
        files = [f for pattern in _split_patterns(config, split, folder) for f in _glob(folder, pattern)]
        if not files:
            raise SnapshotError(
                f"{folder}: no data file matches split {split!r} of configuration {config.get('config_name', 'default')!r}"
            )
        return list(dict.fromkeys(files))
    base = folder / config_name if config_name is not None else folder / "data"
    if config_name is not None and not base.is_dir():
        raise SnapshotError(
            f"{folder}: no configuration {config_name!r} (no README.md configs and no {config_name}/ folder)"
        )
    if not base.is_dir():
        return None
    for pattern in (f"{split}-*", f"{split}.*", f"{split}/*"):
        files = _glob(base, pattern)
        if files:
            return files
    splits = sorted({p.name.split("-")[0].split(".")[0] for p in base.iterdir() if p.suffix in DATA_SUFFIXES})
    raise SnapshotError(f"{base}: no data file for split {split!r} (splits here: {', '.join(splits) or 'none'})")
