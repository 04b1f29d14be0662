"""Qwen3-VL, Gemma 3, LLaVA-OneVision, InternVL and SmolVLM trained end to end by `collage train` as a process: two
GRPO steps on 0..3-image rows with text-only rows mixed in, rewards that see exactly their row's images, and each
stored sample's images as its dataset row has them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]


NEW_FAMILIES = ("qwen3-vl", "gemma3", "llava-onevision", "internvl", "smolvlm")


def images_match_row(completions, images, colors, shapes, answer, **kwargs):
    """A reward that checks what it is given: each sample's images are its row's, in order (as many as its
    ``colors`` column, each with that colour at its centre, where every synthetic shape covers); text-only rows
    get none. 1.0 when right; anything else fails the run naming the sample."""
    from collage.training.data.synth import COLORS

    out = []
    for imgs, cols, shps, ans in zip(images, colors, shapes, answer, strict=True):
        if len(imgs) != len(cols) or len(imgs) != len(shps):
            raise AssertionError(f"{len(imgs)} images for a row of {len(cols)}")
        for image, color in zip(imgs, cols, strict=True):
            center = image.convert("RGB").getpixel((image.width // 2, image.height // 2))
            if tuple(center) != COLORS[color]:
                raise AssertionError(f"an image shows {center} at its centre, its row says {color}")
        if imgs and int(ans) != sum(c == "red" for c in cols):
            raise AssertionError("the answer does not match the row's colours")
        out.append(1.0)
    return out


def _cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "collage.app.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


DATASET = {"source": "synth:count-red", "rows": 8, "min_images": 0, "max_images": 3, "seed": 2}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_collage_train_end_to_end(family, tmp_path):
    """Two GRPO steps through `collage train` on 0..3-image rows with text-only rows mixed in; the rewards see
    exactly their row's images, and the run stores each sample's images as its dataset row has them."""
    from collage.training.data.synth import cached_synth_dataset

    config = {
        "name": f"e2e-{family}",
        "algorithm": "grpo",
        "model": {"path": f"tiny:{family}", "dtype": "float32"},
        "dataset": DATASET,
        "rewards": [{"name": "numeric"}, {"name": "tests.processes.test_families:images_match_row"}],
        "train": {
            "max_steps": 2,
            "learning_rate": 1e-3,
            "per_device_train_batch_size": 8,
            "num_generations": 2,
            "max_prompt_length": 512,
            "max_completion_length": 4,
        },
        "logging": {"samples_every": 1},
        "resources": {"gpus": 0},
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    done = _cli("train", str(tmp_path / "run.yaml"), "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "succeeded at step 2" in done.stdout
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and all(np.isfinite(m["loss"]) for m in metrics)

    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 8  # 2 steps x 4 prompts x 2 generations
    assert all(s["rewards"]["images_match_row"] == 1.0 for s in samples)
    folder = cached_synth_dataset(**{k: v for k, v in DATASET.items() if k != "source"}, task="count-red")
    rows = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    seen = set()
    for s in samples:
        row = rows[s["dataset_row"]]
        assert len(s["images"]) == len(row["images"])
        for stored, ref in zip(s["images"], row["images"], strict=True):
            kept = np.asarray(Image.open(out / "images" / f"{stored['sha256']}.png").convert("RGB"))
            assert np.array_equal(kept, np.asarray(Image.open(folder / ref).convert("RGB")))
        seen.add(len(row["images"]))
    assert {0, 3} <= seen, "the run must have trained on text-only and 3-image rows"
