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


def test_a_file_hard_linked_from_elsewhere_is_refused_before_a_byte_is_sent(tmp_path):
    """A hard link is no symbolic link: the same outside file under a name inside the folder. Collage never makes
    one in a model folder, so one is refused, naming it."""
    import os

    from collage.app import tarstream

    outside = tmp_path / "outside.txt"
    outside.write_text("the serve token, say")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    os.link(outside, folder / "tokenizer.json")
    with pytest.raises(tarstream.UnsafeFolder, match="tokenizer.json has 2 hard links"):
        tarstream.plan(folder, "x")


@pytest.mark.parametrize("name", ["..\\..\\evil.txt", "bell\x07.txt", "line\nbreak.txt"])
def test_a_name_a_tar_reader_could_take_for_a_path_is_refused(tmp_path, name):
    from collage.app import tarstream

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / name).write_text("x")
    with pytest.raises(tarstream.UnsafeFolder, match="backslash or a control character"):
        tarstream.plan(folder, "x")
