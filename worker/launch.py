"""``python -m collage.worker.launch MODULE ARGS...``: run a launcher module (``accelerate.commands.launch``,
``torch.distributed.run``) as ``python -m MODULE ARGS...`` would, after asking Linux to kill this process when its
worker dies (``PR_SET_PDEATHSIG``). The training processes below already die with their parent; without this a
launcher whose worker was killed alone would live on, an orphan holding a rendezvous port. (Asked for here, not in
a ``preexec_fn``: the worker has threads, and only async-signal-safe work may run between its fork and exec.)"""

from __future__ import annotations

import runpy
import sys

from .child import die_with_parent


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m collage.worker.launch MODULE [ARGS...]")
    die_with_parent()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
