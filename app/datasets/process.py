"""The dataset helper: a long-lived child process that answers the launch form's dataset check and preview.

Each check used to start ``collage data check`` afresh, and 25-30 s of a 200-row check went to importing torch,
torchvision and transformers and loading the model's processor again: the rows themselves take about a second.
The web process still never imports the training stack nor opens user files: it starts this module once
(``python -m collage.app.datasets.process``, in an empty folder, lazily or when the launch page opens) and sends it
one JSON request per line on stdin; the answer is one JSON line on stdout. The helper keeps its imports and the
processors it loaded (per model, reloaded when a local model's files change), and exits on its own after
``COLLAGE_DATA_HELPER_IDLE`` seconds without a request (default 600) or when its stdin closes (the web process
ended), giving the memory back.

Requests: ``{"op": "warm", "wait": false}`` (import the stack in the background; answered at once unless
``wait``), ``{"op": "check", "source", "split", "model", "max_prompt_length", "synth": {...}}`` (the ``collage data
check --json`` report), ``{"op": "plan", "config", "processes", "gpu_memory"}`` (the ``collage plan --json``
figures), ``{"op": "preview", "source", "split", "rows", "artifacts", "synth": {...}, "max_images", "max_bytes"}`` (the ``collage data preview`` rows,
images written under ``artifacts``; it reads only the rows it shows and stops at the image and byte bounds).
Both carry ``data_roots``, the folders image paths inside rows must lie under: the web process sends its
Settings' roots and the helper believes nothing else (no roots: no image path is allowed). Answers: ``{"ok":
true, "result": ...}`` or ``{"ok": false, "error": "one line"}``.
"""

from __future__ import annotations

import io
import json
import os
import select
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from collage.training.infra.objectstore import mirror_from_env

if TYPE_CHECKING:
    from collage.training.data.rows import RawRow

_processors: dict[tuple, tuple[Any, Any]] = {}


def _model_key(model: str) -> tuple:
    """The processor cache key: the model string, plus each file's size and mtime for a local folder."""
    folder = Path(model)
    if folder.is_dir():
        files = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(folder.iterdir()) if f.is_file())
        return (model, files)
    return (model,)


def _processor(model: str) -> tuple[Any, Any]:
    from collage.training.models.loading import load_processor

    key = _model_key(model)
    if key not in _processors:
        for old in [k for k in _processors if k[0] == model]:
            del _processors[old]
        try:
            _processors[key] = load_processor(model)
        except Exception as exc:
            message = str(exc)
            raise ValueError(message if message.startswith(model) else f"model {model}: {message}") from exc
    return _processors[key]


def _import_stack() -> None:
    try:
        import torch  # noqa: F401
        import transformers.image_processing_utils  # noqa: F401 - pulls torchvision in, the slowest import
        from transformers import AutoProcessor  # noqa: F401

        import collage.training.batching.encoding
        import collage.training.models.loading  # noqa: F401
    except ImportError as exc:  # a web-only install: a check with a model says so when it is asked for
        print(f"collage data helper: the training stack is not installed ({exc})", file=sys.stderr)


_warming: threading.Thread | None = None


def warm(wait: bool = False) -> dict[str, Any]:
    """Import the training stack in a background thread and answer at once (or, with ``wait``, once it is
    imported): a preview (which needs none of it) is answered meanwhile; a check with a model waits for it
    (:func:`_stack_ready`)."""
    global _warming
    if _warming is None:
        _warming = threading.Thread(target=_import_stack, name="collage-data-warm", daemon=True)
        _warming.start()
    if wait:
        _warming.join()
    return {"warming": _warming.is_alive()}


def _stack_ready() -> None:
    # never import the same modules from two threads at once: wait for the warm-up if one runs
    if _warming is not None:
        _warming.join()


def _roots(req: dict[str, Any]) -> tuple[Path, ...]:
    """The folders image paths of rows must lie under: the web process sends its Settings' data roots with every
    request. Nothing else is believed (not this process's environment): a request without them allows none."""
    return tuple(Path(root) for root in req.get("data_roots") or ())


def _mapping(req: dict[str, Any]) -> Any:
    """The request's column mapping (``columns``, ``prompt_template``, ``system_prompt``: validated by the web
    process already, validated again here) as a RowMapping; None without one."""
    from collage.training.config import DatasetSettings
    from collage.training.data.mapping import RowMapping

    fields = req.get("mapping") or {}
    if not any(fields.values()):
        return None
    return RowMapping.of(DatasetSettings(source=req["source"], **fields))


def check(req: dict[str, Any]) -> dict[str, Any]:
    from collage.training.config import AUTO_FULL_CHECK_ROWS, CHECK_SAMPLE_ROWS
    from collage.training.data.check import cached_check, sampled_check
    from collage.training.data.loader import load_dataset

    source, split = req["source"], req.get("split", "train")
    model, max_prompt_length = req.get("model"), req.get("max_prompt_length")
    if max_prompt_length is not None and model is None:
        raise ValueError("--max-prompt-length needs --model to count the prompt's tokens")
    synth = (req.get("synth") or {}) if source.startswith("synth:") else {}
    dataset = load_dataset(source, split, data_roots=_roots(req), mapping=_mapping(req),
                           config_name=req.get("config_name"), **synth)  # fmt: skip

    def encoder() -> Any:
        if model is None:
            return None
        _stack_ready()
        from collage.training.batching.encoding import PromptEncoder

        processor, family = _processor(model)
        return PromptEncoder(processor, family, max_prompt_length)

    # dataset.check's rule: a split of more than AUTO_FULL_CHECK_ROWS rows is checked by a seeded sample unless
    # the request says full (the launch form sends the config's dataset.check)
    mode = req.get("check") or "auto"
    if mode == "sample" or (mode == "auto" and len(dataset) > AUTO_FULL_CHECK_ROWS):
        seed = int((req.get("synth") or {}).get("seed") or 0)
        return sampled_check(dataset, model, max_prompt_length, encoder(), CHECK_SAMPLE_ROWS, seed).to_dict()
    return cached_check(dataset, model, max_prompt_length, encoder).to_dict()


# what one preview may read unless the request says less (the web app sends its Settings' bounds)
PREVIEW_MAX_IMAGES = 800
PREVIEW_MAX_BYTES = 256 << 20


def preview_rows(
    dataset: Any, limit: int, artifacts: Path, budget: Any = None, notes: list[str] | None = None
) -> list[dict[str, Any]]:
    """The first ``limit`` rows as the preview shows them: the prompt, the other columns (bounded in depth and size,
    :mod:`training.data.display`), each image written to the content-addressed store under ``artifacts``, or the
    row's error. ``collage data preview`` prints the same. With a ``budget`` (a ReadBudget) the preview stops
    before the first row whose images it cannot afford, and says so in ``notes``."""
    from collage.app.store.images import write_image
    from collage.training.data.display import Budget, bounded
    from collage.training.data.errors import RowError
    from collage.training.infra.images import BudgetExhausted

    rows = []
    for raw in dataset.rows[:limit]:
        shown = Budget()
        entry: dict[str, Any] = {"row": raw.row, "prompt": None, "images": [], "error": None}
        entry["columns"] = bounded({k: v for k, v in raw.data.items() if k not in ("prompt", "images", "image")}, shown)
        try:
            sample = raw.to_sample(budget)
        except BudgetExhausted as exc:
            if notes is not None:
                notes.append(
                    f"the preview stops before row {raw.row}: showing it would read {exc} one preview may read "
                    "(the server's COLLAGE_PREVIEW_MAX_IMAGES and COLLAGE_PREVIEW_MAX_BYTES)"
                )
            break
        except RowError as err:
            entry["error"] = err.message
            entry["prompt"] = bounded(raw.data.get("prompt"), shown)
            rows.append(entry)
            continue
        entry["prompt"] = bounded(sample.prompt, shown)
        for image in sample.images:
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            png = buf.getvalue()
            sha, rel = write_image(artifacts, png, mirror=mirror_from_env())
            entry["images"].append(
                {"sha256": sha, "width": image.width, "height": image.height, "size_bytes": len(png), "path": rel}
            )
        rows.append(entry)
    return rows


def preview(req: dict[str, Any]) -> dict[str, Any]:
    from collage.training.data.loader import load_dataset
    from collage.training.infra.images import ReadBudget

    source, split, artifacts = req["source"], req.get("split", "train"), Path(req["artifacts"])
    synth = (req.get("synth") or {}) if source.startswith("synth:") else {}
    limit = int(req.get("rows", 5))
    # only the rows shown are read (a synth:<task> preview generates only them, in memory)
    dataset = load_dataset(source, split, data_roots=_roots(req), limit=limit, mapping=_mapping(req),
                           config_name=req.get("config_name"), **synth)  # fmt: skip
    budget = ReadBudget(
        int(req.get("max_images") or PREVIEW_MAX_IMAGES), int(req.get("max_bytes") or PREVIEW_MAX_BYTES)
    )
    notes: list[str] = []
    rows = preview_rows(dataset, limit, artifacts, budget, notes)
    total = dataset.total if dataset.total is not None else len(dataset)
    names = _column_names(dataset.rows)
    return {"source": source, "rows": rows, "total_rows": total, "note": "; ".join(notes) or None,
            "column_names": names, "guess": guess_columns(names)}  # fmt: skip


def _column_names(rows: Sequence[RawRow]) -> list[str]:
    return list(dict.fromkeys(str(k) for raw in rows for k in raw.data))


def guess_columns(names: list[str]) -> dict[str, Any]:
    from collage.training.data.mapping import guess_columns as guess

    return guess(names)


def probe(req: dict[str, Any]) -> dict[str, Any]:
    """What a run submitted with this dataset would meet first: its column names, and whether any of its first
    ``rows`` rows is usable (decoded and mapped, nothing written). The API refuses a run before it is created when
    a mapped column is missing or no row it read is usable."""
    from collage.training.data.errors import RowError
    from collage.training.data.loader import load_dataset
    from collage.training.infra.images import BudgetExhausted, ReadBudget

    source, split = req["source"], req.get("split", "train")
    limit = int(req.get("rows", 50))
    dataset = load_dataset(source, split, data_roots=_roots(req), limit=limit, mapping=_mapping(req),
                           config_name=req.get("config_name"))  # fmt: skip
    budget = ReadBudget(
        int(req.get("max_images") or PREVIEW_MAX_IMAGES), int(req.get("max_bytes") or PREVIEW_MAX_BYTES)
    )
    errors: list[list[Any]] = []
    usable = read = 0
    for raw in dataset.rows:
        try:
            raw.to_sample(budget)
        except BudgetExhausted:
            break
        except RowError as err:
            errors.append([err.row, err.message])
        else:
            usable += 1
        read += 1
    total = dataset.total if dataset.total is not None else len(dataset)
    return {"column_names": _column_names(dataset.rows), "read": read, "usable": usable, "total_rows": total,
            "errors": errors[:5]}  # fmt: skip


def plan(req: dict[str, Any]) -> dict[str, Any]:
    """``collage plan``'s figures for a run config the web process validated (validated again here)."""
    _stack_ready()
    from collage.training.config import parse_config
    from collage.training.memory_plan import make_plan

    return make_plan(parse_config(req["config"]), req.get("processes"), req.get("gpu_memory")).to_json()


OPS = {"warm": lambda req: warm(bool(req.get("wait"))), "check": check, "preview": preview, "probe": probe,
       "plan": plan}  # fmt: skip


def _one_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) == 1 else "; ".join(line.strip() for line in lines[:21])
    return text or type(exc).__name__


def answer(line: str) -> dict[str, Any]:
    try:
        req = json.loads(line)
        op = OPS.get(req.get("op", "")) if isinstance(req, dict) else None  # no "op": "", which is no op either
        if op is None:
            return {"ok": False, "error": f"unknown request {line[:100]!r}"}
        return {"ok": True, "result": op(req)}
    except Exception as exc:  # noqa: BLE001 - every failure is answered, the helper keeps serving
        return {"ok": False, "error": _one_line(exc)}


def _import_light() -> None:
    """What a preview needs (no torch): imported before any warm-up thread starts."""
    from PIL import Image

    import collage.app.store.images
    import collage.training.data.check
    import collage.training.data.loader
    import collage.training.data.synth  # noqa: F401

    Image.init()  # the image format plugins, imported lazily otherwise


def main() -> int:
    from collage.training.infra.private import private_umask

    private_umask()  # the preview images it writes into the artifacts are private
    from collage.app.core.settings import get_settings

    # the web process hands its environment on: COLLAGE_DATA_HELPER_IDLE is read here, through Settings
    idle = get_settings().data_helper_idle
    _import_light()
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # anything a library prints goes to stderr: stdout carries only answers
    sys.stdout = sys.stderr
    buffer = b""
    while True:
        while b"\n" not in buffer:
            ready, _, _ = select.select([0], [], [], idle)
            if not ready:
                return 0  # idle: give the memory back; the web process starts a new helper when needed
            chunk = os.read(0, 1 << 16)
            if not chunk:
                return 0  # the web process is gone
            buffer += chunk
        line, _, buffer = buffer.partition(b"\n")
        if not line.strip():
            continue
        out.write(json.dumps(answer(line.decode("utf-8", "replace")), default=str) + "\n")
        out.flush()


if __name__ == "__main__":
    sys.exit(main())
