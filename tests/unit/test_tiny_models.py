"""Tiny VLMs' refusals before anything is built: a build into a non-empty folder leaves it as it was, and an unknown
tiny family is a clear error naming the known ones."""

from __future__ import annotations

import pytest

from collage.training.models.loading import resolve_model_path
from collage.training.models.tiny import build_tiny


def test_build_refuses_a_non_empty_folder(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny("llava", tmp_path)
    assert (tmp_path / "x").read_text() == "keep me"


def test_unknown_tiny_family_is_a_clear_error():
    with pytest.raises(ValueError, match="tiny:qwen2-vl"):
        resolve_model_path("tiny:gpt2")
