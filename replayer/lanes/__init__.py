"""Execution lanes behind one interface (`Lane`, which runs a `GenRequest`); `make_lane` builds the one the
settings name.

- ``vllm``: vLLM in this process, one sequence at a time, no prefix cache (`replayer.lanes.vllm_lane`).
- ``remote``: a deterministic OpenAI-compatible vLLM server elsewhere (`replayer.lanes.remote`).
- ``transformers``: a float32 reference lane on plain transformers (`replayer.lanes.transformers_lane`).

Beside the lanes: `replayer.lanes.base` (the interface and what the lanes share), `replayer.lanes.vllm_params`
(the contract as vLLM's sampling parameters, for both vLLM lanes) and `replayer.lanes.batch_engine` (not a lane:
the many-prompts-per-call engine that the replay matrix and ``explain`` run).

Each lane module is imported only when its lane is asked for, and imports its heavy libraries only inside
functions, so importing this package costs nothing. This package imports `replayer.errors`,
`replayer.settings` and `schemas`, never the rest of the replayer.
"""

from __future__ import annotations

import importlib
from typing import Final

from replayer.lanes.base import GenRequest, Lane, resolve_model_dir
from replayer.settings import LaneName, ReplayerSettings

__all__ = ["LANE_CLASSES", "GenRequest", "Lane", "make_lane", "resolve_model_dir"]

#: Each lane's class, by its name: (module, class), the module imported only when its lane is asked for.
LANE_CLASSES: Final[dict[LaneName, tuple[str, str]]] = {
    "vllm": ("replayer.lanes.vllm_lane", "VllmLane"),
    "remote": ("replayer.lanes.remote", "RemoteLane"),
    "transformers": ("replayer.lanes.transformers_lane", "TransformersLane"),
}


def make_lane(settings: ReplayerSettings) -> Lane:
    """Start the lane named by ``settings.lane``; raises `LaneUnavailableError` (with the reason) if it can't."""
    module, name = LANE_CLASSES[settings.lane]
    lane: Lane = getattr(importlib.import_module(module), name)(settings)
    return lane
