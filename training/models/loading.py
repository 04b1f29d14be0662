"""Load a vision-language model and its processor from ``tiny:<family>``, a local folder or a hub id.

One code path for all three, so what the tests exercise on tiny models is what users run on real ones.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from collage.training.infra.errors import RunError
from collage.training.infra.home import cache_dir

from .families import Family, UnsupportedModelError, family_for_model_type
from .tiny import BUILDERS, build_tiny

TINY_PREFIX = "tiny:"


class ProcessorError(RunError):
    pass


TINY_BUILD = 3  # bump whenever a tiny builder changes what it writes


def resolve_model_path(path: str) -> str:
    """``tiny:<family>`` becomes the folder of that tiny model, built once under ``COLLAGE_HOME``."""
    if not path.startswith(TINY_PREFIX):
        return path
    family = path.removeprefix(TINY_PREFIX)
    if family not in BUILDERS:
        raise UnsupportedModelError(f"no tiny model {path!r}: choose tiny:{', tiny:'.join(BUILDERS)}")
    # the builders' version is part of the cache name: a changed builder (say, real processor defaults) never
    # serves a model cached by an older one
    folder = cache_dir("models") / f"tiny-{family}-b{TINY_BUILD}"
    if (folder / "config.json").is_file():
        return str(folder)
    # one builder at a time (the processes of a multi-process run all resolve it at once, and two builds racing
    # to rename into place failed one of them); the others wait, then find it built
    with _exclusive(folder.parent / f".{folder.name}.lock"):
        if (folder / "config.json").is_file():
            return str(folder)
        tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
        try:
            if _in_process_group():
                _build_apart(family, tmp)
            else:
                build_tiny(family, tmp)
            if folder.exists():  # a folder without config.json, left by something else: never a model
                shutil.rmtree(folder)
            os.rename(tmp, folder)  # the whole folder appears at once
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def _in_process_group() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()


def _build_apart(family: str, out: Path) -> None:
    """Build the tiny model in a process of its own. Under a process group (the first process of a host other than
    the run's first, on a run on several hosts) transformers' ``save_pretrained`` writes files only on the group's
    rank 0, and the model would be left without its config and weights."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    done = subprocess.run([sys.executable, "-m", "collage.training.models.tiny", family, str(out)], env=env,
                          capture_output=True, text=True, check=False)  # fmt: skip
    if done.returncode != 0:
        raise RunError(f"building tiny:{family} in {out} failed: {done.stderr.strip()[-2000:]}")


# what a launcher sets for its processes: a build apart is a plain process, in no group
_LAUNCH_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID"}  # fmt: skip


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """An exclusive lock between processes on this machine (released if the holder dies)."""
    import fcntl

    with open(lock_file, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def model_family(path: str) -> Family:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(resolve_model_path(path))
    return family_for_model_type(config.model_type)


def check_processor(processor: Any, path: str) -> Any:
    """Refuse a processor that cannot process images.

    ``AutoProcessor`` quietly falls back to a bare tokenizer when it cannot build the image processor (a Qwen-VL
    processor without torchvision, for example); training would then run text-only with no error.
    """
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        raise ProcessorError(
            f"{path}: the processor has no image processor (got {type(processor).__name__}); "
            "Collage will not train a vision-language model text-only. Check that the model folder has its "
            "preprocessor_config.json and that torchvision is installed (Qwen-VL image processors need it)."
        )
    if getattr(processor, "tokenizer", None) is None:
        raise ProcessorError(f"{path}: the processor has no tokenizer")
    return processor


def load_processor(path: str) -> tuple[Any, Family]:
    from transformers import AutoProcessor

    local = resolve_model_path(path)
    family = model_family(local)
    try:
        processor = AutoProcessor.from_pretrained(local)
    except OSError as exc:
        raise ProcessorError(
            f"{path}: could not load the model's processor (tokenizer + image processor): {exc}"
        ) from exc
    except ImportError as exc:  # a processor that needs a package of its own (SmolVLM's needs num2words)
        raise ProcessorError(f"{path}: the model's processor needs a package that is not installed: {exc}") from exc
    return check_processor(processor, path), family


def load_model(path: str, dtype: str = "auto"):
    import torch
    from transformers import AutoModelForImageTextToText

    torch_dtype = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        raise ValueError(f"model.dtype must be one of auto, float32, bfloat16; got {dtype!r}")
    return AutoModelForImageTextToText.from_pretrained(resolve_model_path(path), dtype=torch_dtype)
