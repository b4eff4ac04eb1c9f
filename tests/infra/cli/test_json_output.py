"""Machine output: every command with a ``--json`` option prints exactly one JSON document on stdout.

What they read is what the sidecar writes: the envelope goes through the real publisher (`capture.publishing.publisher`:
compact by default, sealed for an encrypted tenant), so ``show --json`` must decode every stored form into the
canonical JSON (it once decoded the compact bytes as UTF-8 and crashed on every stored envelope: issue 30). A fast
test drives the real sidecar app (fake upstream) and publisher into a moto S3.

The commands are found by walking the real root app (`infra.cli.root.build_app`), so a command that gains ``--json``
cannot escape: `test_every_json_command_has_a_run_here` fails until it has an entry in `RUNS`. Each entry is run
for real (marked ``stack``): the real ``reprolane`` in a process of its own against the session's stack, its
stdout handed to `json.loads` whole. The lane commands run the in-process vLLM engine (``replay request`` on
``--lane vllm``, ``explain``, ``matrix``), whose logging and prints went to stdout before: they must show on stderr,
and stdout must still parse. A command that another stack test already runs for real with ``--json``, reading its
whole stdout as one document and its engine's logs on stderr, is named in `RUN_ELSEWHERE` instead, so that its
engine work is done once: ``audit evidence reexecute`` (tests/infra/reexecution/test_reexecute_stack.py), ``replay
matrix`` and ``replay explain`` (tests/replayer/test_matrix_stack.py).
Human output is held to the same rule: the text report of ``replay request`` on that lane is alone on stdout, the
engine's log lines on stderr (some 130 of them came first, on stdout: issue 30).
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
import typer
from typer.testing import CliRunner

from capture.settings import CaptureSettings
from infra.cli.root import build_app
from infra.demo.services import clean_environment
from infra.stack.state import StackInfo
from schemas import Envelope, WorkflowRef
from schemas.envelope_compact import is_compact
from schemas.layout import envelope_key
from schemas.sealed import is_sealed
from tests.capture.audit.support import publish_through_s3
from tests.capture.support import CHAT, only, sidecar
from tests.cli_process import reprolane
from tests.moto_s3 import moto_server
from tests.replayer.support import S3Target, record_from_stack

REPO = Path(__file__).resolve().parents[3]
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def json_commands() -> dict[tuple[str, ...], bool]:
    """Every command of the root app that has a ``--json`` option: its path -> whether ``--json`` is a flag."""
    found: dict[tuple[str, ...], bool] = {}

    def walk(command: Any, path: tuple[str, ...], ctx: Any) -> None:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), (*path, name), ctx)
            return
        for param in command.params:
            if "--json" in getattr(param, "opts", ()):
                found[path] = bool(getattr(param, "is_flag", False))

    root = typer.main.get_command(build_app())
    walk(root, (), typer.Context(root))
    return found


@dataclass(frozen=True)
class Recorded:
    """What the runs need: a recorded envelope (a workflow's step 0) stored in the stack's S3."""

    envelope: Envelope


Run = Callable[[Recorded], list[str]]

#: How each ``--json`` command is run for real (its arguments after ``reprolane``).
RUNS: dict[tuple[str, ...], Run] = {
    ("audit", "show"): lambda r: ["audit", "show", r.envelope.request_id, "--json"],
    ("replay", "request"): lambda r: ["replay", "request", r.envelope.request_id, "--json", "--via", "local",
                                      "--lane", "vllm"],
    ("replay", "workflow"): lambda r: ["replay", "workflow", _workflow(r.envelope), "--tenant", r.envelope.tenant,
                                       "--json", "--lane", "remote"],
    ("audit", "query"): lambda r: ["audit", "query", "SELECT 1 AS one", "--json"],
    ("release", "fingerprint", "history"): lambda r: ["release", "fingerprint", "history", "--deployment",
                                                      f"json-{r.envelope.request_id}", "--json"],
}  # fmt: skip

#: The commands whose run loads the in-process vLLM engine: its logs must be on stderr.
ENGINE_RUNS = {("replay", "request")}

#: ``--json`` commands run for real by another stack test, which holds their whole stdout to one document and finds
#: the engine's logs on stderr: its module and test.
RUN_ELSEWHERE: dict[tuple[str, ...], tuple[str, str]] = {
    ("audit", "evidence", "reexecute"): (
        "tests/infra/reexecution/test_reexecute_stack.py",
        "test_batched_staggered_and_workflow_requests_reexecute_offline_bit_for_bit_and_every_tamper_is_named",
    ),
    ("replay", "matrix"): ("tests/replayer/test_matrix_stack.py", "test_small_matrix_for_real"),
    ("replay", "explain"): (
        "tests/replayer/test_matrix_stack.py",
        "test_explain_a_request_recorded_under_concurrent_load",
    ),
}
#: What the source of each of those modules must say: the command with ``--json``, its whole stdout parsed as one
#: document, and the engine's logging found on stderr.
RUN_ELSEWHERE_NEEDS = ('"--json"', "json.loads(ran.stdout)", '"vllm" in ran.stderr.lower()')


def _workflow(envelope: Envelope) -> str:
    assert envelope.workflow is not None
    return envelope.workflow.workflow_id


def test_every_json_command_has_a_run_here() -> None:
    found = json_commands()
    assert not set(RUNS) & set(RUN_ELSEWHERE)
    assert set(found) == set(RUNS) | set(RUN_ELSEWHERE), (
        "a command with --json needs an entry in RUNS (and one JSON document on stdout)"
    )
    for path, (module, test) in RUN_ELSEWHERE.items():
        source = (REPO / module).read_text(encoding="utf-8")
        assert f"def {test}(" in source, (path, module)
        for needed in (f'"{path[-1]}"', *RUN_ELSEWHERE_NEEDS):
            assert needed in source, (path, module, needed)
    assert all(found.values()), "--json is a flag: the document on stdout (a file is --report FILE)"


@pytest.fixture(scope="module")
async def recorded(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    """The stack's vLLM answer as an envelope, stored by the sidecar's real publisher (compact, with its index
    objects, the client request id's among them) in the stack's audit bucket."""
    envelope = record_from_stack(stack, "json-output-001", MESSAGES, max_tokens=6, target_level="token")
    envelope = envelope.model_copy(update={
        "request_id": f"rl-{uuid.uuid4().hex}", "client_request_id": f"ticket-{uuid.uuid4().hex[:8]}",
        "workflow": WorkflowRef(workflow_id=f"wf-{uuid.uuid4().hex[:12]}", step=0),
    })  # fmt: skip
    tmp = tmp_path_factory.mktemp("json-output")
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9", spool_dir=tmp / "spool", s3_endpoint=stack.s3_endpoint,
        s3_access_key=stack.s3_access_key, s3_secret_key=stack.s3_secret_key, s3_region=stack.s3_region,
        s3_bucket=stack.audit_bucket,
    )  # fmt: skip
    await publish_through_s3(settings, [envelope], tmp / "spool")
    s3 = S3Target.from_stack(stack)
    key = envelope_key(envelope.envelope_id(), envelope.tenant, envelope.captured_at)
    assert is_compact(s3.client().get_object(Bucket=s3.bucket, Key=key)["Body"].read()), "stored as the sidecar does"
    return Recorded(envelope)


def run_cli(stack: StackInfo, args: list[str]) -> subprocess.CompletedProcess[str]:
    """The real ``reprolane ARGS`` in a process of its own against the session's stack."""
    return reprolane(*args, env=clean_environment(stack.run_dir), timeout=900)


@pytest.mark.stack
@pytest.mark.parametrize("path", sorted(RUNS), ids=" ".join)
def test_a_json_command_prints_one_document_on_stdout(
    path: tuple[str, ...], recorded: Recorded, stack: StackInfo
) -> None:
    args = RUNS[path](recorded)
    proc = run_cli(stack, args)
    assert proc.returncode in (0, 1), f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr[-3000:]}"
    document = json.loads(proc.stdout)  # the whole of stdout is one document
    assert document, proc.stdout
    if path == ("audit", "show"):
        assert proc.stdout.rstrip("\n").encode() == recorded.envelope.canonical()  # the stored bytes themselves
    if path in ENGINE_RUNS:
        assert "vllm" in proc.stderr.lower(), "the engine's own logging should be there, on stderr"


#: A line of vLLM's log format (``%(levelname)s %(asctime)s [file:line]``, dates as ``%m-%d %H:%M:%S``).
ENGINE_LOG_LINE = re.compile(r"\b(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[")


@pytest.mark.stack
def test_the_text_report_of_a_replay_is_alone_on_stdout(recorded: Recorded, stack: StackInfo) -> None:
    env = recorded.envelope
    proc = run_cli(stack, ["replay", "request", env.request_id, "--via", "local", "--lane", "vllm"])
    assert proc.returncode in (0, 1), proc.stderr[-3000:]
    assert proc.stdout.startswith(f"Replay of request {env.request_id} (envelope "), proc.stdout[:3000]
    assert not [line for line in proc.stdout.splitlines() if ENGINE_LOG_LINE.search(line)], proc.stdout[:3000]
    assert "chatcmpl-" not in proc.stdout  # user-facing text names request ids, never the engine's own
    assert ENGINE_LOG_LINE.search(proc.stderr), "the engine's own logging should be there, on stderr"


@pytest.mark.stack
def test_show_json_finds_a_client_request_id(recorded: Recorded, stack: StackInfo) -> None:
    env = recorded.envelope
    assert env.client_request_id is not None
    proc = run_cli(
        stack, ["audit", "show", "--client-request-id", env.client_request_id, "--tenant", env.tenant, "--json"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.rstrip("\n").encode() == env.canonical()


# -- every stored form, written by the real sidecar and publisher (fast: fake upstream, moto S3) ------------------

KEK = os.urandom(32)
FORMS = ("compact", "json", "sealed")


@pytest.fixture(scope="module")
def moto_bucket() -> Iterator[tuple[str, str]]:
    """A moto S3 endpoint and one Object-Lock bucket (the sidecar writes with retention), as the audit bucket."""
    with moto_server() as endpoint:
        bucket = f"json-{uuid.uuid4().hex[:8]}"
        moto_client(endpoint).create_bucket(Bucket=bucket, ObjectLockEnabledForBucket=True)
        yield endpoint, bucket


def moto_client(endpoint: str) -> Any:
    return boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="k", aws_secret_access_key="s"
    )


async def captured(tenant: str, client_id: str) -> Envelope:
    """The envelope the sidecar spools for one chat request of `tenant` naming itself `client_id`."""
    headers = {"X-Reprolane-Tenant": tenant, "X-Request-Id": client_id}
    async with sidecar() as (client, _upstream, spool, _metrics):
        assert (await client.post("/v1/chat/completions", json=CHAT, headers=headers)).status_code == 200
    return only(spool)


def cli_env(endpoint: str, bucket: str) -> dict[str, str]:
    return {
        "REPROLANE_REPLAYER_S3_ENDPOINT": endpoint, "REPROLANE_REPLAYER_S3_ACCESS_KEY": "k",
        "REPROLANE_REPLAYER_S3_SECRET_KEY": "s", "REPROLANE_REPLAYER_S3_BUCKET": bucket,
        "REPROLANE_REPLAYER_KEYS_BUCKET": bucket, "REPROLANE_REPLAYER_KEK": base64.b64encode(KEK).decode(),
    }  # fmt: skip


@pytest.mark.parametrize("form", FORMS)
async def test_show_json_prints_the_canonical_json_of_every_stored_form(
    form: str, moto_bucket: tuple[str, str], tmp_path: Path
) -> None:
    endpoint, bucket = moto_bucket
    tenant, client_id = f"t-{form}-{uuid.uuid4().hex[:6]}", f"ticket-{uuid.uuid4().hex[:6]}"
    env = await captured(tenant, client_id)
    settings = CaptureSettings(
        upstream="http://127.0.0.1:9", spool_dir=tmp_path / "spool", s3_endpoint=endpoint, s3_access_key="k",
        s3_secret_key="s", s3_bucket=bucket, envelope_encoding="json" if form == "json" else "compact",
        encrypt_tenants=(tenant,) if form == "sealed" else (), kek=base64.b64encode(KEK).decode(), keys_bucket=bucket,
    )  # fmt: skip
    await publish_through_s3(settings, [env], tmp_path / "spool")
    key = envelope_key(env.envelope_id(), tenant, env.captured_at)
    stored = moto_client(endpoint).get_object(Bucket=bucket, Key=key)["Body"].read()
    assert {"compact": is_compact(stored), "json": stored == env.canonical(), "sealed": is_sealed(stored)}[form]

    runner, app = CliRunner(), build_app()
    for args in (
        [env.request_id, "--json"],
        ["--client-request-id", client_id, "--tenant", tenant, "--json"],
    ):
        result = runner.invoke(app, ["audit", "show", *args], env=cli_env(endpoint, bucket))
        assert result.exit_code == 0, f"show {' '.join(args)}: {result.stderr}{result.exception!r:.300}"
        assert result.stdout == env.canonical().decode() + "\n"  # the bytes whose sha256 is the envelope id
    result = runner.invoke(app, ["audit", "show", env.request_id], env=cli_env(endpoint, bucket))
    assert result.exit_code == 0, result.stderr
    assert f"Request {env.request_id} (envelope {env.envelope_id()})" in result.stdout
    assert f"client request id {client_id}" in result.stdout
    if form == "compact":
        assert f"({len(stored)} bytes; compact, decoded to its canonical JSON, whose sha256 is the envelope id)" in (
            result.stdout
        )
