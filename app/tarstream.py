"""A folder as a streamed tar archive: a checkpoint's model folder, an export (``GET .../download``).

Torch-free and never whole in memory: the archive is a generator of chunks of at most :data:`CHUNK` bytes (the tar
headers written here with :meth:`tarfile.TarInfo.tobuf`, then each file's bytes as they are read), which a
``StreamingResponse`` sends as they come, so a download of a 20 GB checkpoint holds a chunk, not the checkpoint.

The folder is data from the store (a path a worker recorded), so it is opened as untrusted:

- :func:`plan` first lists it through a descriptor of the folder itself, never following a symbolic link: a link
  anywhere inside (to ``/etc/shadow``, to another run's checkpoint, to a folder outside), a file with more than one
  hard link (the same file elsewhere on the disk), a name with a backslash or a control character, or a FIFO, socket
  or device refuses the whole folder (:class:`UnsafeFolder`, naming the entry) before a byte is sent. Collage never writes a
  link inside a model folder, so one is a sign of tampering, not something to skip quietly.
- :func:`stream` then opens every file again relative to the descriptor of its folder, component by component,
  with ``O_NOFOLLOW``: a link swapped in after the listing is refused too (the download then stops short, which a
  tar reader reports as a truncated archive; it never holds the outside file). A file whose size changed since the
  listing stops it the same way, so the archive never ends with a silently cut file.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from collage.app.core.errors import WebError

CHUNK = 1 << 20  # bytes read and sent at a time
BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: the archive's length is a multiple of it, as tar writes it
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0)


class UnsafeFolder(WebError):
    """The folder holds something a download must not follow or cannot hold (a link, a device, a FIFO)."""


@dataclass(frozen=True)
class Entry:
    parts: tuple[str, ...]  # the path inside the folder, one name per level
    is_dir: bool
    size: int
    mtime: int
    header: bytes  # the entry's tar header(s), PAX where a name or size needs it


@dataclass(frozen=True)
class Plan:
    root: Path
    entries: tuple[Entry, ...]

    @property
    def size(self) -> int:
        """The archive's exact length in bytes (its Content-Length)."""
        body = sum(len(e.header) + _padded(e.size) for e in self.entries) + 2 * BLOCK
        return -(-body // RECORD) * RECORD

    @property
    def files(self) -> int:
        return sum(not e.is_dir for e in self.entries)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


def _header(name: str, is_dir: bool, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name + ("/" if is_dir else ""))
    info.type = tarfile.DIRTYPE if is_dir else tarfile.REGTYPE
    info.size = 0 if is_dir else size
    info.mtime = mtime
    info.mode = 0o755 if is_dir else 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""  # the server's user names stay on the server
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="surrogateescape")


def _open_dir(parent_fd: int | None, name: str | Path) -> int:
    return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)


def plan(root: Path, prefix: str) -> Plan:
    """List ``root`` (a resolved folder) for :func:`stream`, every entry under the folder ``prefix/`` of the
    archive; :class:`UnsafeFolder` for a link or special file anywhere inside, :class:`FileNotFoundError` when
    ``root`` is gone."""
    try:
        fd = _open_dir(None, root)
    except OSError as exc:
        if isinstance(exc, NotADirectoryError) or exc.errno == errno.ELOOP:  # a file, or a link put in its place
            raise UnsafeFolder(f"{root.name} is not a folder") from exc
        raise
    entries: list[Entry] = []
    try:
        top = os.fstat(fd)
        entries.append(Entry((), True, 0, int(top.st_mtime), _header(prefix, True, 0, int(top.st_mtime))))
        _walk(fd, (), prefix, entries)
    finally:
        os.close(fd)
    return Plan(root, tuple(entries))


def _walk(fd: int, parts: tuple[str, ...], prefix: str, entries: list[Entry]) -> None:
    with os.scandir(fd) as listing:
        children = sorted(listing, key=lambda e: e.name)
    for child in children:
        here = (*parts, child.name)
        shown = "/".join(here)
        if not _plain_entry_name(child.name):
            raise UnsafeFolder(f"{shown!r} has a name a tar reader could take for a path (a backslash or a control "
                               "character): refused")  # fmt: skip
        info = child.stat(follow_symlinks=False)
        name = f"{prefix}/{shown}"
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeFolder(f"{shown} is a symbolic link: a download holds only the folder's own files")
        if stat.S_ISDIR(info.st_mode):
            entries.append(Entry(here, True, 0, int(info.st_mtime), _header(name, True, 0, int(info.st_mtime))))
            sub = os.open(child.name, _DIR_FLAGS, dir_fd=fd)
            try:
                _walk(sub, here, prefix, entries)
            finally:
                os.close(sub)
        elif stat.S_ISREG(info.st_mode):
            if info.st_nlink > 1:  # Collage never hard-links a file into a model folder: this one is also elsewhere
                raise UnsafeFolder(f"{shown} has {info.st_nlink} hard links: a file linked from outside the folder is "
                                   "not served")  # fmt: skip
            size, mtime = info.st_size, int(info.st_mtime)
            entries.append(Entry(here, False, size, mtime, _header(name, False, size, mtime)))
        else:
            raise UnsafeFolder(f"{shown} is not a regular file or folder (a device, FIFO or socket)")


def _plain_entry_name(name: str) -> bool:
    """A name a tar reader on any system takes as one name: no backslash (Windows' separator: ``..\\..\\x``) and no
    control character."""
    return "\\" not in name and not any(ord(c) < 32 or ord(c) == 127 for c in name)


def _open_file(root_fd: int, parts: tuple[str, ...]) -> int:
    """``parts`` under the folder of ``root_fd``, each level opened with O_NOFOLLOW (a link anywhere: OSError)."""
    fd = root_fd
    opened: list[int] = []
    try:
        for name in parts[:-1]:
            fd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            opened.append(fd)
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
    finally:
        for level in opened:
            os.close(level)


def stream(folder: Plan) -> Iterator[bytes]:
    """The archive of a :func:`plan`, in chunks of at most :data:`CHUNK` bytes; exactly ``folder.size`` bytes in
    all, or it raises (:class:`UnsafeFolder`, OSError) and the download stops short."""
    root_fd = _open_dir(None, folder.root)
    sent = 0
    try:
        for entry in folder.entries:
            if entry.is_dir:
                yield entry.header
                sent += len(entry.header)
                continue
            try:
                fd = _open_file(root_fd, entry.parts)
            except OSError as exc:
                raise UnsafeFolder(f"{'/'.join(entry.parts)} changed during the download: {exc.strerror}") from exc
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_size != entry.size:
                    raise UnsafeFolder(f"{'/'.join(entry.parts)} changed during the download")
                os.set_blocking(fd, True)
                yield entry.header
                sent += len(entry.header)
                left = entry.size
                while left:
                    chunk = os.read(fd, min(CHUNK, left))
                    if not chunk:
                        raise UnsafeFolder(f"{'/'.join(entry.parts)} shrank during the download")
                    left -= len(chunk)
                    sent += len(chunk)
                    yield chunk
            finally:
                os.close(fd)
            if entry.size % BLOCK:
                pad = BLOCK - entry.size % BLOCK
                sent += pad
                yield b"\0" * pad
        end = folder.size - sent
        while end:
            piece = min(end, CHUNK)
            end -= piece
            yield b"\0" * piece
    finally:
        os.close(root_fd)
