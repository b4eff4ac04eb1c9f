"""What the sidecar reads from a captured request's headers, once its caller is known (`capture.request.auth`).

Every value here ends up in the envelope, in S3 keys (``index/workflow/<id>/<step>-<request id>.json``) or in a
Kafka key, so each is parsed once, here, into a bounded value of a small character set; nothing unbounded
reaches the sinks (a 1000-digit step once made an S3 key over 1,024 bytes, which S3 refuses for good):

- The request id is always the sidecar's own (``rl-`` and 128 random bits: unguessable, never reused).
  ``X-Request-Id`` is the client's, a valid id (`schemas.envelope.is_valid_request_id`:
  ``[A-Za-z0-9][A-Za-z0-9._:-]{0,127}``): recorded as the envelope's ``client_request_id`` and indexed per
  tenant (``schemas.layout.client_request_index_key``), never used as the request id.
- ``X-Reprolane-Tenant``: a valid id; the tenant when the caller's headers are trusted (``auth_mode`` off or
  trusted-proxy; default: the settings' ``default_tenant``); with a key the tenant is the key's, and a
  different value is 403.
- ``X-Reprolane-Workflow-Id`` and ``X-Reprolane-Step``: where the request sits in an agent workflow; the id a
  valid id, the step 1 to `MAX_STEP_DIGITS` ASCII digits (at most `MAX_STEP`). A step without a workflow id is
  still checked (and then ignored).
- ``X-Reprolane-Flag``: asks for replay (`capture.request.policy.ReplayPolicy` decides, with its other rules): up to
  `MAX_FLAG_CHARS` ASCII letters and digits (``true``, ``1``, ``yes``, ``false``...); from a caller without the
  ``flag`` role, a flag that asks is 403.

An invalid header is the client's error: `BadRequest` 400 in OpenAI's error format (403 for what the caller may
not set), its ``param`` naming the header (the attempt is still recorded, without the bad value). None of these
headers is forwarded upstream (`capture.request.edge.forward_headers`): upstream gets the sidecar's request id as
``X-Request-Id`` instead (the join to the engine's schedule, `schemas.schedule_delivery`).
"""

from __future__ import annotations

import os
import re
from typing import Final

from capture.request.assembly import RequestContext
from capture.request.auth import Caller
from capture.request.edge import BadRequest
from capture.request.policy import ReplayPolicy, header_asks_flag
from schemas import WorkflowRef
from schemas.envelope import SIDECAR_REQUEST_ID_PREFIX, is_valid_request_id

MAX_STEP_DIGITS: Final = 9
MAX_STEP: Final = 10**MAX_STEP_DIGITS - 1
MAX_FLAG_CHARS: Final = 16
_STEP: Final = re.compile(rf"[0-9]{{1,{MAX_STEP_DIGITS}}}")
_FLAG: Final = re.compile(rf"[A-Za-z0-9]{{0,{MAX_FLAG_CHARS}}}")
_ID_RULE: Final = "must be 1-128 characters of [A-Za-z0-9._:-], starting with a letter or digit"


def new_request_id() -> str:
    """A fresh request id: ``rl-`` and 128 random bits, as a uuid4's hex, without building a UUID."""
    return f"{SIDECAR_REQUEST_ID_PREFIX}{os.urandom(16).hex()}"


def _is_id(value: str) -> bool:
    """A valid id, whole: ``is_valid_request_id``'s ``$`` would also accept one trailing newline."""
    return is_valid_request_id(value) and not value.endswith("\n")


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


def read_reprolane_headers(
    ctx: RequestContext, headers: dict[bytes, bytes], policy: ReplayPolicy, caller: Caller
) -> None:
    """Set the client request id, tenant, workflow and replay flag of `ctx` from `caller` and the request's
    headers (`BadRequest` if invalid or not the caller's to set)."""
    if caller.tenant is not None:
        ctx.tenant = caller.tenant  # first: a refused attempt is recorded under the caller's tenant too
    if "capture" not in caller.roles:
        raise BadRequest(403, "this API key has no 'capture' role")
    client_id = _id_header(headers, "X-Request-Id")
    tenant = _id_header(headers, "X-Reprolane-Tenant")
    workflow = _id_header(headers, "X-Reprolane-Workflow-Id")
    step = _step_header(headers)
    flag = _flag_header(headers)
    if client_id is not None:
        ctx.client_request_id = client_id
    if tenant is not None:
        if caller.tenant is None:
            ctx.tenant = tenant
        elif tenant != caller.tenant:
            raise BadRequest(403, "X-Reprolane-Tenant is not this API key's tenant", "X-Reprolane-Tenant")
    if workflow is not None:
        ctx.workflow = WorkflowRef(workflow_id=workflow, step=step if step is not None else 0)
    if flag is not None and not caller.may_flag and header_asks_flag(flag):
        raise BadRequest(403, "X-Reprolane-Flag needs an API key with the 'flag' role", "X-Reprolane-Flag")
    ctx.flag = policy.decide(request_id=ctx.request_id, tenant=ctx.tenant, flag_header=flag)
