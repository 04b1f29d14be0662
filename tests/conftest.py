from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Every test session gets its own COLLAGE_HOME so caches never leak between runs or into the user's home.
os.environ["COLLAGE_HOME"] = tempfile.mkdtemp(prefix="collage-test-home-")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing in the tests may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from training.models.families import FAMILIES, TINY_FAMILIES  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir():
    """The folder of a tiny model of ``family``, built once per session through ``tiny:<family>``."""
    from training.models.loading import resolve_model_path

    def get(family: str) -> Path:
        return Path(resolve_model_path(f"tiny:{family}"))

    return get


@pytest.fixture(scope="session")
def tiny(tiny_model_dir):
    """``(model, processor, family)`` for a tiny model, float32, eval mode; cached per family."""
    import torch

    from training.models.loading import load_model, load_processor

    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            torch.manual_seed(0)
            processor, fam = load_processor(str(tiny_model_dir(family)))
            model = load_model(str(tiny_model_dir(family)), "float32").eval()
            cache[family] = (model, processor, fam)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def count_red_dir(tmp_path_factory):
    from training.data.synth import write_synth

    out = tmp_path_factory.mktemp("count-red")
    write_synth("count-red", out, rows=12, min_images=0, max_images=3, seed=7)
    return out


__all__ = ["FAMILIES", "TINY_FAMILIES"]
