"""Checkpoints are data, never code: the trainer state loads with ``torch.load(weights_only=True)``, a tampered
``trainer_state.pt`` is refused before any of it runs, checkpoints written before this change still resume,
and checkpoint folders and files are private (0700 / 0600) whatever the process's umask."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

import pytest
import torch
from PIL import Image

from collage.training.checkpoint import STATE_FILE, CheckpointRefused, load_state, read_info, save_checkpoint
from collage.training.output import OutputFolder
from collage.training.trainer import Trainer
from tests.support.training import Recorder, make_config

TRAIN = {"max_steps": 3, "seed": 3, "steps_per_generation": 2, "per_device_train_batch_size": 4}


def _stopped_run(out: Path) -> Path:
    """A run stopped after step 1 (a cancel: it saves a checkpoint); its checkpoint folder."""
    Trainer(make_config(train=TRAIN), out, [OutputFolder(out), Recorder(stop_after=1)]).train()
    folder = out / "checkpoints" / "step-1"
    assert (folder / STATE_FILE).is_file()
    return folder


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> Path:
    return _stopped_run(tmp_path_factory.mktemp("stopped"))


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, symlinks=True)
    return dst


class _RunsCode:
    """Unpickling this calls ``fn(*args)``: what a planted trainer_state.pt would do."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("how", ["os.system", "builtins.exec"])
def test_a_trainer_state_that_would_run_code_is_refused_naming_the_file(stopped, tmp_path, how):
    out = _copy_run(stopped.parents[1], tmp_path / "run")
    marker = tmp_path / "pwned"
    payload = (
        _RunsCode(os.system, f"touch {marker}")
        if how == "os.system"
        else _RunsCode(exec, f"open({str(marker)!r}, 'w').close()")
    )
    state = out / "checkpoints" / "step-1" / STATE_FILE
    torch.save({"step": 1, "world": 1, "payload": payload}, state)
    trainer = Trainer(make_config(train=TRAIN), out, [OutputFolder(out)], resume=True)
    with pytest.raises(CheckpointRefused) as info:
        trainer.train()
    assert str(state) in str(info.value) and "refused" in str(info.value)
    assert not marker.exists(), "nothing of the planted pickle ran"


def test_the_trainer_state_of_a_run_needs_nothing_beyond_the_allowlist(stopped):
    """What a real run's trainer state holds beyond tensors and plain values is exactly the allowlisted
    types: the generation buffer's dataclasses and numpy's RNG state."""
    from collage.training.checkpoint import _safe_globals

    found = set(torch.serialization.get_unsafe_globals_in_checkpoint(stopped / STATE_FILE))
    with torch.serialization.safe_globals(_safe_globals()):
        allowed = set(torch._weights_only_unpickler._get_user_allowed_globals())
    assert found and found <= allowed, found - allowed
    state = load_state(stopped)
    assert state["step"] == 1 and state["buffer"] is not None and state["rng"][0]["numpy"][0] == "MT19937"


def _jpeg() -> Image.Image:
    buf = io.BytesIO()
    Image.new("RGB", (12, 9), (200, 30, 60)).save(buf, format="JPEG")
    image = Image.open(io.BytesIO(buf.getvalue()))
    image.load()
    assert type(image).__name__ == "JpegImageFile"
    return image


def test_a_checkpoint_written_the_old_way_still_resumes(stopped, tmp_path):
    """Before this change the state was pickled as is: numpy arrays for the RNG, and a rollout image whose PNG
    was not encoded yet as the PIL image class ``Image.open`` made (here a JPEG). Such a file loads (the image's
    pixels only) and the run resumes to its end."""
    out = _copy_run(stopped.parents[1], tmp_path / "old")
    file = out / "checkpoints" / "step-1" / STATE_FILE
    state = torch.load(file, map_location="cpu", weights_only=False)  # our own file, written just now
    image = next(im for row in state["buffer"].rows for im in row.images)
    jpeg = _jpeg()
    image._image, image._png, image._sha256 = jpeg, None, None  # an image the writer had not encoded yet
    torch.save(state, file)  # exactly the old call: torch's default pickler, no allowlist in mind
    assert "PIL.JpegImagePlugin.JpegImageFile" in torch.serialization.get_unsafe_globals_in_checkpoint(file)

    loaded = load_state(file.parent)
    restored = next(im for row in loaded["buffer"].rows for im in row.images)
    assert restored.png == _png_of(jpeg), "the pickled pixels come back"
    result = Trainer(make_config(train=TRAIN), out, [OutputFolder(out)], resume=True).train()
    assert result.status == "succeeded" and result.step == TRAIN["max_steps"]


def _png_of(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    Image.frombytes(image.mode, image.size, image.tobytes()).save(buf, format="PNG")
    return buf.getvalue()


def test_an_unencoded_rollout_image_is_saved_as_pixels_and_loads_back(stopped, tmp_path):

    state = load_state(stopped)
    image = next(im for row in state["buffer"].rows for im in row.images)
    jpeg = _jpeg()
    image._image, image._png, image._sha256 = jpeg, None, None

    class Saves:
        def save_pretrained(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)
            (Path(folder) / "weights.bin").write_bytes(b"w")

    rng = state.pop("rng")
    folder, size = save_checkpoint(tmp_path, 7, Saves(), Saves(), state, rng)
    assert size == 1 and read_info(folder) == {  # model and processor wrote the same 1-byte file
        "step": 7,
        "kind": "full",
        "bytes": 1,
        "metric": None,
        "metric_value": None,
    }
    found = torch.serialization.get_unsafe_globals_in_checkpoint(folder / STATE_FILE)
    assert not [g for g in found if g.startswith("PIL.")], found  # no PIL class: raw pixels only
    restored = next(im for row in load_state(folder)["buffer"].rows for im in row.images)
    assert restored.png == _png_of(jpeg)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in [root, *root.rglob("*")]}


def test_checkpoint_folders_and_files_are_private_whatever_the_umask(tmp_path):
    """The trainer may run in a notebook, under the notebook's umask: the checkpoint sets its own modes."""
    old = os.umask(0o022)
    try:
        folder = _stopped_run(tmp_path)
    finally:
        os.umask(old)
    modes = _modes(folder.parent)
    assert modes, "a checkpoint was written"
    wrong = {
        path: oct(mode) for path, mode in modes.items() if mode != (0o700 if (folder.parent / path).is_dir() else 0o600)
    }
    assert not wrong, wrong
