"""``reprolane audit evidence reexecute BUNDLE --model-dir DIR``: replay a re-executable bundle's request offline.

In order, each step refusing with what it found:

1. the bundle verifies as ``evidence verify`` checks it (`capture.audit.evidence.verify`): the envelope bytes are
   the ones the Merkle log committed to, under a checkpoint the pinned key signed, and every other member (the
   schedule records, the model manifest) is what the signed manifest lists. A changed token id, logprob,
   schedule record, runtime fingerprint or manifest is named here (exit 1);
2. it is re-executable: the members `infra.reexecution.export` adds are there, and the model manifest is the one
   the record's artifact hashes were taken from;
3. the local model directory holds exactly the manifest's files (every file that differs or is missing is named),
   and the schedule lane built here has the recorded runtime's numerics (`replayer.schedule.lane.ScheduleLane`
   refuses, naming every numeric field that differs: torch, vLLM, the CPU's instruction set, threads, ...);
4. the window is rebuilt with fillers in the other requests' places and the request replayed inside it
   (`replayer.schedule.replay.replay_on_schedule`), the output compared with the recorded one token by token and
   logprob by logprob.

Nothing here opens a network connection: the bundle and the model directory are all it reads.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from capture.audit.evidence.bundle import ENVELOPE, MODEL_MANIFEST, REEXECUTION, SCHEDULE, read_zip
from capture.audit.evidence.export import EvidenceError
from capture.audit.evidence.verify import BundleReport, PinnedKey, verify_bundle
from infra.clients.digest import hash_directory
from infra.reexecution.export import artifact_differences
from infra.reexecution.window import window_of
from replayer.errors import NotReplayableError
from replayer.schedule.lane import ScheduleLane
from replayer.schedule.replay import replay_on_schedule
from replayer.schedule.store import ScheduleWindow
from replayer.settings import ReplayerSettings
from schemas import ContractError, Envelope, ReplayResult, decode_envelope
from schemas.manifest import MANIFEST_NAME, decode_manifest
from schemas.schedule import EngineStart

LaneFactory = Callable[[ReplayerSettings, EngineStart], ScheduleLane]


@dataclass(frozen=True)
class Reexecuted:
    """What a re-execution found: the bundle's check, the record, and the replay's result."""

    report: BundleReport
    envelope: Envelope
    result: ReplayResult
    engine: int = 0  # which engine started here replayed it (`reexecute_all` starts one per recorded engine)

    @property
    def reproduced(self) -> bool:
        """Bit for bit: the same token ids and logprobs, in the recorded schedule."""
        event = self.result.event
        return event.verdict == "bitwise" and event.schedule_reproduced is True


def model_differences(model_dir: Path, files: dict[str, str]) -> list[str]:
    """The files of `model_dir` that are not the manifest's: missing, changed, or not in it."""
    try:
        local = hash_directory(model_dir, exclude=(MANIFEST_NAME,))
    except OSError as exc:
        return [f"{model_dir}: cannot read: {exc}"]
    out = [f"{name}: missing" for name in sorted(files.keys() - local.keys())]
    out += [f"{name}: sha256 {local[name][:12]}… != {files[name][:12]}…" for name in sorted(files) if
            name in local and local[name] != files[name]]  # fmt: skip
    out += [f"{name}: not in the manifest" for name in sorted(local.keys() - files.keys())]
    return out


@dataclass(frozen=True)
class Checked:
    """A bundle that passed steps 1 to 3 (module doc) but the runtime's: what its replay needs."""

    report: BundleReport
    envelope: Envelope
    window: ScheduleWindow


def check(data: bytes, pin: PinnedKey, model_dir: Path) -> Checked:
    """Steps 1 to 3 of the module doc but the runtime's (the lane checks it when it starts). `EvidenceError` (exit 1)
    when the bundle fails its check or is not re-executable; `NotReplayableError` (exit 2) when the model files are
    not the recorded ones; `ContractError` (exit 2) when it is no bundle."""
    report = verify_bundle(data, pin)
    if not report.ok:
        raise EvidenceError(f"the bundle does not verify: {report.problems[0].line()}")
    members, _ = read_zip(data)
    missing = [name for name in (SCHEDULE, REEXECUTION, MODEL_MANIFEST) if name not in members]
    if missing:
        raise EvidenceError(f"the bundle is not re-executable (no {', '.join(missing)}): export it with --reexecutable")
    try:
        envelope = decode_envelope(members[ENVELOPE])
        manifest = decode_manifest(members[MODEL_MANIFEST])
        window = window_of(members[SCHEDULE], members[REEXECUTION])
    except ContractError as exc:
        raise EvidenceError(f"the bundle's re-execution parts do not read: {exc}") from exc
    differs = artifact_differences(manifest, envelope)
    if differs:
        raise EvidenceError("model manifest: not the model of the record: " + "; ".join(differs))
    local = model_differences(model_dir, manifest.files)
    if local:
        shown = "; ".join(local[:8]) + ("; ..." if len(local) > 8 else "")
        raise NotReplayableError(f"{model_dir} is not the recorded model ({len(local)} file(s)): {shown}")
    if window.engine is None:
        raise EvidenceError("the bundle's schedule records name no engine")
    return Checked(report, envelope, window)


def reexecute_all(
    bundles: Sequence[bytes], pin: PinnedKey, model_dir: Path, *, lane_factory: LaneFactory = ScheduleLane
) -> list[Reexecuted]:
    """Re-execute every bundle (a workflow's steps, say): each is checked before any runs (the first that fails
    raises, as `check` says), then replayed on one lane per recorded engine configuration, started once."""
    checked = [check(data, pin, model_dir) for data in bundles]
    settings = ReplayerSettings(model_dir=model_dir)
    lanes: dict[str, ScheduleLane] = {}
    done: list[Reexecuted] = []
    try:
        for item in checked:
            engine = item.window.engine
            assert engine is not None  # `check`
            key = engine.model_dump_json()  # one lane per recorded engine: bundles of one engine share it
            lane = lanes.get(key)
            if lane is None:
                lane = lanes[key] = lane_factory(settings, engine)
            result, _ = replay_on_schedule(item.envelope, item.window, lane, settings)
            done.append(Reexecuted(item.report, item.envelope, result, list(lanes).index(key)))
    finally:
        for lane in lanes.values():
            lane.close()
    return done


def reexecute(data: bytes, pin: PinnedKey, model_dir: Path, *, lane_factory: LaneFactory = ScheduleLane) -> Reexecuted:
    """Re-execute the bundle `data` (module doc; `reexecute_all` of one)."""
    (done,) = reexecute_all([data], pin, model_dir, lane_factory=lane_factory)
    return done
