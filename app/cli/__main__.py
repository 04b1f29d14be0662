"""``python -m collage.app.cli``: the ``collage`` command (what torchrun and the tests launch)."""

from collage.app.cli.main import main
from collage.training.processes import exit_process

exit_process(main())
