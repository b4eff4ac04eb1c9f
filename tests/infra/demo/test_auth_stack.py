"""The demo runs with authentication on (issue 18): its sidecar (`infra.demo.services.start_capture`, the real
``reprolane serve capture``) takes the key file the demo writes (0600), and its workload (`infra.demo.workload`,
the official ``openai`` client) sends each tenant's key. Only the sidecar and the workload, on the real stack;
tests/infra/demo/test_run.py runs the whole demo (replayer and auditor included)."""

from __future__ import annotations

import asyncio
import socket
import stat
import time
import uuid
from pathlib import Path

import httpx
import pytest

from infra.demo.services import start_capture, write_demo_keys
from infra.demo.workload import Workload, drive, load_workload, tenants
from infra.stack.state import StackInfo
from replayer.errors import EnvelopeNotFoundError
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore

pytestmark = pytest.mark.stack


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def small(workload: Workload) -> Workload:
    """One prompt per tenant and the quick workflow (two flagged steps)."""
    per_tenant = {p.tenant: p for p in workload.prompts}
    return Workload(workload.system, tuple(per_tenant.values()), workload.workflows)


def test_the_demo_sidecar_needs_keys_and_its_workload_sends_them(stack: StackInfo, tmp_path: Path) -> None:
    workload = small(load_workload(quick=True))
    keys_file = tmp_path / "api-keys.json"
    keys = write_demo_keys(keys_file, tenants(workload))
    assert stat.S_IMODE(keys_file.stat().st_mode) == 0o600
    assert set(keys) == {"finance", "health", "insurance"}
    port, spool_dir = free_port(), tmp_path / "spool"
    capture = start_capture(
        stack, port=port, spool_dir=spool_dir, sample_rate=0.0, flag_tenants=(), api_keys_path=keys_file,
        ready_key=keys["finance"], log=tmp_path / "capture.log",
    )  # fmt: skip
    try:
        capture.wait_ready(90.0)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10.0).status_code == 401
        run_id = f"auth-{uuid.uuid4().hex[:6]}"
        sent = asyncio.run(
            drive(f"http://127.0.0.1:{port}/v1", stack.model_name, run_id, workload, keys, quick=True, echo=print)
        )
    finally:
        capture.stop()
    assert [s.error for s in sent if s.error] == []
    assert all(s.request_id.startswith("rl-") for s in sent)
    assert all(s.client_request_id.startswith(run_id) for s in sent)

    store = EnvelopeStore.from_settings(
        ReplayerSettings(s3_endpoint=stack.s3_endpoint, s3_access_key=stack.s3_access_key,
                         s3_secret_key=stack.s3_secret_key, s3_region=stack.s3_region, s3_bucket=stack.audit_bucket)
    )  # fmt: skip
    deadline = time.monotonic() + 60
    for s in sent:  # each tenant finds its requests by its own X-Request-Id, in S3, under its key's tenant
        while True:
            try:
                (env,) = store.find_by_client_request_id(s.tenant, s.client_request_id)
                break
            except EnvelopeNotFoundError:
                assert time.monotonic() < deadline, f"{s.client_request_id} never reached S3"
                time.sleep(0.5)
        assert env.request_id == s.request_id
        assert env.flagged == (s.workflow is not None)
