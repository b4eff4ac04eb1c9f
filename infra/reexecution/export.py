"""What ``export --reexecutable`` adds to an evidence bundle: the schedule window as shapes, the model manifest.

Read where the replayer reads them: the window from the schedule store (`replayer.schedule.window.read_window`,
complete or refused), the manifest from the model directory the deployment serves, which must be the one the
record's artifact hashes were taken from. A sealed record is refused: its bytes are ciphertext, and re-executing
it would hand its prompt to whoever holds the bundle.
"""

from __future__ import annotations

from pathlib import Path

from capture.audit.evidence.bundle import MODEL_MANIFEST, REEXECUTION, SCHEDULE, SCHEDULE_PROOF
from capture.audit.evidence.export import EvidenceError, ExtraMembers, LogProver
from infra.reexecution.window import schedule_proof, shapes_only
from replayer.errors import ReplayerError
from replayer.schedule.store import ScheduleStore, ScheduleWindow
from replayer.schedule.window import read_window
from schemas import ContractError, Envelope, decode_envelope
from schemas.manifest import MANIFEST_NAME, ModelManifest, decode_manifest
from schemas.schedule import ScheduleRecord
from schemas.sealed import is_sealed


def artifact_differences(manifest: ModelManifest, envelope: Envelope) -> list[str]:
    """The artifact hashes the record names that the manifest does not have (``"model_sha256: a != b"``)."""
    recorded = envelope.artifacts
    out = []
    for name in ("model_sha256", "tokenizer_sha256", "chat_template_sha256"):
        want = getattr(recorded, name)
        if want is not None and getattr(manifest, name) != want:
            out.append(f"{name}: the record's {want[:12]}… != the manifest's {getattr(manifest, name)[:12]}…")
    return out


def _segments(schedules: ScheduleStore, window: ScheduleWindow) -> dict[int, tuple[ScheduleRecord, ...]]:
    """The stored segments `window` was read from (its engine's first one, with the engine record, included)."""
    assert window.engine is not None
    engine_id = window.engine.engine_id
    found: dict[int, tuple[ScheduleRecord, ...]] = {}
    read = window.segments or range(window.first_segment, window.last_segment + 1)
    for seq in {0, *read}:
        records = schedules.segment(engine_id, seq)
        if records is None:
            raise EvidenceError(f"segment {seq} of engine {engine_id} is gone from the schedule store")
        found[seq] = records
    return found


def reexecutable_members(schedules: ScheduleStore, model_dir: Path) -> ExtraMembers:
    """The members of a re-executable bundle, from the envelope's stored bytes (`export_bundle`'s ``extra``)."""

    def members(body: bytes, prove: LogProver) -> dict[str, bytes]:
        if is_sealed(body):
            raise EvidenceError("a sealed record is not exported re-executable: its prompt is its tenant's secret")
        try:
            envelope = decode_envelope(body)
        except ContractError as exc:
            raise EvidenceError(f"the envelope does not decode: {exc}") from exc
        if envelope.schedule is None:
            raise EvidenceError(
                f"{envelope.request_id} names no engine schedule (captured without the schedule recorder): "
                "nothing to re-execute it in"
            )
        try:
            window = read_window(schedules, envelope)
        except ReplayerError as exc:
            raise EvidenceError(f"the schedule of {envelope.request_id}: {exc}") from exc
        if not window.complete:
            raise EvidenceError(f"the schedule of {envelope.request_id} is not complete yet: {window.gap}")
        try:
            raw = (model_dir / MANIFEST_NAME).read_bytes()
            manifest = decode_manifest(raw, model_dir)
        except (OSError, ContractError) as exc:
            raise EvidenceError(f"the model manifest of {model_dir}: {exc}") from exc
        differs = artifact_differences(manifest, envelope)
        if differs:
            raise EvidenceError(f"{model_dir} is not the model of the record: " + "; ".join(differs))
        schedule, settings = shapes_only(window)
        proof = schedule_proof(window, _segments(schedules, window), prove)
        return {SCHEDULE: schedule, REEXECUTION: settings, SCHEDULE_PROOF: proof, MODEL_MANIFEST: raw}

    return members
