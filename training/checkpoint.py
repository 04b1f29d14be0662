"""Checkpoints: model (or LoRA adapter) + optimizer + scheduler + RNG + trainer state, written atomically."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

STATE_FILE = "trainer_state.pt"


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


def latest_checkpoint(out: Path) -> Path | None:
    folder = out / "checkpoints"
    if not folder.is_dir():
        return None
    found = []
    for child in folder.iterdir():
        match = re.fullmatch(r"step-(\d+)", child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def save_checkpoint(
    out: Path, step: int, model: Any, processor: Any, state: dict[str, Any], rank_rng: list[dict[str, Any]]
) -> Path:
    """Write ``checkpoints/step-<step>/`` via a temporary folder, so a crash never leaves half a checkpoint."""
    final = checkpoint_dir(out, step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "model")
    processor.save_pretrained(tmp / "model")
    torch.save({**state, "rng": rank_rng}, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def load_state(path: Path) -> dict[str, Any]:
    return torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)


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
