"""How long a training step takes now: the mean of the current attempt's recent steps.

The time left shown for a run (the dashboard, ``collage submit --follow``) is ``(max_steps - step) x`` this. The
mean since the attempt started would carry its first, slow steps (compiling, a cold cache) for the whole run, and
the mean since the run started would divide one attempt's time by steps an earlier attempt did (after a resume:
"4 s left" at step 27 of 200). A window of recent steps follows a machine that got busier or an evaluation that
became due, without swinging on one step.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW = 10  # steps the estimate is the mean of


class RecentStepTime:
    """Call :meth:`step_done` after each step; :attr:`seconds_per_step` is the mean of the last ``window`` steps'
    times (their evaluations included), None before the first step of this attempt."""

    def __init__(self, window: int = WINDOW, clock=time.monotonic):
        self.clock = clock
        self.times: deque[float] = deque(maxlen=window)
        self.last = clock()

    def step_done(self) -> float:
        now = self.clock()
        self.times.append(now - self.last)
        self.last = now
        return self.seconds_per_step  # type: ignore[return-value]

    @property
    def seconds_per_step(self) -> float | None:
        return sum(self.times) / len(self.times) if self.times else None
