"""The recorded envelope as a person reads it: `reprolane audit show REQUEST_ID`.

An auditor's first question is "what exactly was recorded?", before any replay. `render_record` answers from
a `replayer.store.StoredRecord`: the bytes S3 holds, already checked against their content address (the
envelope id is the sha256 of the canonical bytes; a sealed record's plaintext is checked when it is opened).
It shows who (tenant, client request id, sidecar), when, the workflow step, the flag and target level, the
sampling contract, the artifact and runtime fingerprints, the prompt (token ids, and text: recorded, or decoded
from the ids with the recorded tokenizer, `replayer.prompt_text`), the output (text,
token ids, finish reason, usage) or the error, the batch pressure it ran under. Nothing is summarised away:
``--json`` prints the canonical JSON the record holds, whichever form S3 keeps it in (JSON as it is, a compact
record decoded, a sealed one opened: `replayer.store.StoredRecord.canonical`), the bytes whose sha256 is the
envelope id; this text shows every field that has a value.

A sealed record (an encrypted tenant) that cannot be opened here (no KEK configured, or the tenant's key was
shredded) is shown by its routing metadata only, and says so.

Pure: takes the record, returns text. Token text is shown as a JSON string so whitespace is visible.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from replayer.prompt_text import DecodedPrompt
from replayer.store import StoredRecord
from schemas import CapturedError, CapturedOutput, Choice, Envelope, PromptRecord
from schemas.envelope_compact import is_compact


def _text(value: str | None) -> str:
    return json.dumps(value, ensure_ascii=False) if value is not None else "(not recorded)"


def _fields(model: BaseModel, *, skip: Sequence[str] = ()) -> list[str]:
    """``name value`` for every field that has a value, in declaration order, names aligned."""
    values: dict[str, Any] = {
        name: value
        for name, value in model.model_dump(mode="json").items()
        if name not in skip and value not in (None, (), [], {})
    }
    width = max((len(name) for name in values), default=0)
    return [f"  {name.ljust(width)}  {json.dumps(value, ensure_ascii=False)}" for name, value in values.items()]


def _ids(ids: Sequence[int]) -> str:
    return "[" + ", ".join(map(str, ids)) + "]"


def _prompt_lines(title: str, prompt: PromptRecord, decoded: str | None, reason: str | None) -> list[str]:
    if prompt.text is not None:
        text = _text(prompt.text)
    elif decoded is not None:
        text = f"{_text(decoded)}\n             (not recorded: decoded from the token ids with the recorded tokenizer)"
    else:
        text = f"(not recorded; not decoded: {reason})"
    return [
        f"{title} ({len(prompt.token_ids)} tokens, token ids from {prompt.source})",
        f"  text       {text}",
        f"  token ids  {_ids(prompt.token_ids)}",
    ]


def _choice_lines(choice: Choice, of: int) -> list[str]:
    steps = "with" if choice.logprobs else "without"
    return [
        f"Output choice {choice.index} of {of} ({len(choice.token_ids)} tokens, finish reason "
        f"{choice.finish_reason or 'none'}, {steps} per-step logprobs)",
        f"  text       {_text(choice.text)}",
        *(
            f"  tool call  {n}: {call.name}({call.arguments})" + (f"  id {call.id}" if call.id else "")
            for n, call in enumerate(choice.tool_calls or ())
        ),
        f"  token ids  {_ids(choice.token_ids)}",
    ]


def _outcome_lines(env: Envelope) -> list[str]:
    out = env.outcome
    t = out.timings
    timing = f"received {t.received_at.isoformat()}, upstream {t.upstream_ms:.1f} ms" + (
        f", first token {t.first_token_ms:.1f} ms" if t.first_token_ms is not None else ""
    )
    if isinstance(out, CapturedOutput):
        lines = [f"Outcome: output ({len(out.choices)} choice(s)); {timing}"]
        if out.usage:
            lines.append("  usage  " + ", ".join(f"{k} {v}" for k, v in sorted(out.usage.items())))
        for choice in out.choices:
            lines.extend(_choice_lines(choice, len(out.choices)))
        return lines
    assert isinstance(out, CapturedError)
    status = f" (HTTP {out.status_code})" if out.status_code is not None else ""
    lines = [f"Outcome: error {out.error_type}{status}: {out.message}; {timing}"]
    for choice in out.partial:
        lines.extend(_choice_lines(choice, len(out.partial)))
    return lines


def _envelope_lines(env: Envelope, decoded: DecodedPrompt) -> list[str]:
    ctx = env.context
    who = f"tenant {env.tenant}" + (f", client request id {env.client_request_id}" if env.client_request_id else "")
    who += f", through sidecar {ctx.sidecar_id}" if ctx.sidecar_id else ""
    flag = f"flagged for replay ({env.flag_reason})" if env.flagged else "not flagged for replay"
    lines = [
        f"  who        {who}",
        f"  when       {env.captured_at.isoformat()}",
        f"  workflow   {env.workflow.workflow_id} step {env.workflow.step}" if env.workflow else "  workflow   none",
        f"  endpoint   {env.endpoint}, model {env.model!r}" + (", streamed" if ctx.stream else ""),
        f"  target     level {env.target_level}; {flag}; replayable: {'yes' if env.replayable else 'no'}",
        f"  in flight  {ctx.in_flight_at_start} at start, {ctx.in_flight_at_end} at end",
    ]
    if env.request_body_sha256:
        lines.append(f"  body       sha256 {env.request_body_sha256}")
    if env.sampling is not None:
        lines += ["Sampling contract", *_fields(env.sampling)]
    else:
        lines.append("Sampling contract: none (the request was rejected before it had one)")
    lines += ["Artifact fingerprint", *(_fields(env.artifacts) or ["  (none recorded)"])]
    lines += [f"Runtime fingerprint (sha256 {env.runtime.sha256()})", *_fields(env.runtime)]
    texts: tuple[str | None, ...] = decoded.texts or (None,) * (1 + len(env.more_prompts or ()))
    if env.prompt is not None:
        lines += _prompt_lines("Prompt", env.prompt, texts[0], decoded.reason)
    else:
        lines.append("Prompt: none (the request never reached a tokenizer)")
    for n, (more, text) in enumerate(zip(env.more_prompts or (), texts[1:], strict=True), start=2):
        lines += _prompt_lines(f"Prompt {n}", more, text, decoded.reason)
    return lines + _outcome_lines(env)


def render_record(record: StoredRecord, bucket: str, decoded: DecodedPrompt | None = None) -> str:
    """The report of one stored envelope (see module docstring); `decoded`: its prompts' text, decoded from the
    token ids with the recorded tokenizer (`replayer.prompt_text`), shown where the envelope holds none."""
    where = f"s3://{bucket}/{record.key}"
    head = f"Request {record.request_id} (envelope {record.envelope_id})"
    if record.envelope is None:
        sealed = record.sealed
        assert sealed is not None
        lines = [
            f"{head} is sealed: tenant {sealed.tenant} is encrypted under data key {sealed.key_id}.",
            f"  It cannot be opened here: {record.unopened}",
            f"  stored     {where} ({len(record.data)} bytes, {sealed.algorithm})",
            f"  when       {sealed.captured_at.isoformat()}",
            f"  workflow   {sealed.workflow.workflow_id} step {sealed.workflow.step}"
            if sealed.workflow
            else "  workflow   none",
        ]
        return "\n".join(lines) + "\n"
    if record.sealed:
        how = "sealed, opened with its tenant's data key; the plaintext's"
    elif is_compact(record.data):
        how = "compact, decoded to its canonical JSON, whose"
    else:
        how = "its bytes'"
    lines = [
        head,
        f"  stored     {where} ({len(record.data)} bytes; {how} sha256 is the envelope id)",
        *_envelope_lines(record.envelope, decoded or DecodedPrompt(reason="no tokenizer was asked")),
    ]
    return "\n".join(lines) + "\n"
