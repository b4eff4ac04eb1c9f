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

from replayer.errors import LaneUnavailableError
from replayer.lanes.base import GenRequest, Lane, resolve_model_dir
from replayer.settings import ReplayerSettings

__all__ = ["GenRequest", "Lane", "make_lane", "resolve_model_dir"]


def make_lane(settings: ReplayerSettings) -> Lane:
    """Start the lane named by ``settings.lane``; raises `LaneUnavailableError` (with the reason) if it can't."""
    if settings.lane == "vllm":
        from replayer.lanes.vllm_lane import VllmLane

        return VllmLane(settings)
    if settings.lane == "remote":
        from replayer.lanes.remote import RemoteLane

        return RemoteLane(settings)
    if settings.lane == "transformers":
        from replayer.lanes.transformers_lane import TransformersLane

        return TransformersLane(settings)
    raise LaneUnavailableError(f"unknown lane {settings.lane!r}")  # pragma: no cover - settings forbid it
