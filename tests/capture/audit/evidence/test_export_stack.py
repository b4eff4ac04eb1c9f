"""Evidence on the real stack: requests through the sidecar in front of the real vLLM, published by the real
publisher to SeaweedFS with the Merkle log, one replayed on the remote lane (the same vLLM), the scheduled
checkpointer (``reprolane serve checkpointer``, a child process) signing the day within its period, then
``reprolane audit evidence export`` and ``reprolane audit evidence verify`` as an outside verifier runs them: OK
offline with the pinned key fingerprint, and a named failure for a tampered bundle.

The first test's day log is today's (the sidecar stamps the capture time) and nothing changes S3 behind its back
(the tampering is on the bundle file); the second rewrites a log of a random day of its own. Each run names its
day (``--day``), so logs of other runs in the shared bucket are not its business.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from capture.audit.evidence.bundle import write_zip
from capture.audit.store import AuditStore
from capture.settings import CaptureSettings
from infra.stack.buckets import s3_client
from infra.stack.state import StackInfo
from replayer.lanes import make_lane
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore
from schemas import Envelope
from schemas.layout import capture_day, envelope_key, leaves_key
from tests.capture.audit.support import new_key, publish_through_s3, random_day
from tests.capture.request.test_app_stack import envelope_of, through_sidecar
from tests.cli_process import reprolane
from tests.factories import envelope

pytestmark = pytest.mark.stack

# Its own bucket (a SeaweedFS bucket takes volume slots: one for both tests), with Object Lock so that the bundle
# reports a real legal hold and retain-until date; a log's leaves are written without retention and can be rewritten.
BUCKET = "reprolane-test-evidence-lock"
KEY_NAME = "evidence.test/audit"
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]


async def capture_through_sidecar(stack: StackInfo, tmp_path: Path) -> list[Envelope]:
    """The `QUESTIONS`, asked through the sidecar (test_app_stack's: real vLLM, a real spool, API keys), as the
    envelopes it recorded."""
    found = []
    async with through_sidecar(stack, tmp_path) as (client, spool):
        for question in QUESTIONS:
            raw = await client.chat.completions.with_raw_response.create(
                model=stack.model_name,
                messages=[{"role": "user", "content": question}],
                max_tokens=8,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
            )
            found.append(await envelope_of(spool, raw.headers["x-reprolane-request-id"]))
    return found


def publish_settings(
    stack: StackInfo, spool_dir: Path, bucket: str = BUCKET, retention_days: int = 0
) -> CaptureSettings:
    return CaptureSettings(
        upstream="http://127.0.0.1:9",
        spool_dir=spool_dir,
        s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key,
        s3_secret_key=stack.s3_secret_key,
        s3_bucket=bucket,
        retention_days=retention_days,
        audit_log=True,
    )


def cli_env(stack: StackInfo, private: bytes, bucket: str = BUCKET) -> dict[str, str]:
    return {
        **os.environ,
        "REPROLANE_AUDIT_S3_ENDPOINT": stack.s3_endpoint,
        "REPROLANE_AUDIT_S3_ACCESS_KEY": stack.s3_access_key,
        "REPROLANE_AUDIT_S3_SECRET_KEY": stack.s3_secret_key,
        "REPROLANE_AUDIT_S3_BUCKET": bucket,
        "REPROLANE_AUDIT_LOG_RETENTION_DAYS": "0",
        "REPROLANE_AUDIT_SIGNING_KEY": base64.b64encode(private).decode(),
        "REPROLANE_AUDIT_LOG_ORIGIN": KEY_NAME,
    }


def wait_for(condition: Any, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def rezip(bundle: bytes, name: str, change: Any) -> bytes:

    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    target = next(n for n in members if n.startswith(name))
    members[target] = change(members[target])
    return write_zip(members, datetime.now(UTC))


async def captured_published_replayed(stack: StackInfo, client: Any, tmp_path: Path) -> tuple[Envelope, Any]:
    """Three requests through the sidecar, published with the Merkle log; the second replayed on the remote lane
    and its result stored as the replayer stores it."""
    envs = await capture_through_sidecar(stack, tmp_path)
    publish = publish_settings(stack, tmp_path / "spool", BUCKET, retention_days=1)
    await publish_through_s3(publish, envs, tmp_path / "spool")
    target = envs[1]
    lane = make_lane(ReplayerSettings(lane="remote", remote_url=stack.vllm_url, served_model_name=stack.model_name))
    try:
        result = replay_envelope(target, lane, ReplayerSettings())
    finally:
        lane.close()
    assert EnvelopeStore(client, BUCKET).put_result(target, result)
    return target, result


def checkpointer_signs(env: dict[str, str], store: AuditStore, day: str) -> None:
    """Run ``reprolane serve checkpointer --every 1 --day DAY`` until it has signed a new checkpoint of `day`."""
    prefix = f"audit/checkpoints/day={day}/"
    before = {k for k, _ in store.list_keys(prefix)}
    service = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from infra.cli.root import app; app()",
            "audit",
            "checkpointer",
            "--every",
            "1",
            "--day",
            day,
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        signed = wait_for(
            lambda: any(k.endswith(".checkpoint") and k not in before for k, _ in store.list_keys(prefix)), 30
        )
    finally:
        service.send_signal(signal.SIGTERM)
        _, err = service.communicate(timeout=30)
    assert signed, err
    assert service.returncode == 0, err
    assert "checkpointer: every 1.0s" in err  # it logs what it does


def _flip_last_signature_char(b: bytes) -> bytes:
    return b[:-6] + (b"AAAA=\n" if b[-6:] != b"AAAA=\n" else b"BBBB=\n")


def _other_root(b: bytes) -> bytes:
    """The checkpoint's root line (the third after the blank one) replaced by another valid root."""
    lines = b.split(b"\n")
    at = lines.index(b"") + 3
    lines[at] = base64.b64encode(bytes(32) if base64.b64decode(lines[at]) != bytes(32) else b"\x01" * 32)
    return b"\n".join(lines)


def _next_index(b: bytes) -> bytes:
    head, _, rest = b.partition(b"\nindex ")
    number, _, tail = rest.partition(b"\n")
    return head + b"\nindex " + str(int(number) + 1).encode() + b"\n" + tail


def test_a_captured_request_exports_as_evidence_that_verifies_offline(stack: StackInfo, tmp_path: Path) -> None:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
    target, result = asyncio.run(captured_published_replayed(stack, client, tmp_path))
    private, _public = new_key()
    env = cli_env(stack, private, BUCKET)
    store = AuditStore(client, BUCKET)
    checkpointer_signs(env, store, capture_day(target.captured_at))
    key = store_key(target)
    version = store.current_version(key)
    assert version is not None
    store.set_legal_hold(key, version, True)  # a hold and a retention date for the bundle to report
    try:
        bundle_path = tmp_path / "evidence.zip"
        done = reprolane("audit", "evidence", "export", target.request_id, "-o", str(bundle_path), env=env)
    finally:
        store.set_legal_hold(key, version, False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 replay result(s)" in done.stdout
    fingerprint = done.stdout.rsplit("--key-fingerprint ", 1)[1].strip()

    offline = {k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_")}  # no S3, no Kafka settings
    offline["REPROLANE_AUDIT_S3_ENDPOINT"] = "http://127.0.0.1:9"  # and anything that tried S3 would fail

    def verify(path: Path) -> subprocess.CompletedProcess[str]:
        return reprolane("audit", "evidence", "verify", str(path), "--key-fingerprint", fingerprint, env=offline)

    good = verify(bundle_path)
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.startswith(f"verified request {target.request_id}")
    assert "replays: 1 result(s)" in good.stdout
    bundle = bundle_path.read_bytes()
    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        assert zf.read("envelope.bin") == client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
        retention = json.loads(zf.read("retention.json"))
        assert retention["legal_hold"] is True
        assert retention["object_lock_mode"] == "COMPLIANCE"
        assert retention["retain_until"].startswith((target.captured_at + timedelta(days=1)).strftime("%Y-%m-%d"))
        replayed = json.loads(next(zf.read(n) for n in zf.namelist() if n.startswith("replays/")))
        assert replayed["event"]["verdict"] == result.event.verdict

    text = target.outcome.choices[0].text.encode()  # type: ignore[union-attr]
    cases = {
        "envelope bytes": rezip(bundle, "envelope.bin", lambda b: b.replace(text, text[::-1] + b"!")),
        "replay result": rezip(bundle, "replays/", lambda b: b.replace(b'"verdict":"', b'"verdict":"x', 1)),
        "signature": rezip(bundle, "proof.tlog-proof", _flip_last_signature_char),
        "proof": rezip(bundle, "proof.tlog-proof", _next_index),
        "checkpoint": rezip(bundle, "proof.tlog-proof", _other_root),
    }
    for label, tampered_bundle in cases.items():
        path = tmp_path / f"tampered-{label.replace(' ', '-')}.zip"
        path.write_bytes(tampered_bundle)
        failed = verify(path)
        assert failed.returncode == 1, (label, failed.stdout, failed.stderr)
        assert failed.stdout.startswith(f"FAILED request {target.request_id}: {label}: "), (label, failed.stdout)


def store_key(env: Envelope) -> str:
    return envelope_key(env.envelope_id(), env.tenant, env.captured_at)


def test_the_checkpointer_refuses_a_rewritten_log_on_seaweedfs(stack: StackInfo, tmp_path: Path) -> None:
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou, client.exceptions.BucketAlreadyExists):
        client.create_bucket(Bucket=BUCKET, ObjectLockEnabledForBucket=True)
    captured = random_day()  # a day of its own: this test rewrites the log
    day = capture_day(captured)
    envs = [envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured) for _ in range(3)]
    publish = publish_settings(stack, tmp_path / "spool")
    asyncio.run(publish_through_s3(publish, envs, tmp_path / "spool"))
    private, _ = new_key()
    env = cli_env(stack, private)
    first = reprolane("serve", "checkpointer", "--once", "--day", day, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"signed audit/checkpoints/day={day}/000000000003.checkpoint" in first.stdout
    key = leaves_key(day, 0)
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    head, a, b, rest = body[:16], body[16:80], body[80:144], body[144:]
    client.put_object(Bucket=BUCKET, Key=key, Body=head + b + a + rest)  # swap two signed leaves
    extra = envelope(request_id=f"req-{uuid.uuid4().hex[:10]}", captured_at=captured)
    asyncio.run(publish_through_s3(publish, [extra], tmp_path / "spool2"))  # and the log grows
    refused = reprolane("serve", "checkpointer", "--once", "--day", day, env=env)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert f"REFUSED {day}: log of {day} is not consistent with checkpoint" in refused.stdout
    assert "refused to sign" in refused.stderr
    keys = [k for k, _ in AuditStore(client, BUCKET).list_keys(f"audit/checkpoints/day={day}/")]
    assert keys == [f"audit/checkpoints/day={day}/000000000003.checkpoint"]
