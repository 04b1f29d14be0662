"""Artifacts on object storage (collage.training.infra.objectstore) without a server: S3 URLs parsed and bad ones named, a
cache folder per bucket and prefix, transient faults told from lasting ones through boto3's wrappers, and a missing
boto3 naming the extra to install."""

from __future__ import annotations

import pytest

from collage.training.infra.errors import InputError
from collage.training.infra.objectstore import (
    ObjectMirror,
    S3Location,
    local_cache_root,
)


def test_urls_are_parsed_and_bad_ones_named():
    assert S3Location.parse("s3://b/one/two/") == S3Location("b", "one/two/")
    assert S3Location.parse("s3://b").key("images/x.png") == "images/x.png"
    for bad in ("s3://", "s3:///x", "/local/folder", "s3://b/../up"):
        with pytest.raises(InputError, match="COLLAGE_ARTIFACTS"):
            S3Location.parse(bad)


def test_each_bucket_and_prefix_has_its_own_cache_folder(tmp_path):
    assert local_cache_root(tmp_path, "s3://a/p") != local_cache_root(tmp_path, "s3://a/q")
    assert local_cache_root(tmp_path, "s3://a/p").is_relative_to(tmp_path)


def test_transient_faults_are_told_from_lasting_ones_through_boto3_s_wrappers():
    from boto3.exceptions import S3UploadFailedError
    from botocore.exceptions import ClientError, EndpointConnectionError

    from collage.training.infra.objectstore import _is_transient

    def wrapped(error: BaseException) -> BaseException:
        try:
            try:
                raise error
            except Exception as inner:
                raise S3UploadFailedError("Failed to upload") from inner
        except S3UploadFailedError as outer:
            return outer

    def client_error(status: int, code: str) -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert _is_transient(wrapped(client_error(500, "InternalError")))  # the server restarting mid-upload
    assert _is_transient(wrapped(client_error(503, "SlowDown")))
    assert _is_transient(EndpointConnectionError(endpoint_url="http://127.0.0.1:1"))
    assert not _is_transient(wrapped(client_error(403, "AccessDenied")))  # fixed by a person, not by waiting
    assert not _is_transient(OSError(28, "No space left on device"))


def test_an_s3_url_without_boto3_names_the_extra_to_install(monkeypatch):
    import sys

    from collage.training.infra.errors import MissingExtraError

    monkeypatch.setitem(sys.modules, "boto3", None)  # as if it were not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'collage-rl\[s3\]'"):
        ObjectMirror("s3://b/p").ensure_bucket()


def test_each_retry_of_an_outage_is_logged_as_it_happens_and_the_recovery_too(caplog):
    """An operator sees an outage in the log while it lasts: each transient failure with its attempt and the time
    so far, then the attempt that succeeded (no server: the call fails twice, then answers)."""
    from botocore.exceptions import EndpointConnectionError

    caplog.set_level("WARNING", logger="collage.objectstore")
    slept: list[float] = []
    mirror = ObjectMirror("s3://b/p", "http://127.0.0.1:9", retry_for=60, sleep=slept.append)
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise EndpointConnectionError(endpoint_url="http://127.0.0.1:9")
        return "stored"

    assert mirror._retry("writing images/x.png", flaky) == "stored"
    lines = [r.getMessage() for r in caplog.records]
    assert len(calls) == 3 and len(slept) == 2 and len(lines) == 3, lines
    assert all("http://127.0.0.1:9" in line and "writing images/x.png" in line for line in lines), lines
    assert "failed (attempt 1, " in lines[0] and "failed (attempt 2, " in lines[1] and "retrying for up to" in lines[1]
    assert "succeeded at attempt 3" in lines[2]


class FolderBucket(ObjectMirror):
    """The artifacts' bucket as a local folder: the mirror's own folder logic (manifests, checked fetches) runs
    unchanged on top of these single-object calls; ``fetched`` lists every object downloaded."""

    def __init__(self, folder):
        super().__init__("s3://bucket/prefix")
        self.folder = folder
        self.fetched: list[str] = []

    def put_bytes(self, rel, data, once=False, content_type=None):
        (self.folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (self.folder / rel).write_bytes(data)

    def put_file(self, rel, path, content_type=None):
        self.put_bytes(rel, path.read_bytes())

    def get_bytes(self, rel):
        path = self.folder / rel
        return path.read_bytes() if path.is_file() else None

    def fetch_file(self, rel, dest):
        data = self.get_bytes(rel)
        if data is None:
            return False
        self.fetched.append(rel)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        return True


WEIGHTS = bytes(range(256)) * 64
REL = "runs/r/attempt-1/checkpoints/step-9"


@pytest.fixture
def published(tmp_path):
    """``(bucket, cache)``: a checkpoint published from a worker host's folder, and another host's empty cache."""
    bucket = FolderBucket(tmp_path / "bucket")
    folder = tmp_path / "worker" / REL
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "weights.bin").write_bytes(WEIGHTS)
    (folder / "trainer_state.pt").write_bytes(b"state")
    bucket.put_folder(REL, folder)
    return bucket, tmp_path / "cache"


def _cache_a_copy(bucket, cache):
    from collage.training.infra.objectstore import ensure_local_folder

    assert ensure_local_folder(cache, cache / REL, bucket)
    bucket.fetched.clear()
    return cache / REL


def test_an_intact_cached_copy_is_checked_against_its_manifest_and_used_without_a_download(published):
    from collage.training.infra.objectstore import ensure_local_folder

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    assert ensure_local_folder(cache, copy, bucket)
    assert bucket.fetched == []


@pytest.mark.parametrize("damage", ["same size, other bytes", "cut short", "removed"])
def test_a_cached_copy_that_does_not_match_its_manifest_is_fetched_again_from_the_bucket(published, damage, caplog):
    """A worker's cached copy of a checkpoint is checked too (every file's size and SHA-256 as the manifest records
    them): one changed on this host, even keeping its size, is replaced by the bucket's checked copy."""
    from collage.training.infra.objectstore import ensure_local_folder

    caplog.set_level("WARNING", logger="collage.objectstore")
    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    weights = copy / "model" / "weights.bin"
    if damage == "same size, other bytes":
        weights.write_bytes(b"\xff" + WEIGHTS[1:])
    elif damage == "cut short":
        weights.write_bytes(WEIGHTS[:100])
    else:
        weights.unlink()
    assert ensure_local_folder(cache, copy, bucket)
    assert weights.read_bytes() == WEIGHTS
    assert f"{REL}/model/weights.bin" in bucket.fetched
    assert any("does not match its manifest" in r.getMessage() and "model/weights.bin" in r.getMessage()
               for r in caplog.records)  # fmt: skip


def test_a_cached_copy_whose_bucket_copy_is_damaged_too_is_storage_damaged_naming_the_file(published):
    from collage.training.infra.objectstore import StorageDamaged, ensure_local_folder

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    (copy / "model" / "weights.bin").write_bytes(b"\xff" + WEIGHTS[1:])
    bucket.put_bytes(f"{REL}/model/weights.bin", b"\x01" + WEIGHTS[1:])
    with pytest.raises(StorageDamaged, match=r"step-9/model/weights\.bin does not match its manifest"):
        ensure_local_folder(cache, copy, bucket)
    assert not list(cache.rglob(".step-9.fetch-*"))  # the temporary folder of the fetch is gone


def test_a_folder_is_told_from_its_manifest_by_size_then_sha256(published):
    from collage.training.infra.objectstore import folder_mismatch

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    manifest = bucket.manifest(REL)
    assert folder_mismatch(copy, manifest, REL) is None
    (copy / "extra.txt").write_bytes(b"not in the manifest")  # not looked at
    assert folder_mismatch(copy, manifest, REL) is None
    (copy / "trainer_state.pt").write_bytes(b"STATE")
    assert folder_mismatch(copy, manifest, REL) == "trainer_state.pt has another SHA-256 than the manifest's"
    (copy / "trainer_state.pt").write_bytes(b"longer state")
    assert folder_mismatch(copy, manifest, REL) == "trainer_state.pt has 12 bytes, the manifest says 5"
    (copy / "trainer_state.pt").unlink()
    assert folder_mismatch(copy, manifest, REL) == "trainer_state.pt is missing"


@pytest.mark.parametrize(
    ("manifest", "expected"),
    [
        (b"{not json", "is not JSON"),
        (b'{"written_at": 1}', "has no list of files"),
        (b'{"files": {"a.bin": {"size": "3"}}}', "gives no size and SHA-256"),
        (b'{"files": {"../a.bin": {"size": 3, "sha256": "00"}}}', "names a file outside its folder"),
    ],
)
def test_a_manifest_that_is_not_one_is_storage_damaged_not_a_crash(published, manifest, expected):
    from collage.training.infra.objectstore import StorageDamaged, ensure_local_folder

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    bucket.put_bytes(f"{REL}/MANIFEST.json", manifest)
    for where in (copy, cache / "runs/r/attempt-1/checkpoints/elsewhere"):  # a cached copy, and none
        if where != copy:
            bucket.put_bytes("runs/r/attempt-1/checkpoints/elsewhere/MANIFEST.json", manifest)
        with pytest.raises(StorageDamaged, match=expected):
            ensure_local_folder(cache, where, bucket)


def test_a_folder_found_intact_is_not_read_again_until_one_of_its_files_changes(published, monkeypatch):
    """Checking a cached copy reads all of it: a process that found a folder intact trusts it again while no file
    changed (inode, size, modification and change times), and reads it again after any change, even one that
    keeps the size and sets the modification time back."""
    import os

    from collage.training.infra import objectstore
    from collage.training.infra.objectstore import ensure_local_folder

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)
    monkeypatch.setattr(objectstore, "RACY", 0)  # the files are seconds old only: trusted at once
    hashed: list[str] = []
    sha256 = objectstore._sha256_file
    monkeypatch.setattr(objectstore, "_sha256_file", lambda path: hashed.append(path.name) or sha256(path))
    assert ensure_local_folder(cache, copy, bucket) and len(hashed) == 2  # read whole once
    assert ensure_local_folder(cache, copy, bucket) and len(hashed) == 2  # then trusted
    weights = copy / "model" / "weights.bin"
    before = weights.stat()
    weights.write_bytes(b"\xff" + WEIGHTS[1:])
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))  # the same size and modification time
    assert ensure_local_folder(cache, copy, bucket)
    assert weights.read_bytes() == WEIGHTS and bucket.fetched  # seen, and fetched again


def test_a_file_changed_just_before_its_check_is_read_again_at_the_next(published, monkeypatch):
    """A check trusts a file only if it was last changed well before that check began: a change within the clock's
    resolution of it could leave every time stamp as it was."""
    from collage.training.infra import objectstore
    from collage.training.infra.objectstore import ensure_local_folder

    bucket, cache = published
    copy = _cache_a_copy(bucket, cache)  # every file written just now
    hashed: list[str] = []
    sha256 = objectstore._sha256_file
    monkeypatch.setattr(objectstore, "_sha256_file", lambda path: hashed.append(path.name) or sha256(path))
    assert ensure_local_folder(cache, copy, bucket) and ensure_local_folder(cache, copy, bucket)
    assert len(hashed) == 4  # read whole both times
