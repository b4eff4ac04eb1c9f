"""Fixtures the replayer's stack tests share."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from replayer.schedule.lane import ScheduleLane


@pytest.fixture(scope="module")
def lane_box() -> Iterator[dict[str, ScheduleLane]]:
    """The schedule lane engines of one test module, built on demand (one per production engine's settings) and
    closed when the module is done."""
    box: dict[str, ScheduleLane] = {}
    yield box
    for lane in box.values():
        lane.close()
