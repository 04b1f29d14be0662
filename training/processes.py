"""How a process of a multi-process run (``accelerate launch``) ends."""

from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``. A process of a multi-process run skips the interpreter's teardown: its outcome is written
    and its process group closed by then, and one two-process CPU (gloo) run in about six aborted in a C++ destructor
    at that point ("terminate called without an active exception", SIGABRT), which failed the whole launch after
    both processes had reported success. A one-process run exits normally."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach it
            pass
    os._exit(code)
