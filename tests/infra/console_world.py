"""A small demo-like world for the console's browser tests, on the real stack, and the console serving it.

Real: the demo's workload (one chat prompt per tenant and the quick workflow) sent with each tenant's API key
through ``reprolane serve capture`` in front of the stack's vLLM, into its own Object-Lock bucket of the stack's
SeaweedFS (envelopes, indexes, the Merkle log), a signed checkpoint of the day (`capture.audit.checkpoint`), the
replay results written through the replayer's own code (`replayer.replay.replay_envelope`, `EnvelopeStore`),
the audit lake written by the archiver's code, and ``reprolane serve console`` itself in a child process.

Forced: which request diverges. The lane is `tests.replayer.support.FakeLane`, which echoes the recorded output
and, for the chosen request, takes the recorded runner-up at token `FORK_AT` (a real fork of the recorded
top-k), so the test does not depend on whether batching happened to change a greedy answer this run.

One bucket for every run (a bucket per run would use up SeaweedFS's volume slots); the checkpoints of every run
are signed with one fixed test key (`SIGNING_KEY`), so earlier runs' checkpoints of the same day still verify.
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path
from typing import Any

from capture.audit.checkpoint import write_checkpoint
from capture.audit.lake.archiver import Archiver
from capture.audit.lake.settings import LakeSettings
from capture.audit.operators import OPERATOR_KEYS
from capture.audit.store import AuditStore
from capture.ledger.key_file import new_key, write_key_file
from infra.demo.services import clean_environment, reprolane_argv, start_capture, write_demo_keys
from infra.demo.workload import Workload, drive, load_workload, tenants
from infra.stack.buckets import ensure_buckets, s3_client
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from replayer.errors import EnvelopeNotFoundError
from replayer.gate.golden import GoldenSet, golden_environment
from replayer.gate.replay import run_gate
from replayer.lanes.base import GenRequest
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope, ReplayedOutput, ReplayResult, StepLogprobs
from schemas.layout import LAKE_BUCKET
from tests.replayer.support import LANE_FINGERPRINT, REPLAY_KEY_ID, FakeLane, S3Target, flip, write_replay_request_keys

BUCKET = "reprolane-test-console"
FORK_AT = 2
#: Rows per page of the console's search results in this world.
SEARCH_PAGE = 2
#: A fixed Ed25519 test key (raw 32 bytes): every run signs its day's checkpoints with it.
SIGNING_KEY = bytes(range(100, 132))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def public_of(private: bytes) -> bytes:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return Ed25519PrivateKey.from_private_bytes(private).public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


@dataclass
class World:
    stack: StackInfo
    url: str
    keys: dict[str, str]  # operator keys: "viewer", "admin", "scoped" (a viewer of another tenant)
    diverged: Envelope
    identical: Envelope
    workflow: list[Envelope]
    results: dict[str, ReplayResult]
    replay_topic: str
    scoped_tenant: str
    tmp: Path
    prompts: dict[str, str] = field(default_factory=dict)  # request id -> the workload's prompt text
    process: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=Path)

    def client(self) -> Any:
        return s3_client(self.stack.s3_endpoint, self.stack.s3_credentials)

    def audit(self) -> AuditStore:
        return AuditStore(self.client(), BUCKET)


def _drifted(step: StepLogprobs, by: float) -> StepLogprobs:
    top = tuple(c.model_copy(update={"logprob": c.logprob + by}) for c in step.top)
    return step.model_copy(update={"logprob": step.logprob + by, "top": top})


class DriftLane(FakeLane):
    """`FakeLane` with the numeric drift a batched kernel shows: every logprob before the fork moves a little;
    at the fork the recorded runner-up is taken (`flip`), and the recorded tail follows it (so both sides have
    the same length and the per-token plot has values past the fork)."""

    def replay(self, request: GenRequest) -> ReplayedOutput:
        out = self.recorded[request.prompt_token_ids]
        at = self.perturb.get(request.prompt_token_ids)
        if at is None:
            return out
        forked = flip(out, at)
        steps = list(forked.logprobs or ())
        steps = [_drifted(st, -0.004 * (i + 1)) if i < at else st for i, st in enumerate(steps)]
        tail = list((out.logprobs or ())[at + 1 :])
        steps += tail
        text = "".join(st.token or "" for st in steps)
        ids = (*forked.token_ids, *out.token_ids[at + 1 :])
        return ReplayedOutput(token_ids=ids, text=text, logprobs=tuple(steps), finish_reason=out.finish_reason)


def small(workload: Workload) -> Workload:
    """One prompt per tenant and the quick workflow."""
    per_tenant = {p.tenant: p for p in workload.prompts}
    return Workload(workload.system, tuple(per_tenant.values()), workload.workflows)


def _capture(stack: StackInfo, tmp: Path) -> tuple[list[Envelope], dict[str, str]]:
    """Send the small workload through the real sidecar into `BUCKET`; the envelopes as stored, in send order,
    and each chat request's prompt text."""
    workload = small(load_workload(quick=True))
    api_keys = write_demo_keys(tmp / "api-keys.json", tenants(workload))
    port = free_port()
    capture = start_capture(
        stack,
        port=port,
        spool_dir=tmp / "spool",
        sample_rate=0.0,
        flag_tenants=(),
        api_keys_path=tmp / "api-keys.json",
        ready_key=next(iter(api_keys.values())),
        log=tmp / "capture.log",
        settings_env={"REPROLANE_CAPTURE_S3_BUCKET": BUCKET, "REPROLANE_CAPTURE_SIDECAR_ID": "console-test"},
    )
    try:
        capture.wait_ready(120.0)
        run_id = f"console-{uuid.uuid4().hex[:6]}"
        sent = asyncio.run(drive(f"http://127.0.0.1:{port}/v1", stack.model_name, run_id, workload, api_keys,
                                 quick=True, echo=lambda _: None))  # fmt: skip
    finally:
        capture.stop()
    assert [s.error for s in sent if s.error] == []
    store = EnvelopeStore(s3_client(stack.s3_endpoint, stack.s3_credentials), BUCKET)
    deadline = time.monotonic() + 90
    envelopes = []
    for s in sent:
        while True:
            try:
                envelopes.append(store.get_by_request_id(s.request_id))
                break
            except EnvelopeNotFoundError:
                assert time.monotonic() < deadline, f"{s.request_id} never reached S3"
                time.sleep(0.5)
    texts = {p.id: p.text for p in workload.prompts}
    return envelopes, {s.request_id: texts[s.prompt_id] for s in sent if s.prompt_id in texts}


def _replay(
    stack: StackInfo, envelopes: list[Envelope], diverged: Envelope, fork_step: Envelope
) -> dict[str, ReplayResult]:
    lane = DriftLane()
    for env in envelopes:
        lane.learn(env, diverge_at=FORK_AT if env in (diverged, fork_step) else None)
    settings = S3Target.from_stack(stack).settings(s3_bucket=BUCKET)
    store = EnvelopeStore.from_settings(settings)
    results = {}
    for env in envelopes:
        result = replay_envelope(env, lane, settings)
        store.put_result(env, result)
        results[env.request_id] = result
    return results


def _gate_runs(envelopes: list[Envelope], diverged: Envelope, out: Path) -> None:
    """Two release-gate runs over the captured envelopes as the golden set (`replayer.gate.replay.run_gate`, the CLI's
    own logic): one on a lane that echoes every answer (passes), one on the drifting lane (fails)."""
    golden = GoldenSet("s3:console-test", tuple(envelopes))
    baseline = golden_environment(golden)
    candidate = baseline.model_copy(update={"runtime": LANE_FINGERPRINT, "source": "local"})
    settings = ReplayerSettings()
    out.mkdir(parents=True, exist_ok=True)
    for n, forks in enumerate(((), (diverged,))):
        lane = DriftLane()
        for env in envelopes:
            lane.learn(env, diverge_at=FORK_AT if env in forks else None)
        report = run_gate(golden, baseline, candidate, lambda lane=lane: lane, settings)
        (out / f"gate-{n}.json").write_text(report.model_dump_json(indent=2), encoding="utf-8")


def _archive(stack: StackInfo, envelopes: list[Envelope], results: dict[str, ReplayResult], prefix: str) -> None:
    settings = LakeSettings(
        kafka_bootstrap=stack.kafka_bootstrap, envelope_topic=f"env-{prefix}", divergence_topic=f"div-{prefix}",
        s3_endpoint=stack.s3_endpoint, s3_access_key=stack.s3_access_key, s3_secret_key=stack.s3_secret_key,
        s3_bucket=BUCKET, lake_bucket=LAKE_BUCKET, lake_prefix=prefix, keys_bucket=LAKE_BUCKET,
    )  # fmt: skip
    from capture.audit.lake.store import Lake

    archiver = Archiver(settings, Lake.from_settings(settings))
    for env in envelopes:
        assert archiver.add(settings.envelope_topic, env.canonical())
    for result in results.values():
        assert archiver.add(settings.divergence_topic, result.event.model_dump_json().encode())
    asyncio.run(archiver.flush())


def _operator_keys(path: Path, other_tenant: str) -> dict[str, str]:
    viewer, viewer_entry = new_key(OPERATOR_KEYS, "auditor", None, ["viewer"])
    admin, admin_entry = new_key(OPERATOR_KEYS, "holds", None, ["hold-admin"])  # may view too (`role_grants`)
    scoped, scoped_entry = new_key(OPERATOR_KEYS, "scoped", other_tenant, ["viewer", "hold-admin"])
    write_key_file(path, [viewer_entry, admin_entry, scoped_entry])
    return {"viewer": viewer, "admin": admin, "scoped": scoped}


def build_world(stack: StackInfo, tmp: Path) -> World:
    ensure_buckets(stack.s3_endpoint, stack.s3_credentials, audit_bucket=BUCKET)
    envelopes, prompts = _capture(stack, tmp)
    chats = [e for e in envelopes if e.workflow is None]
    steps = sorted((e for e in envelopes if e.workflow is not None), key=lambda e: e.workflow.step if e.workflow else 0)
    diverged, identical = chats[0], chats[1]
    results = _replay(stack, envelopes, diverged, steps[1])
    prefix = f"lake-console-{uuid.uuid4().hex[:8]}"
    _archive(stack, envelopes, results, prefix)
    _gate_runs(envelopes, diverged, tmp / "gates")
    day = diverged.captured_at.astimezone(UTC).strftime("%Y-%m-%d")
    write_checkpoint(AuditStore(s3_client(stack.s3_endpoint, stack.s3_credentials), BUCKET), day, SIGNING_KEY,
                     retention=None)  # fmt: skip
    other = next(e.tenant for e in envelopes if e.tenant != diverged.tenant)
    keys = _operator_keys(tmp / "operator-keys.json", other)
    replay_topic = f"replay-requests-{uuid.uuid4().hex[:8]}"
    write_replay_request_keys(tmp / "replay-keys.json")
    signing_key_file = tmp / "audit-signing.key"
    signing_key_file.write_text(base64.b64encode(SIGNING_KEY).decode() + "\n", encoding="utf-8")
    signing_key_file.chmod(0o600)
    port = free_port()
    env = {
        **clean_environment(stack.run_dir),
        **stack_defaults(stack),
        "REPROLANE_CONSOLE_PORT": str(port),
        "REPROLANE_OPERATOR_KEYS_PATH": str(tmp / "operator-keys.json"),
        "REPROLANE_CONSOLE_REPLAY_KEYS_PATH": str(tmp / "replay-keys.json"),
        "REPROLANE_CONSOLE_REPLAY_KEY_ID": REPLAY_KEY_ID,
        "REPROLANE_CONSOLE_GATE_REPORTS_DIR": str(tmp / "gates"),
        "REPROLANE_CONSOLE_SEARCH_LIMIT": str(SEARCH_PAGE),  # small pages: the world's few requests span several
        "REPROLANE_AUDIT_S3_BUCKET": BUCKET,
        "REPROLANE_AUDIT_PUBLIC_KEY": base64.b64encode(public_of(SIGNING_KEY)).decode(),
        "REPROLANE_AUDIT_SIGNING_KEY": str(signing_key_file),  # "download evidence" signs the bundle's manifest
        "REPROLANE_REPLAYER_S3_BUCKET": BUCKET,
        "REPROLANE_REPLAYER_REPLAY_REQUEST_TOPIC": replay_topic,
        "REPROLANE_ARCHIVER_S3_BUCKET": BUCKET,
        "REPROLANE_ARCHIVER_LAKE_PREFIX": prefix,
    }
    log = tmp / "console.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([*reprolane_argv(), "serve", "console"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                cwd=os.getcwd())  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    world = World(stack, url, keys, diverged, identical, steps, results, replay_topic, other, tmp, prompts, proc, log)
    _wait_up(world)
    return world


def _wait_up(world: World) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while True:
        assert world.process is not None
        if world.process.poll() is not None:
            raise AssertionError(f"reprolane console exited: {world.log.read_text()[-3000:]}")
        try:
            if httpx.get(world.url + "/healthz", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"console not up: {world.log.read_text()[-3000:]}"
        time.sleep(0.3)


def stop(world: World) -> None:
    if world.process is not None and world.process.poll() is None:
        world.process.terminate()
        try:
            world.process.wait(15)
        except subprocess.TimeoutExpired:
            world.process.kill()
            world.process.wait(5)
