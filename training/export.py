"""A checkpoint as a plain transformers folder (``collage export``, the dashboard's export job).

What comes out loads with ``AutoModelForImageTextToText.from_pretrained(out)`` and ``AutoProcessor.from_pretrained(out)``
and generates:

- a **full** checkpoint: its model folder as saved (weights as safetensors, ``config.json``,
  ``generation_config.json``, the processor's files and chat template);
- a **LoRA adapter** checkpoint: the adapter folder (``adapter_config.json``, ``adapter_model.safetensors``, the
  processor's files, ``generation_config.json``) whose ``adapter_config.json`` names the base model by its resolved
  path (``tiny:<family>`` becomes its folder under ``COLLAGE_HOME``), so that transformers with peft installed loads
  the base and applies the adapter. It has no ``config.json``: with one, transformers would take the folder for a
  complete model. The base must exist at that path (or hub id) wherever the folder is loaded;
- with ``merge_lora``, the adapter merged into the base weights (peft's ``merge_and_unload``), saved as a full model.

Every export is verified before it is handed over (the processor and the model load from the written folder) and is
written into a temporary folder beside ``out`` that is renamed into place once complete: an interrupted or failed
export leaves nothing at ``out``. An ``out`` that exists and is not empty is refused. The checkpoint's model folder
must hold only files and folders: a symbolic link (which could make the export copy a file from elsewhere) or a
device is refused.

Importing this module loads no torch; :func:`export_checkpoint` does.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from collage.training.infra.errors import InputError

MODEL_FOLDER = "model"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, "adapter_model.safetensors", "adapter_model.bin")
PEFT_CARD = "README.md"  # peft's model card of the adapter; it names the base as the checkpoint knew it

Progress = Callable[[float, str], None]


class ExportError(InputError):
    """An export that cannot be made: the message says which file or choice and why."""


@dataclass(frozen=True)
class ExportResult:
    path: Path
    kind: str  # the checkpoint's: "adapter" | "full"
    merged: bool
    bytes: int


def plain_files(folder: Path) -> list[Path]:
    """The files under ``folder`` (relative paths); :class:`ExportError` for a link or anything but a file or
    folder."""
    found: list[Path] = []
    for here, dirs, files in os.walk(folder):
        for name in sorted(dirs + files):
            path = Path(here) / name
            mode = os.lstat(path).st_mode
            inside = path.relative_to(folder)
            if stat.S_ISLNK(mode):
                raise ExportError(f"{folder}: {inside} is a symbolic link; a checkpoint holds only its own files")
            if stat.S_ISREG(mode):
                found.append(inside)
            elif not stat.S_ISDIR(mode):
                raise ExportError(f"{folder}: {inside} is not a regular file or folder")
    return sorted(found)


def checkpoint_kind(model_dir: Path) -> str:
    if (model_dir / ADAPTER_CONFIG).is_file():
        return "adapter"
    if (model_dir / "config.json").is_file():
        return "full"
    raise ExportError(f"{model_dir}: neither a model (config.json) nor a LoRA adapter ({ADAPTER_CONFIG})")


def _check_out(out: Path) -> None:
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise ExportError(f"--out {out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        raise ExportError(f"--out {out}: the folder exists and is not empty; choose a new or empty folder")


def _copy(model_dir: Path, dest: Path, skip: tuple[str, ...] = ()) -> None:
    for inside in plain_files(model_dir):
        if inside.as_posix() in skip:
            continue
        target = dest / inside
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_dir / inside, target)


def export_checkpoint(
    checkpoint_folder: str | Path,
    base_model: str,
    out_dir: str | Path,
    merge_lora: bool = False,
    progress: Progress | None = None,
    dtype: str = "auto",
) -> ExportResult:
    """Export the checkpoint folder ``checkpoint_folder`` (``.../checkpoints/step-N``, its ``model/`` inside) of a run
    whose ``model.path`` is ``base_model`` into ``out_dir``. ``progress(fraction, message)`` is told how far it is
    (it may raise to stop the export, which then leaves nothing behind)."""
    say = progress or (lambda fraction, message: None)
    folder = Path(checkpoint_folder)
    model_dir = folder / MODEL_FOLDER
    if not model_dir.is_dir() or model_dir.is_symlink():
        raise ExportError(f"{folder}: not a checkpoint folder (no {MODEL_FOLDER}/ folder inside)")
    out = Path(out_dir)
    _check_out(out)
    say(0.02, "reading the checkpoint")
    plain_files(model_dir)  # refuse links before anything reads a file
    kind = checkpoint_kind(model_dir)
    scratch = out.parent / f".{out.name}.shards-{uuid.uuid4().hex[:8]}"
    if merge_lora and kind != "adapter":
        raise ExportError(f"{folder}: a full model checkpoint has no LoRA adapter to merge (drop --merge-lora)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        from .sharded_checkpoint import has_weights, is_sharded_checkpoint, with_weights

        if is_sharded_checkpoint(folder) and not has_weights(model_dir):
            say(0.05, "gathering the shards")
        model_dir = with_weights(model_dir, scratch)  # a sharded checkpoint: its shards as one model first
        if kind == "full":
            say(0.1, "copying the model")
            _copy(model_dir, tmp)
        elif merge_lora:
            _merge(model_dir, base_model, tmp, dtype, say)
        else:
            say(0.1, "copying the adapter")
            _adapter(model_dir, base_model, tmp)
        say(0.8, "checking that the export loads")
        _verify(tmp, dtype)
        from collage.training.infra.private import private_tree

        private_tree(tmp)
        size = sum((tmp / f).stat().st_size for f in plain_files(tmp))
        if out.is_dir():
            out.rmdir()  # empty (checked above): the complete export takes its place
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    say(1.0, "exported")
    return ExportResult(out, kind, merge_lora, size)


def _base_folder(base_model: str) -> str:
    """``tiny:<family>`` as its folder; a local folder resolved (absolute); a hub id as it is."""
    from .models.loading import resolve_model_path

    path = resolve_model_path(base_model)
    return str(Path(path).expanduser().resolve()) if path.startswith(("/", "~")) else path


def _generation_config(base: str, dest: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    try:
        generation = GenerationConfig.from_pretrained(base)
    except OSError:  # a base without generation_config.json: the defaults its model config implies
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(base))
    generation.save_pretrained(dest)


def _adapter(model_dir: Path, base_model: str, dest: Path) -> None:
    base = _base_folder(base_model)
    _copy(model_dir, dest, skip=(PEFT_CARD,))
    config_file = dest / ADAPTER_CONFIG
    try:
        adapter = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ExportError(f"{model_dir / ADAPTER_CONFIG}: not valid JSON ({exc})") from exc
    if not isinstance(adapter, dict):
        raise ExportError(f"{model_dir / ADAPTER_CONFIG}: not a JSON object")
    adapter["base_model_name_or_path"] = base  # where this machine has the base; see the module's note
    config_file.write_text(json.dumps(adapter, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    _generation_config(base, dest)


def _merge(model_dir: Path, base_model: str, dest: Path, dtype: str, say: Progress) -> None:
    from peft import PeftModel

    from .models.loading import load_model

    say(0.1, "loading the base model")
    base = load_model(base_model, dtype)
    say(0.35, "applying the adapter")
    merged = PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()
    say(0.5, "saving the merged model")
    merged.save_pretrained(dest, safe_serialization=True)
    del merged, base
    # the processor, tokenizer and chat template as the checkpoint saved them
    _copy(model_dir, dest, skip=(*ADAPTER_FILES, PEFT_CARD))
    if not (dest / "generation_config.json").is_file():
        _generation_config(_base_folder(base_model), dest)


def _verify(folder: Path, dtype: str) -> None:
    """The processor and the model load from ``folder`` as a user will load them."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from .models.loading import check_processor

    try:
        check_processor(AutoProcessor.from_pretrained(folder), str(folder))
        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, "auto")
        AutoModelForImageTextToText.from_pretrained(folder, dtype=torch_dtype)
    except (OSError, ValueError, ImportError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"the export does not load with transformers: {first[:500]}") from exc
