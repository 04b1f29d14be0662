"""The streamed tar of a checkpoint folder (``tarstream``): a file swapped for a link to an outside file after the
listing stops the stream before any byte of that file is sent."""

from __future__ import annotations

import os

import pytest


def test_a_link_swapped_in_after_the_listing_stops_the_stream_without_the_outside_file(tmp_path):
    """The race a listing alone cannot close: the file is replaced by a link between the plan and the read."""
    from collage.app import tarstream

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"a" * 10)
    (folder / "b.bin").write_bytes(b"b" * 10)
    secret = tmp_path / "secret"
    secret.write_bytes(b"S" * 10)
    plan = tarstream.plan(folder, "x")
    (folder / "b.bin").unlink()
    os.symlink(secret, folder / "b.bin")
    sent = b""
    with pytest.raises(tarstream.UnsafeFolder, match="b.bin changed"):
        for chunk in tarstream.stream(plan):
            sent += chunk
    assert b"a" * 10 in sent and b"S" * 10 not in sent
