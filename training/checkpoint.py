"""Checkpoints: model (or LoRA adapter) + optimizer + scheduler + RNG + trainer state, written atomically.

The trainer state is read back with ``torch.load(weights_only=True)``: an unpickler that builds tensors,
containers and plain values and, beyond those, only the few types listed in :data:`SAFE_GLOBALS` (the generation
buffer's dataclasses, numpy's RNG state, rollout images as raw pixels). A ``trainer_state.pt`` that names
anything else (a pickle that would run code) is refused with :class:`CheckpointRefused`, before any of it runs.
Checkpoint folders are 0700 and their files 0600, whatever the process's umask.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from collage.training.infra.diskspace import DiskFull, full_disk_error, space_or_none
from collage.training.infra.errors import InputError
from collage.training.infra.private import private_dir, private_tree

# the retention choice (pure, torch-free: the API marks the best checkpoint with it), beside the folder side below
from .retention import best_checkpoint as best_checkpoint
from .retention import checkpoints_to_remove as checkpoints_to_remove

STATE_FILE = "trainer_state.pt"
INFO_FILE = "checkpoint.json"  # step, kind, model bytes, metric: readable without torch
FULL_BELOW = 1 << 20  # a write that failed with less than this left on its file system failed for lack of space


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dir(out: Path, step: int) -> Path:
    return out / "checkpoints" / f"step-{step}"


def list_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``out/checkpoints/``, oldest first, as ``(step, folder)``: real folders and the
    links a resumed worker attempt makes to an earlier attempt's checkpoints (a link whose folder is gone, or a
    folder a crash left without its trainer state, is not a checkpoint)."""
    folder = out / "checkpoints"
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = re.fullmatch(r"step-(\d+)", child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def latest_checkpoint(out: Path) -> Path | None:
    found = list_checkpoints(out)
    return found[-1][1] if found else None


def checkpoints_up_to(newest: Path) -> list[Path]:
    """Every checkpoint of the run folder that holds ``newest`` (its own and those it links to), up to ``newest``'s
    step, as real folders, oldest first, ``newest`` last. A resumed attempt links them all, so that
    ``train.save_total_limit`` counts and removes an earlier attempt's checkpoints too; a checkpoint past ``newest``
    was never recorded as written (a crash came first) and is left out, as resume leaves it out."""
    match = re.fullmatch(r"step-(\d+)", newest.name)
    if match is None:
        return [newest]
    last = int(match.group(1))
    found = [path.resolve() for step, path in list_checkpoints(newest.parent.parent) if step < last]
    return [*found, newest.resolve()]


def remove_checkpoint(path: Path) -> Path:
    """Delete the checkpoint ``path`` and return the folder that held it: a link an attempt made to an earlier
    attempt's checkpoint goes with that folder (the link last, so a crash in between leaves a dangling link, which
    is no checkpoint, rather than an unlisted folder)."""
    if path.is_symlink():
        target = path.resolve()
        shutil.rmtree(target, ignore_errors=True)
        path.unlink(missing_ok=True)
        return target
    shutil.rmtree(path, ignore_errors=True)
    return path


# ------------------------------------------------------------------------------------------------- writing
def _image_from_pixels(mode: str, size: tuple[int, int], pixels: bytes, palette: list[int] | None) -> Image.Image:
    """A rollout image as a checkpoint stores it: raw pixels (no file format, no plugin, no metadata)."""
    image = Image.frombytes(mode, size, pixels)
    if palette:
        image.putpalette(palette)
    return image


class _StatePickler(pickle.Pickler):
    """Pickles a PIL image (a rollout row's, in the generation buffer) as its raw pixels, so loading it needs
    nothing but :func:`_image_from_pixels` (instead of a PIL plugin class and its metadata)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Image.Image):
            return _image_from_pixels, (obj.mode, obj.size, obj.tobytes(), obj.getpalette())
        return NotImplemented


class _PickleModule:
    """``torch.save``'s ``pickle_module``: the standard pickle, with :class:`_StatePickler`."""

    Pickler = _StatePickler
    Unpickler = pickle.Unpickler
    dump, dumps, load, loads = pickle.dump, pickle.dumps, pickle.load, pickle.loads


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def read_info(path: Path) -> dict[str, Any] | None:
    """A checkpoint's ``checkpoint.json`` (step, kind, bytes, metric), or None for one written before it existed."""
    try:
        data = json.loads((path / INFO_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def staging_dir(out: Path, step: int, fresh: bool = True) -> Path:
    """The temporary folder the checkpoint of ``step`` is written into before it is renamed into place (emptied
    first with ``fresh``)."""
    final = checkpoint_dir(out, step)
    tmp = final.with_name(final.name + ".tmp")
    if fresh:
        shutil.rmtree(tmp, ignore_errors=True)
    private_dir(final.parent)
    private_dir(tmp)
    return tmp


def shards_failed(exc: BaseException, final: Path) -> BaseException:
    """What a failed write of a sharded checkpoint's shards raises: :class:`DiskFull` naming the checkpoint and the
    space left when the disk filled up (``torch.distributed.checkpoint`` wraps the ENOSPC of whichever process hit
    it in its own exception, on every process, and torch's own writer words it "unexpected pos"), else ``exc``
    itself. Every process measures the space while the partial shards still fill the disk: the caller removes the
    staging folder only once all of them have."""
    left = space_or_none(final.parent)
    if full_disk_error(exc) is not None or (left is not None and left.free < FULL_BELOW):
        return DiskFull(final, "writing the checkpoint", left)
    return exc


def save_checkpoint(
    out: Path,
    step: int,
    model: Any,
    processor: Any,
    state: dict[str, Any],
    rank_rng: list[dict[str, Any]],
    kind: str = "full",
    metric: tuple[str, float | None] | None = None,
    staged: bool = False,
) -> tuple[Path, int]:
    """Write ``checkpoints/step-<step>/`` via a temporary folder, so a crash never leaves half a checkpoint; returns
    the folder and the size of its ``model/`` (what a download or export moves). ``checkpoint.json`` beside it says
    what it is (``kind``: ``adapter`` or ``full``; ``metric``: ``(train.metric_for_best_model, value)``).

    A write that fails removes the temporary folder; one that failed because the disk is full raises
    :class:`DiskFull` naming the checkpoint and the space left. ``staged``: the temporary folder already holds what
    every process wrote into it (a sharded checkpoint's shards, :func:`staging_dir`)."""
    final = checkpoint_dir(out, step)
    tmp = staging_dir(out, step, fresh=not staged)
    try:
        model.save_pretrained(tmp / "model")
        processor.save_pretrained(tmp / "model")
        # through a Python file: a full disk is then an OSError (ENOSPC), not torch's "iostream error"
        with open(tmp / STATE_FILE, "wb") as fh:
            torch.save({**state, "rng": rank_rng}, fh, pickle_module=_PickleModule)
        size = folder_bytes(tmp / "model")
        info: dict[str, Any] = {"step": step, "kind": kind, "bytes": size, "metric": None, "metric_value": None}
        if metric is not None:
            name, value = metric
            info["metric"] = name
            info["metric_value"] = None if value is None or math.isnan(value) else float(value)  # JSON has no NaN
        (tmp / INFO_FILE).write_text(json.dumps(info), encoding="utf-8")
        private_tree(tmp)  # what transformers and safetensors wrote follows the umask; the checkpoint does not
    except BaseException as exc:
        left = space_or_none(final.parent)  # before the partial folder is removed: the space the write found
        shutil.rmtree(tmp, ignore_errors=True)
        if full_disk_error(exc) is not None or (left is not None and left.free < FULL_BELOW):
            raise DiskFull(final, "writing the checkpoint", left) from exc
        raise
    if final.is_symlink():
        # a resumed attempt rewriting the step it resumed from: the link to the earlier attempt's folder goes, that
        # folder stays as it was (an attempt never writes into another's folder)
        final.unlink()
    elif final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final, size


# ------------------------------------------------------------------------------------------------- reading
class CheckpointRefused(InputError):
    """A checkpoint's trainer state holds something a Collage checkpoint never holds."""


class _PickledImage(Image.Image):
    """Stands in, when loading, for the PIL image classes a checkpoint written before rollout images were stored
    as raw pixels may name: it restores the pickled pixels (``Image.__setstate__``: mode, size, palette, raw
    bytes) and nothing else; called with arguments it raises, so a pickle cannot make it open a file."""

    def __init__(self) -> None:
        super().__init__()

    def __setstate__(self, state: list[Any]) -> None:
        Image.Image.__setstate__(self, list(state[:5]))


# the raster formats Collage reads (what PIL.Image.open gave an older checkpoint's rollout images)
_LEGACY_IMAGE_CLASSES = (
    "PIL.Image.Image",
    "PIL.PngImagePlugin.PngImageFile",
    "PIL.JpegImagePlugin.JpegImageFile",
    "PIL.MpoImagePlugin.MpoImageFile",
    "PIL.WebPImagePlugin.WebPImageFile",
    "PIL.GifImagePlugin.GifImageFile",
    "PIL.BmpImagePlugin.BmpImageFile",
    "PIL.TiffImagePlugin.TiffImageFile",
)


def _safe_globals() -> list[Any]:
    """Everything a trainer state holds beyond tensors, containers and plain values (imported when a state is
    read: the batch classes pull in torch-side modules a light import of this one does not need)."""
    from .batching.batch import ModelBatch
    from .callbacks import RolloutImage, RolloutRow
    from .generation_batch import GenerationBatch  # pickled under collage.training.trainer (see that module)

    reconstruct = importlib.import_module("numpy._core.multiarray")._reconstruct  # how numpy 2 pickles an array

    numpy_state = [  # np.random.get_state(): ("MT19937", uint32 array, pos, has_gauss, cached_gaussian)
        reconstruct,
        np.ndarray,
        np.dtype,
        np.dtypes.UInt32DType,
    ]
    images = [_image_from_pixels, *((_PickledImage, name) for name in _LEGACY_IMAGE_CLASSES)]
    # a checkpoint written before training.batching.inputs was split names the batch class by its old module
    legacy_batch = (ModelBatch, "collage.training.batching.inputs.ModelBatch")
    return [*numpy_state, GenerationBatch, ModelBatch, legacy_batch, RolloutRow, RolloutImage, *images]


def load_state(path: Path) -> dict[str, Any]:
    """The trainer state of the checkpoint folder ``path``; :class:`CheckpointRefused` if it holds anything
    else (nothing of such a file is run: the unpickler refuses it before building it)."""
    file = path / STATE_FILE
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointRefused(
            f"{file}: refused to load this checkpoint: it holds something a Collage checkpoint never holds, so it "
            f"was not written by Collage or was changed since ({first[:300]})"
        ) from exc


def load_model_weights(model: Any, path: Path, uses_lora: bool) -> None:
    """Load the checkpoint's weights into ``model`` (already built and wrapped the same way)."""
    folder = path / "model"
    if uses_lora:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        return
    from transformers import AutoModelForImageTextToText

    # through from_pretrained, so transformers maps its on-disk key names back to the module names
    dtype = next(model.parameters()).dtype
    saved = AutoModelForImageTextToText.from_pretrained(folder, dtype=dtype)
    missing, unexpected = model.load_state_dict(saved.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"{folder}: checkpoint does not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
