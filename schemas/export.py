"""JSON Schema of the contract, for consumers that are not written in Python (pure: returns documents)."""

from __future__ import annotations

from typing import Any

from schemas.envelope import Envelope
from schemas.environment import EnvironmentFingerprint
from schemas.replay import DivergenceEvent, ReplayerHeartbeat, ReplayRequest, ReplayResult

EXPORTED: dict[str, type[Any]] = {
    "envelope.v1.schema.json": Envelope,
    "divergence-event.v1.schema.json": DivergenceEvent,
    "replay-result.v1.schema.json": ReplayResult,
    "replay-request.v1.schema.json": ReplayRequest,
    "replayer-heartbeat.v1.schema.json": ReplayerHeartbeat,
    "environment-fingerprint.v1.schema.json": EnvironmentFingerprint,
}


def json_schemas() -> dict[str, dict[str, Any]]:
    """File name -> JSON Schema document (draft 2020-12, as pydantic emits it)."""
    out: dict[str, dict[str, Any]] = {}
    for name, model in EXPORTED.items():
        doc: dict[str, Any] = {"$schema": "https://json-schema.org/draft/2020-12/schema"}
        doc.update(model.model_json_schema())
        out[name] = doc
    return out
