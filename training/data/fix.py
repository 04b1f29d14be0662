"""``collage data check --fix OUT``: a corrected copy of a dataset in Collage's own shape.

Every usable row is written to ``OUT/<split>.jsonl`` with its prompt as a conversation (the column mapping and
template applied, one image placeholder per image), its images as RGB PNG files under ``OUT/images/`` named by
their SHA-256 (converted and turned upright as the processor would take them), and its other columns as they
were (``answer`` included). The rows the check refused are left out and listed in ``OUT/bad_rows.jsonl`` with
their row number and the reason; a column whose value JSON cannot hold (bytes) is named, never silently dropped.
The copy loads with no mapping at all.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collage.training.infra.errors import InputError

from .errors import RowError
from .loader import LoadedDataset


class FixError(InputError):
    pass


@dataclass
class FixResult:
    file: Path
    written: int = 0
    bad: list[RowError] = field(default_factory=list)
    unwritable_columns: dict[str, str] = field(default_factory=dict)  # column -> why it was left out


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _png(image: Any) -> tuple[str, bytes]:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    data = buffer.getvalue()
    return hashlib.sha256(data).hexdigest(), data


def write_fixed(dataset: LoadedDataset, out: Path) -> FixResult:
    """Write the corrected copy of ``dataset`` to ``out`` (a new or empty folder)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FixError(f"--fix {out}: the folder exists and is not empty; name a new folder")
    result = FixResult(out / f"{dataset.split}.jsonl")
    try:
        _write(dataset, out, result)
    except OSError as exc:  # a full disk, a read-only folder: one line naming the file, no half-written copy
        shutil.rmtree(out, ignore_errors=True)  # it was new or empty: everything in it is this copy's
        where = exc.filename or out
        raise FixError(f"--fix {out}: could not write {where}: {exc.strerror or exc}") from exc
    return result


def _write(dataset: LoadedDataset, out: Path, result: FixResult) -> None:
    (out / "images").mkdir(parents=True, exist_ok=True)
    tmp = result.file.with_suffix(f".{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for item in dataset.samples():
            if isinstance(item, RowError):
                result.bad.append(item)
                continue
            names = []
            for image in item.images:
                sha, data = _png(image)
                name = f"images/{sha}.png"
                if not (out / name).exists():
                    (out / name).write_bytes(data)
                names.append(name)
            row: dict[str, Any] = {"prompt": item.prompt, "images": names}
            for column, value in item.columns.items():
                if _jsonable(value):
                    row[column] = value
                else:
                    result.unwritable_columns.setdefault(column, f"holds {type(value).__name__}, which JSON cannot")
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
            result.written += 1
    tmp.replace(result.file)
    with (out / "bad_rows.jsonl").open("w", encoding="utf-8") as fh:
        for error in result.bad:
            fh.write(json.dumps({"row": error.row, "message": error.message}, ensure_ascii=False) + "\n")
