"""Test support for the replayer's store, service and CLI: a fake lane, envelope seeding, a moto S3 server, and
the S3 target of a test written once and run twice (`BACKENDS`, `s3_backend`).

The fake lane never loads a model: it answers each prompt with what the envelope recorded for it (so a replay is
bitwise), optionally changing one token (so a replay diverges there). Seeding writes an envelope and its index
objects exactly as the capture side lays them out (`schemas.layout`), without importing `capture`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import boto3
import pytest

from replayer.lanes.base import GenRequest
from replayer.lanes.remote import steps_from_completion
from replayer.settings import ReplayerSettings
from schemas import (
    ArtifactHashes,
    CapturedOutput,
    Choice,
    Envelope,
    ExecutionContext,
    PromptRecord,
    ReplayedOutput,
    ReplayRequest,
    ReproLevel,
    RuntimeFingerprint,
    SamplingContract,
    StepLogprobs,
    Timings,
    TopCandidate,
    WorkflowRef,
)
from schemas.layout import (
    capture_day,
    data_key_key,
    envelope_key,
    index_body,
    request_index_key,
    shadow_index_key,
    workflow_index_key,
)
from schemas.replay_auth import sign_replay_request
from schemas.sealed import new_data_key, seal_envelope, wrap_key
from tests import factories

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

LANE_FINGERPRINT = factories.runtime(max_num_seqs=1, prefix_caching=False, batch_invariant=True)


@dataclass
class FakeLane:
    """Echo the recorded output for a prompt; `perturb` maps a prompt's first id to a position to flip there."""

    recorded: dict[tuple[int, ...], ReplayedOutput] = field(default_factory=dict)
    perturb: dict[tuple[int, ...], int] = field(default_factory=dict)
    name: str = "fake"
    fp: RuntimeFingerprint = LANE_FINGERPRINT
    calls: list[tuple[int, ...]] = field(default_factory=list)
    closed: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def learn(self, envelope: Envelope, *, diverge_at: int | None = None) -> None:
        assert envelope.prompt is not None
        assert isinstance(envelope.outcome, CapturedOutput)
        choice = envelope.outcome.choices[0]
        prompt = tuple(envelope.prompt.token_ids)
        self.recorded[prompt] = ReplayedOutput(
            token_ids=choice.token_ids, text=choice.text, logprobs=choice.logprobs, finish_reason=choice.finish_reason
        )
        if diverge_at is not None:
            self.perturb[prompt] = diverge_at

    def fingerprint(self) -> RuntimeFingerprint:
        return self.fp

    def replay(self, request: GenRequest) -> ReplayedOutput:
        prompt = request.prompt_token_ids
        with self._lock:
            self.calls.append(prompt)
        out = self.recorded[prompt]
        at = self.perturb.get(prompt)
        if at is None:
            return out
        return flip(out, at)

    def close(self) -> None:
        self.closed = True


def flip(out: ReplayedOutput, at: int) -> ReplayedOutput:
    """The output up to `at`, where the recorded runner-up is chosen instead (top-1 and top-2 swap places)."""
    steps = list(out.logprobs or ())
    old = steps[at]
    first = old.top[0]
    second = old.top[1] if len(old.top) > 1 else TopCandidate(token="x", token_id=old.token_id + 1, logprob=-9.0)
    assert second.token_id is not None
    top = (
        TopCandidate(token=second.token, token_id=second.token_id, logprob=first.logprob, rank=1),
        TopCandidate(token=first.token, token_id=first.token_id, logprob=second.logprob, rank=2),
        *old.top[2:],
    )
    steps[at] = StepLogprobs(token_id=second.token_id, token=second.token, logprob=first.logprob, top=top)
    ids = (*out.token_ids[:at], second.token_id)
    return ReplayedOutput(
        token_ids=ids, text=out.text[:at] + second.token, logprobs=tuple(steps[: at + 1]), finish_reason="length"
    )


def make_envelope(
    n: int, *, prefix: str | None = None, flagged: bool = True, workflow: str | None = None, **overrides: Any
) -> Envelope:
    """A distinct greedy envelope (its prompt starts with `n`) with a unique request id."""
    prefix = prefix or uuid.uuid4().hex[:12]
    base: dict[str, Any] = {
        "request_id": f"req-{prefix}-{n}",
        "flagged": flagged,
        "flag_reason": "header" if flagged else None,
        "workflow": WorkflowRef(workflow_id=workflow, step=n) if workflow else None,
        "prompt": PromptRecord(token_ids=(1000 + n, 9690, 198, 2683, 314), source="upstream"),
        "sampling": SamplingContract(temperature=0.0, max_tokens=16, seed_scope="none", logprobs=5),
    }
    base.update(overrides)
    return factories.envelope(**base)


def seed_envelope(client: S3Client, bucket: str, envelope: Envelope) -> str:
    """Write the envelope and its index objects as the capture side does; returns the envelope's key."""
    envelope_id = envelope.envelope_id()
    key = envelope_key(envelope_id, envelope.tenant, envelope.captured_at)
    client.put_object(Bucket=bucket, Key=key, Body=envelope.canonical(), ContentType="application/json")
    index = index_body(envelope_id, key, envelope.tenant, envelope.captured_at)
    client.put_object(Bucket=bucket, Key=request_index_key(envelope.request_id), Body=index)
    if envelope.workflow is not None:
        wf_key = workflow_index_key(envelope.workflow.workflow_id, envelope.workflow.step, envelope.request_id)
        client.put_object(Bucket=bucket, Key=wf_key, Body=index)
    return key


def seed_shadow(client: S3Client, bucket: str, shadow: Envelope) -> None:
    """Write a shadow envelope and its own index object (`schemas.layout.shadow_index_key`) as the capture side
    does."""
    key = envelope_key(shadow.envelope_id(), shadow.tenant, shadow.captured_at)
    client.put_object(Bucket=bucket, Key=key, Body=shadow.canonical())
    index = index_body(shadow.envelope_id(), key, shadow.tenant, shadow.captured_at)
    client.put_object(Bucket=bucket, Key=shadow_index_key(capture_day(shadow.captured_at), shadow.request_id),
                      Body=index)  # fmt: skip


@dataclass(frozen=True)
class S3Target:
    endpoint: str
    access_key: str
    secret_key: str
    bucket: str
    region: str = "us-east-1"

    @classmethod
    def from_stack(cls, info: Any) -> S3Target:
        """The audit bucket of the session's stack (`infra.stack.state.StackInfo`)."""
        return cls(info.s3_endpoint, info.s3_access_key, info.s3_secret_key, info.audit_bucket, info.s3_region)

    def client(self) -> S3Client:
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
        )

    def settings(self, **overrides: Any) -> ReplayerSettings:
        base: dict[str, Any] = {
            "s3_endpoint": self.endpoint,
            "s3_access_key": self.access_key,
            "s3_secret_key": self.secret_key,
            "s3_bucket": self.bucket,
            "s3_region": self.region,
            "metrics_port": None,
        }
        base.update(overrides)
        return ReplayerSettings(**base)


@contextmanager
def moto_s3() -> Iterator[S3Target]:
    """A moto S3 server on 127.0.0.1 with one fresh bucket."""
    from tests.moto_s3 import moto_server

    with moto_server() as endpoint:
        target = S3Target(endpoint, "testing", "testing", f"audit-{uuid.uuid4().hex[:8]}")
        target.client().create_bucket(Bucket=target.bucket)
        yield target


#: What an S3 test written once runs on: moto (fast) and, marked ``stack``, the stack's SeaweedFS.
BACKENDS: Final = ["moto", pytest.param("stack", marks=pytest.mark.stack)]


def s3_backend(request: pytest.FixtureRequest) -> Iterator[S3Target]:
    """The body of a module's ``s3`` fixture parametrized by `BACKENDS`: a fresh moto bucket, or the stack's audit
    bucket (through the session's ``stack`` fixture)."""
    if request.param == "moto":
        with moto_s3() as target:
            yield target
        return
    yield S3Target.from_stack(request.getfixturevalue("stack"))


ARITH_LENGTH = 6


@dataclass
class ArithmeticLane:
    """A tiny deterministic lane: the output is a pure function of the prompt (works across processes)."""

    name: str = "arith"
    fp: RuntimeFingerprint = LANE_FINGERPRINT
    calls: list[tuple[int, ...]] = field(default_factory=list)

    def fingerprint(self) -> RuntimeFingerprint:
        return self.fp

    def replay(self, request: GenRequest) -> ReplayedOutput:
        self.calls.append(request.prompt_token_ids)
        return arithmetic_output(request.prompt_token_ids, min(request.max_tokens, ARITH_LENGTH))

    def close(self) -> None:
        pass


def arithmetic_output(prompt: Sequence[int], length: int = ARITH_LENGTH) -> ReplayedOutput:
    base = sum(prompt) * 7
    ids = [(base + 13 * i) % 40_000 + 10 for i in range(length)]
    steps = tuple(
        StepLogprobs(
            token_id=t,
            token=f"<{t}>",
            logprob=-0.1,
            top=(
                TopCandidate(token=f"<{t}>", token_id=t, logprob=-0.1, rank=1),
                TopCandidate(token=f"<{t + 1}>", token_id=t + 1, logprob=-2.5, rank=2),
            ),
        )
        for t in ids
    )
    return ReplayedOutput(
        token_ids=tuple(ids), text="".join(f"<{t}>" for t in ids), logprobs=steps, finish_reason="stop"
    )


def arithmetic_envelope(n: int, prefix: str, *, flagged: bool = True, diverge_at: int | None = None) -> Envelope:
    """An envelope whose recording is what `ArithmeticLane` replays (bitwise), or differs at `diverge_at`."""
    prompt = (1000 + n, 5, 6, 7)
    out = arithmetic_output(prompt)
    if diverge_at is not None:
        out = flip(out, diverge_at)
    choice = Choice(
        index=0, token_ids=out.token_ids, text=out.text, finish_reason=out.finish_reason, logprobs=out.logprobs
    )
    return make_envelope(
        n,
        prefix=prefix,
        flagged=flagged,
        prompt=PromptRecord(token_ids=prompt, source="upstream"),
        outcome=CapturedOutput(choices=(choice,), timings=Timings(received_at=factories.FIXED_TIME, upstream_ms=1.0)),
    )


def envelope_from_completion(
    *,
    request_id: str,
    prompt_ids: Sequence[int],
    body: dict[str, Any],
    answer: dict[str, Any],
    received_at: datetime,
    engine_version: str,
    target_level: ReproLevel,
    in_flight: int,
    top_k: int,
) -> Envelope:
    """The envelope of one greedy ``/v1/completions`` call made straight to the stack's vLLM server (token ids in,
    ``return_token_ids`` and ``return_tokens_as_token_ids`` on), as the capture sidecar would have recorded it."""
    choice = answer["choices"][0]
    token_ids = tuple(choice["token_ids"])
    return Envelope(
        request_id=request_id,
        captured_at=received_at,
        target_level=target_level,
        endpoint="completions",
        model=body["model"],
        artifacts=ArtifactHashes(),
        request_body_sha256=hashlib.sha256(json.dumps(body).encode()).hexdigest(),
        prompt=PromptRecord(token_ids=tuple(prompt_ids), source="upstream"),
        sampling=SamplingContract(temperature=0.0, max_tokens=body["max_tokens"], seed_scope="none", logprobs=top_k),
        runtime=RuntimeFingerprint(
            engine="vllm",
            engine_version=engine_version,
            system_fingerprint=answer.get("system_fingerprint"),
            device="cpu",
            dtype="bfloat16",
            cuda_graphs=False,
            prefix_caching=True,
        ),
        context=ExecutionContext(in_flight_at_start=in_flight, in_flight_at_end=in_flight),
        outcome=CapturedOutput(
            choices=(
                Choice(
                    index=0,
                    token_ids=token_ids,
                    text=choice["text"],
                    finish_reason=choice["finish_reason"],
                    logprobs=steps_from_completion(choice, token_ids, top_k),
                ),
            ),
            timings=Timings(received_at=received_at, upstream_ms=1.0),
        ),
    )


def record_from_stack(
    stack: Any, request_id: str, messages: list[dict[str, str]], *, max_tokens: int, top_k: int = 5,
    target_level: ReproLevel = "bitwise",
) -> Envelope:  # fmt: skip
    """One lone greedy ``/v1/completions`` request to the stack's vLLM server (`infra.stack.state.StackInfo`), the
    chat prompt tokenised by the server, as an envelope (`envelope_from_completion`)."""
    import httpx

    assert stack.vllm_url is not None
    with httpx.Client(base_url=stack.vllm_url, timeout=120) as client:
        ids = client.post(
            "/tokenize", json={"model": stack.model_name, "messages": messages, "add_generation_prompt": True}
        ).json()["tokens"]
        body = {
            "model": stack.model_name,
            "prompt": ids,
            "temperature": 0.0,
            "max_tokens": max_tokens,
            "logprobs": top_k,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        received = datetime.now(UTC)
        resp = client.post("/v1/completions", json=body)
        resp.raise_for_status()
        data: dict[str, Any] = resp.json()
        version = client.get("/version").json()["version"]
    assert len(data["choices"][0]["token_ids"]) == max_tokens, "the prompt must not stop early: pick another one"
    return envelope_from_completion(
        request_id=request_id, prompt_ids=ids, body=body, answer=data, received_at=received,
        engine_version=version, target_level=target_level, in_flight=0, top_k=top_k,
    )  # fmt: skip


def seed_sealed(s3: S3Target, env: Envelope, kek: bytes) -> bytes:
    """`env` sealed under a fresh data key of its tenant (wrapped by `kek`), the wrapped key and the request-id
    index, as the capture side writes them; returns the sealed bytes."""
    client = s3.client()
    key_id = uuid.uuid4().hex[:12]
    data_key = new_data_key()
    wrapped = wrap_key(data_key, kek, tenant=env.tenant, key_id=key_id, created_at=datetime.now(UTC))
    client.put_object(Bucket=s3.bucket, Key=data_key_key(env.tenant, key_id), Body=wrapped.model_dump_json().encode())
    sealed = seal_envelope(
        env.canonical(), request_id=env.request_id, tenant=env.tenant, captured_at=env.captured_at,
        workflow=env.workflow, key_id=key_id, data_key=data_key,
    ).canonical()  # fmt: skip
    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    client.put_object(Bucket=s3.bucket, Key=key, Body=sealed)
    body = index_body(env.envelope_id(), key, env.tenant, env.captured_at)
    client.put_object(Bucket=s3.bucket, Key=request_index_key(env.request_id), Body=body)
    return sealed


REPLAY_KEY_ID = "test-replay"
REPLAY_SECRET = bytes(range(32))


def write_replay_request_keys(path: Path, keys: dict[str, dict[str, Any]] | None = None) -> Path:
    """A 0600 replay-request keys file (`replayer.request_keys`); by default the one key `REPLAY_KEY_ID`."""
    doc = keys if keys is not None else {REPLAY_KEY_ID: {"secret": REPLAY_SECRET.hex(), "roles": ["replay"]}}
    path.touch(mode=0o600, exist_ok=True)
    path.chmod(0o600)
    path.write_text(json.dumps(doc), encoding="utf-8")
    return path


def signed(request: ReplayRequest) -> ReplayRequest:
    """`request` signed now by `REPLAY_KEY_ID` (what an authorised caller sends)."""
    return sign_replay_request(request, REPLAY_KEY_ID, REPLAY_SECRET)
