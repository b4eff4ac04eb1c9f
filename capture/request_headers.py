"""What the sidecar reads from a captured request's headers: its request id, and the ``X-Reprolane-*`` headers.

Every value here ends up in the envelope, in S3 keys (``index/workflow/<id>/<step>-<request id>.json``) or in a
Kafka key, so each is parsed once, here, into a bounded value of a small character set; nothing unbounded
reaches the sinks (a 1000-digit step once made an S3 key over 1,024 bytes, which S3 refuses for good):

- ``X-Request-Id``: kept as the envelope's request id when it is a valid id (`schemas.envelope.is_valid_request_id`:
  ``[A-Za-z0-9][A-Za-z0-9._:-]{0,127}``) not seen recently (`RecentIds`), else one is made (``rl-`` and 128
  random bits), so two envelopes never share a request id by accident and an unusable one never travels on.
- ``X-Reprolane-Tenant``: the tenant (default: the settings' ``default_tenant``), a valid id.
- ``X-Reprolane-Workflow-Id`` and ``X-Reprolane-Step``: where the request sits in an agent workflow; the id a
  valid id, the step 1 to `MAX_STEP_DIGITS` ASCII digits (at most `MAX_STEP`). A step without a workflow id is
  still checked (and then ignored).
- ``X-Reprolane-Flag``: asks for replay (`capture.policy.ReplayPolicy` decides, with its other rules): up to
  `MAX_FLAG_CHARS` ASCII letters and digits (``true``, ``1``, ``yes``, ``false``...).

An invalid header is the client's error: `BadRequest` 400 in OpenAI's error format, its ``param`` naming the
header (the attempt is still recorded, without the bad value). None of these headers is forwarded upstream
(`capture.edge.forward_headers`).
"""

from __future__ import annotations

import os
import re
from typing import Final

from capture.assembly import RequestContext
from capture.edge import BadRequest, RecentIds
from capture.policy import ReplayPolicy
from schemas import WorkflowRef
from schemas.envelope import is_valid_request_id

MAX_STEP_DIGITS: Final = 9
MAX_STEP: Final = 10**MAX_STEP_DIGITS - 1
MAX_FLAG_CHARS: Final = 16
_STEP: Final = re.compile(rf"[0-9]{{1,{MAX_STEP_DIGITS}}}")
_FLAG: Final = re.compile(rf"[A-Za-z0-9]{{0,{MAX_FLAG_CHARS}}}")
_ID_RULE: Final = "must be 1-128 characters of [A-Za-z0-9._:-], starting with a letter or digit"


def _is_id(value: str) -> bool:
    """A valid id, whole: ``is_valid_request_id``'s ``$`` would also accept one trailing newline."""
    return is_valid_request_id(value) and not value.endswith("\n")


def request_id(supplied: bytes | None, recent: RecentIds) -> str:
    """The request id of a new request: the client's ``X-Request-Id`` when usable, else a fresh one."""
    if supplied is not None and len(supplied) <= 128:
        value = supplied.decode("latin-1")
        if _is_id(value) and value not in recent:
            recent.add(value)
            return value
    value = f"rl-{os.urandom(16).hex()}"  # 128 random bits, as a uuid4's hex, without building a UUID
    recent.add(value)
    return value


def _id_header(headers: dict[bytes, bytes], name: str) -> str | None:
    raw = headers.get(name.lower().encode())
    if raw is None:
        return None
    value = raw.decode("latin-1")
    if len(raw) > 128 or not _is_id(value):
        raise BadRequest(400, f"{name} {_ID_RULE}", name)
    return value


def _step_header(headers: dict[bytes, bytes]) -> int | None:
    raw = headers.get(b"x-reprolane-step")
    if raw is None:
        return None
    if len(raw) > MAX_STEP_DIGITS or not _STEP.fullmatch(raw.decode("latin-1")):
        raise BadRequest(400, f"X-Reprolane-Step must be an integer from 0 to {MAX_STEP}", "X-Reprolane-Step")
    return int(raw)


def _flag_header(headers: dict[bytes, bytes]) -> str | None:
    raw = headers.get(b"x-reprolane-flag")
    if raw is None:
        return None
    value = raw.decode("latin-1").strip()
    if len(value) > MAX_FLAG_CHARS or not _FLAG.fullmatch(value):
        raise BadRequest(
            400, f"X-Reprolane-Flag must be up to {MAX_FLAG_CHARS} letters or digits (true, 1, yes)", "X-Reprolane-Flag"
        )
    return value


def read_reprolane_headers(ctx: RequestContext, headers: dict[bytes, bytes], policy: ReplayPolicy) -> None:
    """Set the tenant, workflow and replay flag of `ctx` from the request's headers (`BadRequest` if invalid)."""
    tenant = _id_header(headers, "X-Reprolane-Tenant")
    workflow = _id_header(headers, "X-Reprolane-Workflow-Id")
    step = _step_header(headers)
    flag = _flag_header(headers)
    if tenant is not None:
        ctx.tenant = tenant
    if workflow is not None:
        ctx.workflow = WorkflowRef(workflow_id=workflow, step=step if step is not None else 0)
    ctx.flag = policy.decide(request_id=ctx.request_id, tenant=ctx.tenant, flag_header=flag)
