"""``reprolane release gate record-golden``: make a golden set by running a workload once (on a lane, or against
a vendor).

- `record_lane`: each workload prompt runs once on the lane, greedy, top-5 logprobs, and becomes an envelope
  (`replayer.gate.golden.record_envelope`) whose runtime is the lane's fingerprint and whose artifacts are the model
  folder's (verified against its manifest by `infra.release.fingerprint.artifacts_of`).
- `record_vendor`: each workload request is sent once to an OpenAI-compatible upstream without a seed; the answer
  and its version identifiers become a `replayer.gate.statistical.VendorCase`.

A workload line is ``{"request_id"?, "prompt_token_ids": [...]}`` or ``{"messages": [...]}`` / ``{"prompt": "..."}``
(text is rendered by a vLLM server's ``/tokenize`` for the lane path), with optional ``max_tokens``,
``target_level`` and, for vendors, any request field (``model``, ``temperature``, ...).

It lives in ``infra`` beside `infra.release.gate_cli`, not in ``replayer``, because a recorded envelope's artifacts
are the model folder's hashes verified against the model cache's manifest (`infra.release.fingerprint`,
`infra.model.manifest`).
"""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import httpx
import typer

from infra.errors import InfraError
from infra.release.fingerprint import artifacts_of
from replayer.cli_options import LaneFactory
from replayer.errors import GateInputError
from replayer.gate.golden import record_envelope, write_golden
from replayer.gate.statistical import VERSION_HEADERS, Sampler, VendorCase
from replayer.lanes.base import GenRequest, resolve_model_dir
from replayer.settings import ReplayerSettings
from schemas import ArtifactHashes, ReproLevel, SamplingContract


def lane_artifacts(settings: ReplayerSettings) -> tuple[str | None, ArtifactHashes]:
    """Artifacts of the lane's model folder (local lanes always; the remote lane only with --model-dir).

    A folder that does not verify against its manifest is a `GateInputError`: the gate has no verdict then."""
    if settings.lane == "remote" and settings.model_dir is None:
        return settings.served_model_name, ArtifactHashes()
    try:
        name, artifacts = artifacts_of(settings.model_dir or resolve_model_dir(settings))
    except InfraError as exc:
        raise GateInputError(str(exc)) from exc
    return name or settings.served_model_name, artifacts


def read_workload(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise GateInputError(f"cannot read workload {path}: {exc.strerror}") from exc
    items: list[dict[str, Any]] = []
    for no, line in enumerate(lines, start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise GateInputError(f"workload {path} line {no}: not JSON ({exc})") from exc
        if not isinstance(item, dict) or not ({"prompt_token_ids", "messages", "prompt"} & item.keys()):
            raise GateInputError(f"workload {path} line {no}: needs prompt_token_ids, messages or prompt")
        items.append(item)
    if not items:
        raise GateInputError(f"workload {path}: empty")
    return items


def _token_ids(item: dict[str, Any], tokenize_url: str | None, model: str) -> tuple[list[int], str | None]:
    if "prompt_token_ids" in item:
        return [int(t) for t in item["prompt_token_ids"]], None
    if tokenize_url is None:
        raise GateInputError("workload lines with text need --tokenize-url (a vLLM server's /tokenize)")
    body: dict[str, Any] = {"model": model}
    if "messages" in item:
        body.update(messages=item["messages"], add_generation_prompt=True)
    else:
        body["prompt"] = item["prompt"]
    try:
        resp = httpx.post(tokenize_url.rstrip("/").removesuffix("/v1") + "/tokenize", json=body, timeout=60)
        resp.raise_for_status()
        return [int(t) for t in resp.json()["tokens"]], item.get("prompt")
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        raise GateInputError(f"tokenize via {tokenize_url} failed: {exc}") from exc


def record_lane(
    out: Path,
    items: list[dict[str, Any]],
    settings: ReplayerSettings,
    lane_factory: LaneFactory,
    tokenize_url: str | None,
    max_tokens: int,
    level: ReproLevel,
) -> None:
    lane = lane_factory(settings)
    try:
        _, artifacts = lane_artifacts(settings)
        runtime = lane.fingerprint()
        envelopes = []
        for n, item in enumerate(items):
            ids, text = _token_ids(item, tokenize_url, settings.served_model_name)
            k = int(item.get("max_tokens", max_tokens))
            sampling = SamplingContract(temperature=0.0, max_tokens=k, seed_scope="none", logprobs=5)
            output = lane.replay(GenRequest(tuple(ids), sampling, max_tokens=k, top_k_logprobs=5))
            envelopes.append(
                record_envelope(
                    request_id=str(item.get("request_id") or f"golden-{uuid.uuid4().hex[:8]}-{n}"),
                    prompt_token_ids=ids,
                    prompt_text=text,
                    sampling=sampling,
                    output=output,
                    runtime=runtime,
                    artifacts=artifacts,
                    model=settings.served_model_name,
                    target_level=cast(ReproLevel, item.get("target_level", level)),
                )
            )
    finally:
        lane.close()
    write_golden(out, envelopes)
    typer.echo(f"wrote {len(envelopes)} envelope(s) recorded on lane {lane.name} ({runtime.sha256()[:16]}) to {out}")


def record_vendor(out: Path, items: list[dict[str, Any]], sampler: Sampler, max_tokens: int) -> None:
    cases = []
    try:
        for n, item in enumerate(items):
            endpoint = "chat.completions" if "messages" in item else "completions"
            body = {k: v for k, v in item.items() if k not in ("request_id", "target_level", "prompt_token_ids")}
            body.setdefault("max_tokens", max_tokens)
            rid = str(item.get("request_id") or f"vendor-{uuid.uuid4().hex[:8]}-{n}")
            draft = VendorCase(
                request_id=rid, endpoint=endpoint, body=body, recorded_text="", model_alias=str(body.get("model", ""))
            )
            got = sampler.sample(draft)
            cases.append(
                draft.model_copy(
                    update={"recorded_text": got.text, "recorded_at": datetime.now(UTC), "versions": got.versions}
                )
            )
    finally:
        close = getattr(sampler, "close", None)
        if callable(close):
            close()
    try:
        out.write_text("".join(c.model_dump_json() + "\n" for c in cases), encoding="utf-8")
    except OSError as exc:
        raise GateInputError(f"cannot write {out}: {exc.strerror}") from exc
    typer.echo(f"wrote {len(cases)} vendor case(s) to {out} (version headers looked for: {', '.join(VERSION_HEADERS)})")
