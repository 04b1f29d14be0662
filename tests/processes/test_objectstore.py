"""Artifacts on object storage (collage.training.infra.objectstore) against the suite's real S3 server (SeaweedFS): single
objects written once, folders visible only with their manifest, fetches checked against it, bad manifests refused,
removed folders gone for readers at once, the local cache kept under its bound, and an unreachable server reported
by name after the retry window."""

from __future__ import annotations

import json
import time
import uuid

import pytest

from collage.training.infra.objectstore import (
    MANIFEST,
    ObjectMirror,
    StorageError,
    ensure_local_file,
    ensure_local_folder,
)
from tests.support.s3 import BUCKET, CREDENTIALS, shared_endpoint
from tests.support.services import free_port


@pytest.fixture
def mirror(monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    found = ObjectMirror(f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}", shared_endpoint(), retry_for=20)
    found.ensure_bucket()
    return found


def test_content_addressed_objects_are_written_once(mirror):
    mirror.put_bytes("images/x.png", b"first", once=True)
    mirror.put_bytes("images/x.png", b"second", once=True)  # the same key: kept as it was, no error
    assert mirror.get_bytes("images/x.png") == b"first"
    assert mirror.get_bytes("images/missing.png") is None
    assert mirror.exists("images/x.png") and not mirror.exists("images/missing.png")


def test_a_folder_is_there_only_with_its_manifest_and_comes_back_checked(mirror, tmp_path):
    folder = tmp_path / "step-2"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.bin").write_bytes(b"w" * 100_000)
    (folder / "trainer_state.pt").write_bytes(b"state")
    mirror.put_folder("runs/r/step-2", folder)
    manifest = mirror.manifest("runs/r/step-2")
    assert set(manifest["files"]) == {"model/weights.bin", "trainer_state.pt"}
    # another host's cache: fetched whole, byte for byte
    other = tmp_path / "other-host"
    assert ensure_local_folder(other, other / "runs/r/step-2", mirror)
    assert (other / "runs/r/step-2/model/weights.bin").read_bytes() == b"w" * 100_000
    # files without their manifest (an upload cut short) are not a folder
    mirror.put_bytes("runs/r/step-4/model/weights.bin", b"half")
    assert not ensure_local_folder(other, other / "runs/r/step-4", mirror)
    assert not (other / "runs/r/step-4").exists()


def test_a_damaged_or_hostile_manifest_is_refused(mirror, tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"abc")
    mirror.put_folder("runs/r/f", folder)
    mirror.put_bytes("runs/r/f/a.txt", b"abd")  # changed after the manifest was written
    with pytest.raises(StorageError, match="does not match its manifest"):
        mirror.fetch_folder("runs/r/f", tmp_path / "dest")
    assert not (tmp_path / "dest").exists()  # nothing half-fetched is left under the real name
    hostile = {"files": {"../../escape.txt": {"size": 3, "sha256": "0" * 64}}}
    mirror.put_bytes(f"runs/r/g/{MANIFEST}", json.dumps(hostile).encode())
    with pytest.raises(StorageError, match="outside its folder"):
        mirror.fetch_folder("runs/r/g", tmp_path / "g")
    assert not (tmp_path / "escape.txt").exists()


def test_a_removed_folder_disappears_for_readers_at_once(mirror, tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "a.txt").write_bytes(b"abc")
    mirror.put_folder("exports/e1", folder)
    mirror.delete_folder("exports/e1")
    assert mirror.manifest("exports/e1") is None
    assert mirror.keys_under("exports/e1") == []


def test_single_files_are_fetched_into_the_cache(mirror, tmp_path):
    mirror.put_bytes("images/ab/cd/x.png", b"png")
    assert ensure_local_file(tmp_path, "images/ab/cd/x.png", mirror).read_bytes() == b"png"
    assert ensure_local_file(tmp_path, "images/ab/cd/y.png", mirror) is None
    assert ensure_local_file(tmp_path, "images/ab/cd/y.png", None) is None


def test_an_unreachable_server_fails_after_the_retry_window_naming_it(monkeypatch):
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    mirror = ObjectMirror("s3://b/p", endpoint, retry_for=2)
    started = time.monotonic()
    with pytest.raises(StorageError) as caught:
        mirror.put_bytes("images/x.png", b"x")
    assert endpoint in str(caught.value) and "writing images/x.png" in str(caught.value)
    assert time.monotonic() - started >= 1.5  # it waited out the window, retrying, before giving up


def test_the_cache_keeps_under_its_bound_removing_the_least_recently_used_first(mirror, tmp_path):
    import os

    from collage.training.infra.objectstore import cache_entries, prune_cache

    root = tmp_path / "cache"
    for i in range(4):  # four 1000-byte images, used (mtime) 1000..4000 s ago, oldest first
        mirror.put_bytes(f"images/aa/bb/{i}.png", bytes(1000))
        path = ensure_local_file(root, f"images/aa/bb/{i}.png", mirror)
        os.utime(path, (time.time() - 1000 * (4 - i),) * 2)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "w.bin").write_bytes(bytes(3000))
    mirror.put_folder("runs/r/attempt-1/checkpoints/step-2", folder)
    assert ensure_local_folder(root, root / "runs/r/attempt-1/checkpoints/step-2", mirror)  # used just now
    assert sum(size for _, size, _ in cache_entries(root)) >= 7000
    # an image used again is the most recent: 0 was the oldest, now 1 is
    ensure_local_file(root, "images/aa/bb/0.png", mirror)
    freed = prune_cache(root, max_bytes=5000, in_use_for=0)
    assert freed == 2000
    assert sorted(p.name for p in (root / "images/aa/bb").iterdir()) == ["0.png", "3.png"]
    # a unit used within in_use_for stays even over the bound (a download may be streaming it)
    assert prune_cache(root, max_bytes=0) == 0
    # what went is fetched again on the next use
    assert ensure_local_file(root, "images/aa/bb/1.png", mirror).read_bytes() == bytes(1000)
    # links (an attempt's link to an earlier attempt's checkpoint) are neither followed nor counted
    link = root / "runs/r/attempt-2/checkpoints/step-2"
    link.parent.mkdir(parents=True)
    link.symlink_to(root / "runs/r/attempt-1/checkpoints/step-2", target_is_directory=True)
    assert [p for _, _, p in cache_entries(root, ("runs",))] == [root / "runs/r/attempt-1/checkpoints/step-2"]
