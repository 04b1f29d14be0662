"""What Collage writes is readable by its owner alone: run folders, checkpoints, rollout images, the store.

Every Collage entry point (``collage ...``, the training child, the dataset helper) calls :func:`private_umask`
once, first, so every file and folder it or a library it drives creates is 0600 / 0700. Code that may also run
inside someone else's process (the trainer in a notebook, where the umask is not ours to change) sets the modes
of what it writes itself, with :func:`private_dir` and :func:`private_tree`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

PRIVATE_UMASK = 0o077
DIR_MODE = 0o700
FILE_MODE = 0o600


def private_umask() -> None:
    """Make every file and folder this process creates from now on private (0600 / 0700)."""
    os.umask(PRIVATE_UMASK)


def private_dir(path: Path) -> Path:
    """Create ``path`` (and missing parents) and make ``path`` itself 0700, whatever the umask."""
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, DIR_MODE)
    return path


def private_tree(root: Path) -> None:
    """Folders 0700 and files 0600 under ``root`` (``root`` included); symbolic links are left alone."""
    for folder, dirs, files in os.walk(root):
        os.chmod(folder, DIR_MODE)
        for name in files:
            file = os.path.join(folder, name)
            if stat.S_ISREG(os.lstat(file).st_mode):
                os.chmod(file, FILE_MODE)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(folder, d))]
