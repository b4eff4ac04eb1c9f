"""Issue 33 on the real stack: requests' evidence, exported re-executable and re-executed offline.

Seven requests through the real sidecar to the stack's recording vLLM: three at once (they share steps), two
staggered (each arriving while others run), and a two-step workflow; their envelopes published by the real
publisher with the Merkle log, their schedule shipped by the real shipper into the engine's schedule log, the day's
log and the schedule log signed by ``reprolane audit checkpoint``; then, as the people involved run them, in child
processes:

- the operator: ``reprolane audit evidence export ID --reexecutable`` for two batched requests and a staggered one
  (every request id in their windows blinded, the target's too: it is named in clear apart), ``export WORKFLOW
  --workflow --reexecutable`` for the workflow (one bundle per step, in a folder), and ``reprolane audit verify
  --schedule ENGINE``, which holds every shipped segment to its signed leaf;
- the regulator: ``reprolane audit evidence reexecute BUNDLE... --model-dir DIR --key-fingerprint F --json`` in a
  process whose environment names no S3, no Kafka and no stack (anything that reached for S3 would fail), which
  verifies every bundle, checks the model files, replays each request inside its recorded batch with fillers on one
  engine, and reproduces all five bit for bit, its verdicts read from the one JSON document on its stdout (the text
  report, made from the same results, is test_run.py's);
- the regulator's receipt: the same run signs one with a key of its own (``--receipt``), and ``reprolane audit
  evidence receipt`` holds every bundle to it;
- tampering: one token id of the recorded output, one logprob, one schedule record (a step's shapes), the
  runtime fingerprint (the engine record), the model manifest: each is caught and named by the signed manifest
  before anything runs; a model directory with one changed file is refused, naming the file (with ``--json``: no
  document on stdout).

The sending, publishing, shipping, signing and export are `tests.infra.reexecution.support`'s.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import uuid
import zipfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture.audit.evidence.bundle import write_zip
from infra.stack.state import StackInfo
from schemas import CapturedOutput, Envelope, decode_envelope
from schemas.envelope_compact import encode_compact
from schemas.note import VerifierKey
from tests.capture.audit.support import new_key
from tests.infra.reexecution.support import (
    Send,
    ask,
    checkpoint,
    evidence_bucket,
    export_reexecutable,
    offline_env,
    operator_env,
    record_and_ship,
    reprolane,
)
from tests.replayer.schedule.test_lane_model import model_dir

pytestmark = [pytest.mark.stack, pytest.mark.model]

PROMPTS = ["Name three rivers in Europe.", "What is a prime number?", "Describe the colour of the sea."]
STAGGERED = ["Why do cats purr?", "Give two facts about the moon."]
WORKFLOW = ["Suggest a name for a bakery.", "Now write a one-line slogan for it."]


def _records(bundle: bytes) -> list[dict[str, Any]]:
    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        return [json.loads(line) for line in zf.read("schedule.jsonl").splitlines()]


def rezip(bundle: bytes, name: str, change: Any) -> bytes:
    with zipfile.ZipFile(io.BytesIO(bundle)) as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    members[name] = change(members[name])
    return write_zip(members, datetime.now(UTC))


def _send_all(workflow: str) -> Send:
    """Through the sidecar, together: three at once, two staggered, a two-step workflow (step 2 after step 1's
    answer); their request ids by group."""

    async def send(client: httpx.AsyncClient) -> list[list[str]]:
        async def one(delay_s: float, prompt: str, headers: dict[str, str] | None = None) -> str:
            await asyncio.sleep(delay_s)
            return await ask(client, prompt, headers)

        async def steps() -> list[str]:
            return [
                await one(0.2 if step == 1 else 0.0, prompt, {"X-Reprolane-Workflow-Id": workflow,
                                                              "X-Reprolane-Step": str(step)})
                for step, prompt in enumerate(WORKFLOW, start=1)
            ]  # fmt: skip

        batched = asyncio.gather(*(one(0.0, p) for p in PROMPTS))
        staggered = asyncio.gather(*(one(0.5 + 0.4 * i, p) for i, p in enumerate(STAGGERED)))
        return list(await asyncio.gather(batched, staggered, steps()))

    return send


def _changed_model(tmp_path: Path) -> Path:
    """The model directory with one file changed (the rest links to the real files)."""
    source, copy = model_dir(), tmp_path / "changed-model"
    copy.mkdir()
    for path in source.iterdir():
        if path.name == "generation_config.json":
            doc = json.loads(path.read_text())
            doc["reprolane_test"] = 1
            (copy / path.name).write_text(json.dumps(doc))
        else:
            (copy / path.name).symlink_to(path)
    return copy


def test_batched_staggered_and_workflow_requests_reexecute_offline_bit_for_bit_and_every_tamper_is_named(
    stack: StackInfo, tmp_path: Path
) -> None:
    bucket = evidence_bucket(stack)
    workflow = f"wf-{uuid.uuid4().hex[:12]}"
    batched, staggered, steps = asyncio.run(record_and_ship(stack, tmp_path, _send_all(workflow), bucket))
    private, _public = new_key()
    env = operator_env(stack, private, bucket)
    checkpoint(batched[0].captured_at, env)
    offline = offline_env(tmp_path)

    bundles = []
    for target in (batched[0], batched[2], staggered[1]):
        path = tmp_path / f"{target.request_id}.zip"
        fingerprint = export_reexecutable(target.request_id, path, env)
        with zipfile.ZipFile(path) as zf:
            schedule = zf.read("schedule.jsonl")
            engine_id = json.loads(zf.read("schedule-proof.json"))["engine_id"]
        records = [json.loads(line) for line in schedule.splitlines()]
        assert max(len(r.get("scheduled", ())) for r in records) > 1, "not batched"
        others = [e.request_id.removeprefix("rl-") for e in (*batched, *staggered, *steps) if e is not target]
        assert not any(other.encode() in schedule for other in others)  # shapes only: no other request's id
        assert target.request_id.encode() not in schedule  # blinded as the log committed it, named in clear apart
        bundles.append((target, path.read_bytes(), fingerprint))
    arrivals = {r["step"] for r in _records(bundles[2][1]) if r["kind"] == "arrival"}
    assert len(arrivals) > 1, "the staggered request's window holds one arrival step"
    folder = tmp_path / "workflow"
    done = reprolane(
        "audit", "evidence", "export", workflow, "--workflow", "--reexecutable", "-o", str(folder), env=env
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(p.name for p in folder.iterdir()) == [f"step-{i:06d}-{e.request_id}.zip" for i, e in
                                                        enumerate(steps, start=1)]  # fmt: skip

    checked = reprolane("audit", "verify", "--schedule", engine_id, env=env)  # every segment against its leaf
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.startswith(f"verified schedules/engine={engine_id}"), checked.stdout

    regulator, regulator_public = new_key()  # the regulator's own key signs a receipt of what it re-executed
    receipt = tmp_path / "receipt.note"
    signing = ["--receipt", str(receipt), "--receipt-key", base64.b64encode(regulator).decode(),
               "--receipt-name", "regulator.example/lab"]  # fmt: skip
    ran = reprolane(
        "audit", "evidence", "reexecute", *(str(tmp_path / f"{t.request_id}.zip") for t, _, _ in bundles), str(folder),
        "--model-dir", str(model_dir()), "--key-fingerprint", fingerprint, "--json", *signing, env=offline,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout + ran.stderr[-3000:]
    vkey = VerifierKey("regulator.example/lab", regulator_public).encode()
    every = [*(str(tmp_path / f"{t.request_id}.zip") for t, _, _ in bundles), *map(str, sorted(folder.iterdir()))]
    held = reprolane("audit", "evidence", "receipt", str(receipt), *every, "--key", vkey, env=offline)
    assert held.returncode == 0, held.stdout + held.stderr
    assert held.stdout.count(": reproduced, ") == 5
    document = json.loads(ran.stdout)  # the whole of stdout: the engine's logs are on stderr
    assert "vllm" in ran.stderr.lower(), "the engine's own logging should be there, on stderr"
    targets = [*(t for t, _, _ in bundles), *steps]
    assert [r["request_id"] for r in document["requests"]] == [t.request_id for t in targets]
    for request in document["requests"]:
        event = request["result"]["event"]
        assert request["reproduced"], request["request_id"]  # bit for bit, in its recorded schedule
        assert (event["verdict"], event["schedule_reproduced"], event["lane"]) == ("bitwise", True, "schedule")
    assert document["engines"] == 1  # one recorded engine: one here
    assert {r["engine"] for r in document["requests"]} == {0}

    target, bundle, fingerprint = bundles[0]
    cases: dict[str, bytes] = {
        "envelope bytes": rezip(bundle, "envelope.bin", _first_token_changed),
        "schedule records": rezip(bundle, "schedule.jsonl", _step_shape_changed),
        "model manifest": rezip(bundle, "model-manifest.json", lambda b: b.replace(b'"files"', b'"files" ', 1)),
    }
    cases["schedule records (runtime)"] = rezip(bundle, "schedule.jsonl", _runtime_changed)
    cases["envelope bytes (logprob)"] = rezip(bundle, "envelope.bin", _logprob_changed)
    for label, tampered in cases.items():
        path = tmp_path / f"tampered-{re.sub(r'[^a-z]+', '-', label)}.zip"
        path.write_bytes(tampered)
        failed = reprolane(
            "audit", "evidence", "reexecute", str(path), "--model-dir", str(model_dir()),
            "--key-fingerprint", fingerprint, env=offline, timeout=120,
        )  # fmt: skip
        assert failed.returncode == 1, (label, failed.stdout, failed.stderr[-2000:])
        part = label.split(" (")[0]
        assert f"reprolane: error: the bundle does not verify: {part}: " in failed.stderr, (label, failed.stderr)

    refused = reprolane(
        "audit", "evidence", "reexecute", str(tmp_path / f"{target.request_id}.zip"),
        "--model-dir", str(_changed_model(tmp_path)), "--key-fingerprint", fingerprint, "--json", env=offline,
        timeout=120,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr[-2000:]
    assert refused.stdout == ""  # no verdict, no document: the reason is on stderr
    assert "generation_config.json: sha256" in refused.stderr


def _stored(envelope: Envelope) -> bytes:
    """An envelope as the sidecar stores it (compact when the encoding takes it)."""
    canonical = envelope.canonical()
    return encode_compact(canonical) or canonical


def _output_changed(body: bytes, change: Any) -> bytes:
    """The stored envelope with its recorded output changed by `change` (a `CapturedOutput`'s first choice)."""
    envelope = decode_envelope(body)
    assert isinstance(envelope.outcome, CapturedOutput)
    choice = change(envelope.outcome.choices[0])
    outcome = envelope.outcome.model_copy(update={"choices": (choice, *envelope.outcome.choices[1:])})
    return _stored(envelope.model_copy(update={"outcome": outcome}))


def _first_token_changed(body: bytes) -> bytes:
    return _output_changed(body, lambda c: c.model_copy(update={"token_ids": (c.token_ids[0] + 1, *c.token_ids[1:])}))


def _logprob_changed(body: bytes) -> bytes:
    def change(choice: Any) -> Any:
        first = choice.logprobs[0]
        return choice.model_copy(
            update={"logprobs": (first.model_copy(update={"logprob": first.logprob - 1e-3}), *choice.logprobs[1:])}
        )

    return _output_changed(body, change)


def _step_shape_changed(schedule: bytes) -> bytes:
    lines = schedule.split(b"\n")
    for i, line in enumerate(lines):
        if b'"kind":"step"' in line and b'"num_scheduled_tokens":1' in line:
            lines[i] = line.replace(b'"num_scheduled_tokens":1', b'"num_scheduled_tokens":2', 1)
            return b"\n".join(lines)
    raise AssertionError("no decode step")


def _runtime_changed(schedule: bytes) -> bytes:
    first, rest = schedule.split(b"\n", 1)
    doc = json.loads(first)
    doc["runtime"]["torch_version"] = "0.0.0"
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode() + b"\n" + rest
