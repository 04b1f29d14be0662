"""The step time the time left comes from (training/step_timing.py): the current attempt's recent steps only."""

from __future__ import annotations

import pytest

from collage.training.step_timing import RecentStepTime


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_none_before_the_first_step_then_the_mean_of_the_recent_steps():
    clock = Clock()
    timing = RecentStepTime(window=3, clock=clock)
    assert timing.seconds_per_step is None  # a resumed attempt says "estimating", not what an earlier one took
    for seconds in (30.0, 2.0, 2.0, 2.0):  # a slow first step (compiling, a cold cache) ...
        clock.now += seconds
        timing.step_done()
    assert timing.seconds_per_step == pytest.approx(2.0)  # ... leaves the window
    clock.now += 5.0  # an evaluation made this step longer: the estimate moves, by a third of the difference
    assert timing.step_done() == pytest.approx(3.0)
