"""The audit tests' helpers: a random capture day stays random whatever seeded the process's `random`."""

from __future__ import annotations

import random

from tests.capture.audit.support import random_day


def test_a_random_day_is_not_repeated_after_an_engine_seeds_random() -> None:
    """An in-process vLLM engine calls ``random.seed(0)``; two tests of one worker that shared a bucket then drew
    the same day and read each other's checkpoints."""
    state = random.getstate()
    try:
        random.seed(0)
        first = random_day()
        random.seed(0)
        assert random_day() != first
    finally:
        random.setstate(state)
