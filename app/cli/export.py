"""``collage export RUN_ID [--step N|best|last] [--merge-lora] --out DIR``: a checkpoint as a plain transformers folder.

``RUN_ID`` is a run of the store (``COLLAGE_DATABASE_URL``; the checkpoint's folder is the path the store records,
which this machine must have: run it where the workers' ``COLLAGE_ARTIFACTS`` is) or the output folder of
``collage train`` (``config.yaml``, ``checkpoints/step-N/``). The export itself is ``training/export.py``'s; this
module finds the checkpoint and says clearly when there is none (exit 2, naming the checkpoints that exist).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from collage.app.store import checkpoints as store
from collage.training.infra.errors import CollageError


def _output_folder(text: str) -> Path | None:
    """``text`` as a ``collage train`` output folder, or None."""
    folder = Path(text).expanduser()
    if folder.is_dir() and ((folder / "config.yaml").is_file() or (folder / "checkpoints").is_dir()):
        return folder
    return None


def _from_folder(folder: Path) -> tuple[list[store.CheckpointEntry], store.BestRule, dict[str, Any], str]:
    import yaml

    try:
        config = yaml.safe_load((folder / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise CollageError(f"{folder}: no readable config.yaml, so the base model is unknown ({exc})") from exc
    entries, rule = store.folder_checkpoints(folder)
    return entries, rule, config if isinstance(config, dict) else {}, f"output folder {folder}"


def _from_store(run_id: str) -> tuple[list[store.CheckpointEntry], store.BestRule, dict[str, Any], str]:
    from sqlmodel import Session

    from collage.app.store.engine import migrated_store
    from collage.app.store.tables import Run

    engine = migrated_store()
    with Session(engine) as session:
        run = session.get(Run, run_id) if len(run_id) <= 32 else None
        if run is None:
            where = engine.url.render_as_string(hide_password=True)
            raise CollageError(
                f"no run {run_id!r} in the store ({where}) and no `collage train` output folder (config.yaml, "
                "checkpoints/) at that path"
            )
        entries = store.run_checkpoints(session, run)
        return entries, store.BestRule.of_config(run.config), dict(run.config), f"run {run.id}"


def _local_checkpoint(recorded: str) -> Path:
    """The checkpoint the store records, on this machine: with object storage the store records it relative to the
    artifacts, and it is downloaded (manifest-checked) into this machine's cache of the bucket when missing."""
    from collage.app.core.settings import get_settings

    settings = get_settings()
    path = Path(recorded) if Path(recorded).is_absolute() else settings.artifacts / recorded
    store.local_checkpoint(path, settings.artifacts, settings.mirror())
    return path


def _missing_checkpoint(step: int, label: str, checkpoint: Path, from_store: bool) -> str:
    """Where a checkpoint was looked for: a bucket is named only when this machine's artifacts are one."""
    from collage.app.core.settings import get_settings

    where = f"checkpoint step {step} of {label} is at {checkpoint}"
    if from_store and get_settings().remote_artifacts:
        return (f"{where}, which is neither on this machine nor in the artifacts' bucket (or is gone): "
                "run collage export with the workers' COLLAGE_ARTIFACTS")  # fmt: skip
    return f"{where}, which is not on this machine (or is gone): run collage export where the workers' COLLAGE_ARTIFACTS is"


def export_command(run: str, step: str, merge_lora: bool, out: str, quiet: bool = False) -> int:
    from collage.training.export import export_checkpoint

    try:
        asked = store.parse_step(step)
    except ValueError as exc:
        raise CollageError(f"--step: {exc}") from exc
    folder = _output_folder(run)
    if folder is None and ("/" in run or Path(run).expanduser().exists()):  # a path, not a run id
        raise CollageError(f"{run}: not a `collage train` output folder (it has no config.yaml or checkpoints/)")
    entries, rule, config, label = _from_folder(folder) if folder is not None else _from_store(run)
    try:
        entry = store.pick(entries, asked, rule, label)
    except store.CheckpointProblem as exc:
        raise CollageError(str(exc)) from exc
    checkpoint = _local_checkpoint(entry.path) if folder is None else Path(entry.path)
    if not (checkpoint / store.MODEL_FOLDER).is_dir():
        raise CollageError(_missing_checkpoint(entry.step, label, checkpoint, from_store=folder is None))
    model = config.get("model")
    if not isinstance(model, dict):
        model = {}
    base = model.get("path") if isinstance(model.get("path"), str) else None
    if not base:
        raise CollageError(f"{label}: its config names no model.path, so the base model is unknown")

    def progress(fraction: float, message: str) -> None:
        if not quiet:
            print(f"export: {fraction:4.0%} {message}", file=sys.stderr, flush=True)

    result = export_checkpoint(
        checkpoint, base, out, merge_lora=merge_lora, progress=progress, dtype=str(model.get("dtype") or "auto")
    )
    what = "LoRA adapter merged into the base model" if result.merged else f"{result.kind} checkpoint"
    print(f"exported step {entry.step} of {label} ({what}, {result.bytes:,} bytes) to {result.path}")
    if result.kind == "adapter" and not result.merged:
        print(
            "the adapter names its base model by its path on this machine (adapter_config.json, "
            "base_model_name_or_path); --merge-lora makes a folder that needs no base",
            file=sys.stderr,
        )
    return 0
