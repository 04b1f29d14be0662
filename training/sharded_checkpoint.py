"""Sharded checkpoints of an FSDP2 run: ``checkpoints/step-N/shards/`` holds ``torch.distributed.checkpoint`` files
(each process writes its own shards of the weights and of the optimizer state; no process ever holds the whole
model), ``shards.json`` lists them, and ``model/`` beside them holds the model's config, the processor and (with
LoRA) the adapter's config, but no weights.

DCP reshards on load, so a run resumes with the same or another number of processes (one process included, loading
into an unsharded model), and :func:`consolidate` turns the shards back into the plain folder a DDP checkpoint
holds, for ``collage export``.

Loading stays weights-only. DCP itself unpickles its ``.metadata`` file with plain ``pickle`` and loads any
non-tensor item with ``torch.load(weights_only=False)``: here the metadata goes through an unpickler that builds
only DCP's own metadata classes and plain values, and only tensors are ever written to or read from the shards
(the optimizer's hyper-parameters travel in ``trainer_state.pt``, which the safe unpickler reads).
"""

from __future__ import annotations

import dataclasses
import enum
import io
import json
import pickle
from pathlib import Path
from typing import Any

import torch

from collage.training.infra.errors import InputError

from .checkpoint import CheckpointRefused

SHARDS = "shards"
MANIFEST = "shards.json"
FORMAT = "torch.distributed.checkpoint"


def is_sharded_checkpoint(folder: Path) -> bool:
    return (folder / SHARDS).is_dir()


# ------------------------------------------------------------------------------------------------ safe reading
_PLAIN = {("builtins", n) for n in ("set", "frozenset", "slice", "complex", "bytearray")} | {
    ("collections", "OrderedDict"),
    ("torch", "Size"),
    ("torch", "device"),
    ("pathlib", "PosixPath"),
    ("torch.serialization", "_get_layout"),  # a layout by its name (``torch.strided``)
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and enums, torch sizes, dtypes and layouts; nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), torch.dtype | torch.layout | torch.memory_format
        ):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint."):
            found = super().find_class(module, name)
            if isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)):
                return found
        raise CheckpointRefused(
            f"refused to read these checkpoint shards: their metadata names {module}.{name}, which a "
            "torch.distributed.checkpoint file written by Collage never holds"
        )


def _reader(path: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            raw = Path(self._get_metadata_path(kwargs.get("rank"))).read_bytes()
            metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def _planner() -> Any:
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class TensorsOnly(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise CheckpointRefused(
                f"refused to read {read_item.dest_index.fqn} from these checkpoint shards: Collage writes only "
                "tensors there, and a non-tensor item would be unpickled"
            )

    return TensorsOnly()


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _load(target: dict[str, Any], shards: Path, alone: bool = False) -> None:
    """Read ``target``'s tensors from the shards: every process of the run together, or this one ``alone``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(target, storage_reader=_reader(shards), planner=_planner(), no_dist=alone or not _distributed())
    except CheckpointException as exc:  # DCP wraps each rank's error: a refusal stays a refusal
        causes = [failure[0] for failure in exc.failures.values()]
        for cause in causes:
            if isinstance(cause, CheckpointRefused):
                raise cause from exc
        first = str(causes[0]).strip().splitlines()[0][:300] if causes else str(exc)[:300]
        raise InputError(f"{shards}: the checkpoint shards could not be read: {first}") from exc


# ------------------------------------------------------------------------------------------------ run side
def _options(adapter_only: bool) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a LoRA run keeps only its adapters (the frozen base is the model it started from), as its DDP checkpoints do
    return StateDictOptions(ignore_frozen_params=adapter_only)


def _reference_state(reference: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(reference)


def save_shards(
    folder: Path, model: Any, optimizer: Any, adapter_only: bool, reference: Any = None
) -> list[dict[str, Any]]:
    """Every process writes its shards of the weights and of the optimizer state into ``folder/shards`` (a
    collective: every process calls it); returns the optimizer's parameter groups (plain values) for the trainer
    state. ``optimizer``: the torch optimizer (not accelerate's wrapper)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(adapter_only))
    state: dict[str, Any] = {"model": model_state, "optim": optim_state["state"]}
    if reference is not None:  # a reference that sync_ref_model moves is part of the run's state
        state["reference"] = _reference_state(reference)
    dcp.save(state, storage_writer=FileSystemWriter(str(folder / SHARDS)), no_dist=not _distributed())
    groups: list[dict[str, Any]] = list(optim_state["param_groups"])  # type: ignore[arg-type]  # a list there
    return groups


def load_shards(
    folder: Path,
    model: Any,
    optimizer: Any,
    param_groups: list[dict[str, Any]],
    adapter_only: bool,
    reference: Any = None,
) -> None:
    """Load the shards of ``folder`` into this run's ``model``, ``optimizer`` (and the moved ``reference``, when the
    shards hold one), whatever the number of processes that wrote them (every process calls it)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_options(adapter_only))
    target: dict[str, Any] = {"model": model_state, "optim": optim_state["state"]}
    keys = _reader(folder / SHARDS).read_metadata().state_dict_metadata
    with_reference = reference is not None and any(k.startswith("reference.") for k in keys)
    if with_reference:
        target["reference"] = _reference_state(reference)
    _load(target, folder / SHARDS)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=target["model"],
        optim_state_dict={"state": target["optim"], "param_groups": param_groups},
        options=_options(adapter_only),
    )
    if with_reference:
        set_model_state_dict(reference, target["reference"])


def write_manifest(folder: Path, world: int) -> None:
    """``shards.json``: the format, the number of processes that wrote the shards, and every shard file with its
    size (what an upload must carry and a reader can check before loading)."""
    files = sorted(p for p in (folder / SHARDS).rglob("*") if p.is_file())
    manifest = {
        "format": FORMAT,
        "world": world,
        "files": [{"path": p.relative_to(folder).as_posix(), "bytes": p.stat().st_size} for p in files],
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1), encoding="utf-8")


def check_manifest(folder: Path) -> dict[str, Any]:
    """The manifest, once every file it lists is there with its size (an interrupted copy is named, not loaded)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InputError(f"{folder / MANIFEST}: a sharded checkpoint needs its manifest ({exc})") from exc
    for entry in manifest.get("files", []):
        path = folder / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            raise InputError(f"{path}: listed in the manifest with {entry['bytes']} bytes, but missing or different")
    return manifest


# ------------------------------------------------------------------------------------------------ export side
def _model_tensors(shards: Path) -> dict[str, torch.Tensor]:
    """The whole model's tensors from the shards, in one process (no process group needed)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = _reader(shards).read_metadata()
    target: dict[str, Any] = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            target["model"][key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    _load(target, shards, alone=True)  # the main process alone, while the others wait for it
    return target["model"]


def has_weights(model_dir: Path) -> bool:
    """Whether a checkpoint's ``model/`` holds weights (a sharded checkpoint's holds only configs, unless it was
    written with ``state_dict_type: full``)."""
    return any(model_dir.glob("*.safetensors"))


def with_weights(model_dir: Path, scratch: Path) -> Path:
    """A checkpoint's ``model/`` folder as one that holds its weights: ``model_dir`` itself, or for a sharded
    checkpoint's (configs only) its shards consolidated into ``scratch/model`` (made once; reused after)."""
    folder = model_dir.parent
    if has_weights(model_dir) or not is_sharded_checkpoint(folder):
        return model_dir
    dest = scratch / "model"
    if not (dest / ".complete").is_file():
        import shutil

        shutil.rmtree(dest, ignore_errors=True)
        consolidate(folder, dest)
        (dest / ".complete").write_text("", encoding="utf-8")
    return dest


def consolidate(folder: Path, dest: Path) -> None:
    """Write into ``dest`` the ``model/`` folder a DDP checkpoint of the same run holds: the full model's
    safetensors (built from the config beside the shards) or the LoRA adapter's ``adapter_model.safetensors``."""
    import shutil

    check_manifest(folder)
    shutil.copytree(folder / "model", dest, symlinks=True)
    write_weights(folder, dest)


def write_weights(folder: Path, dest: Path) -> None:
    """The weights of the shards in ``folder``, gathered in this process, written into the model folder ``dest``
    (which holds the model's or the adapter's config)."""
    tensors = _model_tensors(folder / SHARDS)
    if (dest / "adapter_config.json").is_file():
        from safetensors.torch import save_file

        # peft's file leaves the adapter's name out of the key (``lora_A.default.weight`` -> ``lora_A.weight``)
        adapter = {k.replace(".default.", "."): v.contiguous() for k, v in tensors.items()}
        save_file(adapter, str(dest / "adapter_model.safetensors"), metadata={"format": "pt"})
        return
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(dest)
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    model = AutoModelForImageTextToText.from_config(config, dtype=dtypes.pop() if len(dtypes) == 1 else None)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise InputError(
            f"{folder}: the shards do not match the model (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.save_pretrained(dest)
