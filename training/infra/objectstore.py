"""Artifacts on S3-compatible object storage, with each host's local folder as a cache.

``COLLAGE_ARTIFACTS=s3://bucket/prefix`` puts every artifact (rollout images and thumbnails, checkpoints, exports,
the data-check cache) under ``prefix/`` in ``bucket``, at the same relative path it has in the local folder
(``images/ab/cd/<sha256>.png``, ``runs/<id>/attempt-<n>/checkpoints/step-<N>/...``). The local folder is then a
cache under the host's own ``COLLAGE_HOME``: hosts share nothing but the store, the broker and the bucket.

- Single objects are written whole (S3 never shows half an object); content-addressed ones are written once
  (``If-None-Match: *``, an existing object is left as it is).
- A folder (a checkpoint, an export) is uploaded file by file (large files multipart), then its ``MANIFEST.json``
  (every file's size and SHA-256) last: a folder without its manifest is not there yet, whatever else is. It is
  fetched into the cache under a temporary name, checked against the manifest, then renamed.
- Every call retries with backoff while the server is unreachable or answers 5xx, for ``COLLAGE_S3_RETRY_FOR``
  seconds (default 120), then raises :class:`StorageError` naming the endpoint and what failed.

The client is boto3 (the AWS SDK, kept by AWS; docs/scaling.md says why); it is imported on first use, so this
module stays light for the web node's request path. Endpoint, region and credentials come from the standard AWS
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, profiles, instance roles),
plus ``COLLAGE_S3_ENDPOINT_URL`` for a server that is not AWS (SeaweedFS, MinIO, R2).
"""

from __future__ import annotations

import builtins
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from collage.training.infra.errors import InputError, MissingExtraError, RunError

T = TypeVar("T")
log = logging.getLogger("collage.objectstore")

ARTIFACTS_ENV = "COLLAGE_ARTIFACTS"
ENDPOINT_ENV = "COLLAGE_S3_ENDPOINT_URL"
RETRY_ENV = "COLLAGE_S3_RETRY_FOR"
MANIFEST = "MANIFEST.json"
DEFAULT_RETRY_FOR = 120.0
MULTIPART_THRESHOLD = 64 << 20  # files above this go up in 64 MiB parts, several at once
CHUNK = 1 << 20


class StorageError(RunError):
    """The object store could not be used: unreachable past the retry window, or what it holds cannot be."""


class StorageUnreachable(StorageError):
    """The object store did not answer (or kept failing) for longer than the retry window: it may come back."""


class StorageDamaged(StorageError):
    """What the bucket holds cannot be used: a file missing from its folder or not matching the manifest, a
    manifest naming a file outside its folder. Asking again gets the same answer."""


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ends with "/"

    @classmethod
    def parse(cls, url: str) -> S3Location:
        """``s3://bucket`` or ``s3://bucket/some/prefix``; anything else is refused with the variable's name."""
        rest = url[len("s3://") :] if url.startswith("s3://") else None
        bucket, _, prefix = (rest or "").partition("/")
        if not rest or not bucket or "\x00" in url or ".." in prefix.split("/"):
            raise InputError(f"{ARTIFACTS_ENV}: {url!r} is not s3://bucket[/prefix]")
        prefix = prefix.strip("/")
        return cls(bucket, prefix + "/" if prefix else "")

    def key(self, rel: str) -> str:
        return self.prefix + rel.lstrip("/")


def is_remote(url: str | os.PathLike[str] | None) -> bool:
    return str(url or "").startswith("s3://")


def local_cache_root(home: Path, url: str) -> Path:
    """Where a host caches the objects of ``url``: its own home, one folder per bucket and prefix."""
    location = S3Location.parse(url)
    return home / "cache" / "s3" / location.bucket / location.prefix.rstrip("/")


def _is_transient(exc: BaseException) -> bool:
    """A fault that waiting may cure: the server down or restarting, a timeout, a 5xx or a throttle. boto3's
    transfers wrap the client's error (``S3UploadFailedError``, ``RetriesExceededError``): the chain is followed."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if _is_transient_one(cause):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _is_transient_one(exc: BaseException) -> bool:
    try:
        from botocore.exceptions import ClientError, ConnectionError, HTTPClientError
    except ImportError:  # pragma: no cover - only without the s3 extra, where no client exists either
        return False
    from boto3.exceptions import RetriesExceededError
    from s3transfer.exceptions import RetriesExceededError as TransferRetriesExceeded

    if isinstance(exc, (ConnectionError, HTTPClientError, RetriesExceededError, TransferRetriesExceeded)):
        return True
    if isinstance(exc, ClientError):
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = exc.response.get("Error", {}).get("Code", "")
        return status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout", "InternalError")
    # a socket's own errors; a local disk that is full or read-only is not waited out
    return isinstance(exc, (builtins.ConnectionError, TimeoutError))


def _is_missing(exc: BaseException) -> bool:
    from botocore.exceptions import ClientError

    if not isinstance(exc, ClientError):
        return False
    code = str(exc.response.get("Error", {}).get("Code", ""))
    return code in ("404", "NoSuchKey", "NotFound")


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


class ObjectMirror:
    """The artifacts' bucket: every artifact's relative path is its key under the prefix. Thread-safe (boto3
    clients are); one per process through :func:`mirror_for`."""

    def __init__(
        self,
        url: str,
        endpoint_url: str | None = None,
        retry_for: float = DEFAULT_RETRY_FOR,
        sleep: Callable[[float], None] = time.sleep,
        public_url: str | None = None,
    ):
        self.url = url
        self.location = S3Location.parse(url)
        self.endpoint_url = endpoint_url or None
        # the endpoint browsers reach (presigned URLs are signed for their host): the same one unless set
        self.public_url = public_url or None
        self._presigner: Any = None
        self.retry_for = retry_for
        self._sleep = sleep
        self._client: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"ObjectMirror({self.url!r}, endpoint={self.endpoint_url!r})"

    @property
    def where(self) -> str:
        return f"{self.url} ({self.endpoint_url or 'AWS'})"

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                self._client = self._make_client(self.endpoint_url)
            return self._client

    def _make_client(self, endpoint_url: str | None) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as exc:
            raise MissingExtraError("s3", f"{ARTIFACTS_ENV}={self.url}", "boto3") from exc
        config = Config(
            retries={"max_attempts": 2, "mode": "standard"},  # the backoff below waits out longer faults
            connect_timeout=5,
            read_timeout=60,
            s3={"addressing_style": "path"},  # works on every S3-compatible server, and AWS
            max_pool_connections=32,
        )
        return boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)

    def _retry(self, what: str, call: Callable[[], T]) -> T:
        """``call()``, again with exponential backoff (0.25 s doubling to 8 s, jittered) while the fault is
        transient, for at most ``retry_for`` seconds in all."""
        started = time.monotonic()
        deadline = started + self.retry_for
        delay, attempt = 0.25, 1
        while True:
            try:
                result = call()
            except Exception as exc:
                if not _is_transient(exc):
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StorageUnreachable(
                        f"object storage {self.where}: {what} failed for {self.retry_for:.0f} s: {exc}"
                    ) from exc
                # an outage is seen in the log as it happens (each try), not only when the retry window runs out
                log.warning("object storage %s: %s failed (attempt %d, %.1f s so far): %s; retrying for up to %.0f s",
                            self.where, what, attempt, time.monotonic() - started, exc, left)  # fmt: skip
                self._sleep(min(delay * (0.5 + random.random()), left))
                delay, attempt = min(delay * 2, 8.0), attempt + 1
            else:
                if attempt > 1:
                    log.warning("object storage %s: %s succeeded at attempt %d, after %.1f s", self.where, what,
                                attempt, time.monotonic() - started)  # fmt: skip
                return result

    # ----------------------------------------------------------------------------------------- single objects
    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist (an operator's existing bucket is left as it is)."""
        from botocore.exceptions import ClientError

        bucket = self.location.bucket

        def ensure() -> None:
            try:
                self.client.head_bucket(Bucket=bucket)
            except ClientError as exc:
                if str(exc.response.get("Error", {}).get("Code")) not in ("404", "NoSuchBucket", "NotFound"):
                    raise
                try:
                    self.client.create_bucket(Bucket=bucket)
                except ClientError as again:  # another host made it first
                    if again.response.get("Error", {}).get("Code") not in ("BucketAlreadyOwnedByYou",
                                                                           "BucketAlreadyExists"):  # fmt: skip
                        raise

        self._retry(f"checking bucket {bucket}", ensure)

    def exists(self, rel: str) -> bool:
        def head() -> bool:
            try:
                self.client.head_object(Bucket=self.location.bucket, Key=self.location.key(rel))
                return True
            except Exception as exc:
                if _is_missing(exc):
                    return False
                raise

        return self._retry(f"looking up {rel}", head)

    def put_bytes(self, rel: str, data: bytes, once: bool = False, content_type: str | None = None) -> None:
        """Write ``data`` whole; ``once``: content-addressed, so an object already there is the same and is kept."""
        from botocore.exceptions import ClientError

        extra: dict[str, Any] = {"ContentType": content_type} if content_type else {}
        if once:
            extra["IfNoneMatch"] = "*"

        def put() -> None:
            try:
                self.client.put_object(Bucket=self.location.bucket, Key=self.location.key(rel), Body=data, **extra)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if once and code in ("PreconditionFailed", "ConditionalRequestConflict"):
                    return
                raise

        self._retry(f"writing {rel}", put)

    def get_bytes(self, rel: str) -> bytes | None:
        """The object's bytes, or None when there is no such object."""

        def get() -> bytes | None:
            try:
                answer = self.client.get_object(Bucket=self.location.bucket, Key=self.location.key(rel))
                return answer["Body"].read()
            except Exception as exc:
                if _is_missing(exc):
                    return None
                raise

        return self._retry(f"reading {rel}", get)

    def put_file(self, rel: str, path: Path, content_type: str | None = None) -> None:
        from boto3.s3.transfer import TransferConfig

        config = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD)
        extra = {"ContentType": content_type} if content_type else None
        self._retry(
            f"uploading {rel}",
            lambda: self.client.upload_file(
                str(path), self.location.bucket, self.location.key(rel), Config=config, ExtraArgs=extra
            ),
        )

    def fetch_file(self, rel: str, dest: Path) -> bool:
        """Download the object to ``dest`` (through a temporary name); False when there is no such object."""
        dest.parent.mkdir(parents=True, exist_ok=True)

        def download() -> bool:
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".fetch-")
            os.close(fd)
            try:
                self.client.download_file(self.location.bucket, self.location.key(rel), tmp)
                os.replace(tmp, dest)
                return True
            except Exception as exc:
                if _is_missing(exc):
                    return False
                raise
            finally:
                Path(tmp).unlink(missing_ok=True)

        return self._retry(f"downloading {rel}", download)

    def stream(self, rel: str) -> tuple[Iterator[bytes], int] | None:
        """The object's bytes in chunks with its length, or None when there is no such object (for a response
        that streams from the store without a local copy)."""

        def get() -> tuple[Iterator[bytes], int] | None:
            try:
                answer = self.client.get_object(Bucket=self.location.bucket, Key=self.location.key(rel))
            except Exception as exc:
                if _is_missing(exc):
                    return None
                raise
            return answer["Body"].iter_chunks(CHUNK), int(answer["ContentLength"])

        return self._retry(f"reading {rel}", get)

    def presign(self, rel: str, seconds: int) -> str:
        """A URL that reads the object for ``seconds``, for the endpoint browsers reach (``COLLAGE_S3_PUBLIC_URL``,
        else the one Collage uses). Signing is local: no request is made."""
        client = self.client
        if self.public_url is not None:
            with self._lock:
                if self._presigner is None:
                    self._presigner = self._make_client(self.public_url)
                client = self._presigner
        return client.generate_presigned_url(
            "get_object", Params={"Bucket": self.location.bucket, "Key": self.location.key(rel)}, ExpiresIn=seconds
        )

    def keys_under(self, rel: str) -> list[str]:
        """Every key under the folder ``rel``, relative to it."""
        base = self.location.key(rel.rstrip("/") + "/")

        def listing() -> list[str]:
            found: list[str] = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.location.bucket,
                                                                              Prefix=base):  # fmt: skip
                found += [item["Key"][len(base) :] for item in page.get("Contents", [])]
            return found

        return self._retry(f"listing {rel}", listing)

    # ------------------------------------------------------------------------------------------------ folders
    def put_folder(self, rel: str, folder: Path) -> dict[str, Any]:
        """Upload every file of ``folder`` (links followed), then its manifest, last. Returns the manifest."""
        files: dict[str, dict[str, Any]] = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            name = path.relative_to(folder).as_posix()
            if name == MANIFEST:
                continue
            files[name] = {"size": path.stat().st_size, "sha256": _sha256_file(path)}
            self.put_file(f"{rel}/{name}", path)
        manifest = {"files": files, "written_at": time.time()}
        self.put_bytes(f"{rel}/{MANIFEST}", json.dumps(manifest).encode(), content_type="application/json")
        return manifest

    def manifest(self, rel: str) -> dict[str, Any] | None:
        """The folder's manifest (None: there is none); one that is not a manifest is :class:`StorageDamaged`."""
        data = self.get_bytes(f"{rel}/{MANIFEST}")
        if data is None:
            return None
        try:
            manifest = json.loads(data)
        except ValueError as exc:
            raise StorageDamaged(f"object storage {self.where}: the manifest of {rel} is not JSON: {exc}") from exc
        manifest_files(manifest, rel)  # refused here, before any file is read, when it is not one
        return manifest

    def fetch_folder(self, rel: str, dest: Path, manifest: Mapping[str, Any] | None = None) -> bool:
        """Download the folder ``rel`` into ``dest`` (replaced whole, through a temporary folder), each file checked
        against the manifest (``manifest``: already read). False when it has no manifest (never written whole, or
        removed)."""
        manifest = manifest if manifest is not None else self.manifest(rel)
        if manifest is None:
            return False
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.fetch-"))
        try:
            for name, entry in manifest_files(manifest, rel).items():
                target = tmp / name
                if not self.fetch_file(f"{rel}/{name}", target):
                    raise StorageDamaged(f"object storage {self.where}: {rel}/{name} is in the manifest but missing")
                if file_mismatch(target, entry) is not None:
                    raise StorageDamaged(f"object storage {self.where}: {rel}/{name} does not match its manifest")
            shutil.rmtree(dest, ignore_errors=True)
            os.replace(tmp, dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return True

    def delete_folder(self, rel: str) -> None:
        """Remove the folder: its manifest first (it is gone for every reader at once), then the rest."""
        bucket = self.location.bucket
        manifest_key = self.location.key(f"{rel}/{MANIFEST}")
        self._retry(f"removing {rel}", lambda: self.client.delete_object(Bucket=bucket, Key=manifest_key))
        keys = [self.location.key(f"{rel}/{name}") for name in self.keys_under(rel)]
        for start in range(0, len(keys), 1000):
            objects = [{"Key": k} for k in keys[start : start + 1000]]
            self._delete_batch(rel, objects)

    def _delete_batch(self, rel: str, objects: list[dict[str, str]]) -> None:
        batch = {"Objects": objects, "Quiet": True}
        self._retry(f"removing {rel}", lambda: self.client.delete_objects(Bucket=self.location.bucket, Delete=batch))


def manifest_files(manifest: Any, rel: str) -> dict[str, dict[str, Any]]:
    """The manifest's files (name: ``{size, sha256}``), refused as :class:`StorageDamaged` if one would leave the
    folder or the manifest is not one (a manifest is data too)."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise StorageDamaged(f"the manifest of {rel} has no list of files")
    for name, entry in files.items():
        parts = Path(name).parts
        if not name or Path(name).is_absolute() or ".." in parts or "\x00" in name:
            raise StorageDamaged(f"the manifest of {rel} names a file outside its folder: {name!r}")
        if (not isinstance(entry, dict) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str)):  # fmt: skip
            raise StorageDamaged(f"the manifest of {rel} gives no size and SHA-256 for {name!r}")
    return dict(files)


def file_mismatch(path: Path, entry: Mapping[str, Any]) -> str | None:
    """How the file ``path`` differs from its manifest entry (``{size, sha256}``), or None when it matches: the size
    is compared first, so a file of another size is never read."""
    try:
        if not path.is_file():
            return "is missing"
        size = path.stat().st_size
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if size != entry["size"]:
        return f"has {size} bytes, the manifest says {entry['size']}"
    try:
        digest = _sha256_file(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if digest != entry["sha256"]:
        return "has another SHA-256 than the manifest's"
    return None


def folder_mismatch(folder: Path, manifest: Mapping[str, Any], rel: str) -> str | None:
    """Why the local folder does not match the manifest (its first file that is missing, of another size or another
    SHA-256 than the manifest records), or None when every file the manifest names matches. Files the manifest
    does not name are not looked at.

    A folder this process found intact before is not read again while none of its files changed since (the same
    inode, size, modification and change times) and each was last changed well before that check (:data:`RACY`):
    a change made after it always moves the change time, which no one can set back."""
    files = manifest_files(manifest, rel)
    key = (str(folder), hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest())
    checked_at = time.time_ns()
    stats = _file_stats(folder, files)
    with _intact_lock:
        known = _INTACT.get(key)
    if stats is not None and known is not None and known[1] == stats and all(s[3] < known[0] - RACY for s in stats):
        return None
    for name, entry in files.items():
        problem = file_mismatch(folder / name, entry)
        if problem is not None:
            _forget(key)
            return f"{name} {problem}"
    if stats is not None:
        _remember(key, stats, checked_at)
    return None


RACY = 2_000_000_000  # ns: a file changed this close to a check may change again within the clock's resolution
# the folders this process found intact: (folder, its manifest's files) -> (when that check began, the files' stats)
_INTACT: dict[tuple[str, str], tuple[int, tuple[tuple[Any, ...], ...]]] = {}
_INTACT_MAX = 256
_intact_lock = threading.Lock()


def _file_stats(folder: Path, files: Mapping[str, Any]) -> tuple[tuple[Any, ...], ...] | None:
    out = []
    for name in sorted(files):
        try:
            st = os.stat(folder / name)
        except OSError:
            return None
        out.append((name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev))
    return tuple(out)


def _remember(key: tuple[str, str], stats: tuple[tuple[Any, ...], ...], checked_at: int) -> None:
    with _intact_lock:
        _INTACT.pop(key, None)  # the newest last: the oldest go first past the bound
        _INTACT[key] = (checked_at, stats)
        while len(_INTACT) > _INTACT_MAX:
            _INTACT.pop(next(iter(_INTACT)))


def _forget(key: tuple[str, str]) -> None:
    with _intact_lock:
        _INTACT.pop(key, None)


@lru_cache(maxsize=8)
def _mirror(url: str, endpoint_url: str | None, retry_for: float, public_url: str | None) -> ObjectMirror:
    return ObjectMirror(url, endpoint_url, retry_for, public_url=public_url)


def mirror_for(
    url: str | None,
    endpoint_url: str | None = None,
    retry_for: float = DEFAULT_RETRY_FOR,
    public_url: str | None = None,
) -> ObjectMirror | None:
    """The process's mirror of ``url`` (None for a local folder)."""
    if not is_remote(url):
        return None
    assert url is not None
    return _mirror(url, endpoint_url or None, retry_for, public_url or None)


def mirror_from_env(environ: Mapping[str, str] = os.environ) -> ObjectMirror | None:
    """The mirror ``COLLAGE_ARTIFACTS`` names, for code outside the web app and the worker (the training library's
    data-check cache); the app's Settings read the same variables."""
    return mirror_for(environ.get(ARTIFACTS_ENV), environ.get(ENDPOINT_ENV), retry_for_of(environ))


def retry_for_of(environ: Mapping[str, str]) -> float:
    value = environ.get(RETRY_ENV, "").strip()
    try:
        seconds = float(value) if value else DEFAULT_RETRY_FOR
    except ValueError as exc:
        raise InputError(f"{RETRY_ENV}: {value!r} is not a number of seconds") from exc
    if seconds < 0:
        raise InputError(f"{RETRY_ENV}: {seconds} is negative")
    return seconds


# ---------------------------------------------------------------------------------------- the local cache
def ensure_local_file(root: Path, rel: str, mirror: ObjectMirror | None) -> Path | None:
    """``root/rel``, fetched from the mirror when this host does not have it; None when it is nowhere."""
    path = root / rel
    if path.is_file():
        _touch(path, mirror)
        return path
    if mirror is not None and mirror.fetch_file(rel, path):
        return path
    return None


def _touch(path: Path, mirror: ObjectMirror | None) -> None:
    """Mark a cached unit as used now (the cache's bound removes the least recently used first)."""
    if mirror is not None:
        try:
            os.utime(path)
        except OSError:
            pass


def ensure_local_folder(root: Path, folder: Path, mirror: ObjectMirror | None) -> bool:
    """Make sure the folder ``folder`` (under ``root``) is on this host: fetched whole from the mirror when it is
    not. False when it is neither here nor (complete) in the bucket.

    With a mirror, a copy this host already has (its cache) is checked against the bucket's manifest first, every
    file's size and SHA-256: one that does not match (a file changed, cut short or removed on this host) is fetched
    again from the bucket, whose copy is checked too (:class:`StorageDamaged` when that does not match either). A
    local copy whose folder has no manifest in the bucket is used as it is: there is nothing to check it against."""
    if mirror is None:
        return folder.is_dir()
    try:
        rel = folder.relative_to(root).as_posix()
    except ValueError:
        return folder.is_dir()
    if not folder.is_dir():
        return mirror.fetch_folder(rel, folder)
    manifest = mirror.manifest(rel)
    if manifest is None:
        _touch(folder, mirror)
        return True
    problem = folder_mismatch(folder, manifest, rel)
    if problem is None:
        _touch(folder, mirror)
        return True
    log.warning("the cached copy %s does not match its manifest (%s): fetching it again from %s", folder, problem,
                mirror.where)  # fmt: skip
    return mirror.fetch_folder(rel, folder, manifest)


def relative_to_root(root: Path, path: Path | str) -> str | None:
    """``path``'s key under ``root`` (links in its folders resolved), or None when it lies outside."""
    try:
        return Path(path).absolute().relative_to(root.absolute()).as_posix()
    except ValueError:
        try:
            return Path(path).resolve().relative_to(root.resolve()).as_posix()
        except ValueError:
            return None


# ------------------------------------------------------------------------------------- bounding the cache
CACHE_UNITS = ("images", "thumbs", "checks", "exports", "runs")  # what a cache of the bucket holds, by kind


def cache_entries(root: Path, kinds: tuple[str, ...] = CACHE_UNITS) -> list[tuple[float, int, Path]]:
    """The cache's removable units, ``(mtime, bytes, path)``: an image, a thumbnail or a check report (a file), an
    export (its folder) or a run's checkpoint (its ``step-N`` folder). Links are neither followed nor counted."""
    found: list[tuple[float, int, Path]] = []
    for kind in kinds:
        base = root / kind
        if not base.is_dir():
            continue
        if kind in ("images", "thumbs", "checks"):
            units = [p for p in base.rglob("*") if p.is_file() and not p.is_symlink()]
        elif kind == "exports":
            units = [p for p in base.iterdir() if p.is_dir() and not p.is_symlink()]
        else:
            units = [p for p in base.glob("*/attempt-*/checkpoints/step-*") if p.is_dir() and not p.is_symlink()]
        for unit in units:
            try:
                size = unit.stat().st_size if unit.is_file() else _folder_bytes(unit)
                found.append((unit.stat().st_mtime, size, unit))
            except OSError:  # removed meanwhile
                continue
    return found


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


IN_USE_FOR = 3600.0  # seconds: a unit used this recently is kept even over the bound (a download may be streaming it)


def prune_cache(
    root: Path, max_bytes: int, kinds: tuple[str, ...] = CACHE_UNITS, in_use_for: float = IN_USE_FOR
) -> int:
    """Remove the units used longest ago (their mtime: set when fetched or written, touched on each use) until the
    cache holds at most ``max_bytes``; returns how many bytes went. Everything in it is also in the bucket, so a
    removed unit is fetched again when next needed; one used in the last ``in_use_for`` seconds is kept."""
    entries = sorted(cache_entries(root, kinds))
    total = sum(size for _, size, _ in entries)
    freed = 0
    recent = time.time() - in_use_for
    for mtime, size, path in entries:
        if total - freed <= max_bytes or mtime > recent:
            break
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        freed += size
    return freed


class CachePruner(threading.Thread):
    """Keeps a host's cache of the bucket under ``max_bytes``, looking every ``every`` seconds (a daemon thread)."""

    def __init__(self, root: Path, max_bytes: int, kinds: tuple[str, ...] = CACHE_UNITS, every: float = 60.0):
        super().__init__(name="collage-cache-pruner", daemon=True)
        self.root, self.max_bytes, self.kinds, self.every = root, max_bytes, kinds, every
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            try:
                prune_cache(self.root, self.max_bytes, self.kinds)
            except Exception:  # a cache left over its bound is not worth ending the host for
                log.exception("could not prune the cache %s", self.root)

    def stop(self) -> None:
        self.stopping.set()
