"""Artifacts on object storage (collage.training.objectstore) without a server: S3 URLs parsed and bad ones named, a
cache folder per bucket and prefix, transient faults told from lasting ones through boto3's wrappers, and a missing
boto3 naming the extra to install."""

from __future__ import annotations

import pytest

from collage.training.errors import InputError
from collage.training.objectstore import (
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

    from collage.training.objectstore import _is_transient

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

    from collage.training.errors import MissingExtraError

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
