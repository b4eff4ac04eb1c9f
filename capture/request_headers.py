"""What the sidecar reads from a captured request's headers, once its caller is known (`capture.auth`).

- The request id is always the sidecar's own (``rl-`` and 128 random bits: unguessable, never reused).
  ``X-Request-Id`` is the client's: recorded as the envelope's ``client_request_id`` and indexed per tenant
  (``schemas.layout.client_request_index_key``), never used as the request id.
- ``X-Reprolane-Tenant``: the tenant when the caller's headers are trusted (``auth_mode`` off or trusted-proxy;
  default: the settings' ``default_tenant``); with a key the tenant is the key's, and a different value is 403.
- ``X-Reprolane-Workflow-Id`` and ``X-Reprolane-Step``: where the request sits in an agent workflow.
- ``X-Reprolane-Flag``: asks for replay (`capture.policy.ReplayPolicy` decides, with its other rules); from a
  caller without the ``flag`` role it is 403.

An invalid header is the client's error: `BadRequest` 400 (403 for what the caller may not set) naming it (the
attempt is still recorded). None of these headers is forwarded upstream (`capture.edge.forward_headers`).
"""

from __future__ import annotations

import os

from capture.assembly import RequestContext
from capture.auth import Caller
from capture.edge import BadRequest
from capture.policy import ReplayPolicy, header_asks_flag
from schemas import WorkflowRef
from schemas.envelope import is_valid_request_id


def new_request_id() -> str:
    """A fresh request id: ``rl-`` and 128 random bits, as a uuid4's hex, without building a UUID."""
    return f"rl-{os.urandom(16).hex()}"


def read_reprolane_headers(
    ctx: RequestContext, headers: dict[bytes, bytes], policy: ReplayPolicy, caller: Caller
) -> None:
    """Set the client request id, tenant, workflow and replay flag of `ctx` from `caller` and the request's
    headers (`BadRequest` if invalid or not the caller's to set)."""
    if caller.tenant is not None:
        ctx.tenant = caller.tenant  # first: a refused attempt is recorded under the caller's tenant too
    if "capture" not in caller.roles:
        raise BadRequest(403, "this API key has no 'capture' role")
    client_id = headers.get(b"x-request-id")
    if client_id is not None:
        value = client_id.decode("latin-1")
        if not is_valid_request_id(value):
            raise BadRequest(400, "X-Request-Id must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}", "X-Request-Id")
        ctx.client_request_id = value
    tenant = headers.get(b"x-reprolane-tenant")
    if tenant is not None:
        value = tenant.decode("latin-1")
        if not is_valid_request_id(value):
            raise BadRequest(
                400, "X-Reprolane-Tenant must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}", "X-Reprolane-Tenant"
            )
        if caller.tenant is None:
            ctx.tenant = value
        elif value != caller.tenant:
            raise BadRequest(403, "X-Reprolane-Tenant is not this API key's tenant", "X-Reprolane-Tenant")
    workflow = headers.get(b"x-reprolane-workflow-id")
    step = headers.get(b"x-reprolane-step")
    if workflow is not None:
        wf = workflow.decode("latin-1")
        if not is_valid_request_id(wf):
            raise BadRequest(400, "X-Reprolane-Workflow-Id is not a valid id", "X-Reprolane-Workflow-Id")
        try:
            n = int(step) if step is not None else 0
        except ValueError:
            n = -1
        if n < 0:
            raise BadRequest(400, "X-Reprolane-Step must be an integer >= 0", "X-Reprolane-Step")
        ctx.workflow = WorkflowRef(workflow_id=wf, step=n)
    flag = headers.get(b"x-reprolane-flag")
    if flag is not None and not caller.may_flag and header_asks_flag(flag.decode("latin-1")):
        raise BadRequest(403, "X-Reprolane-Flag needs an API key with the 'flag' role", "X-Reprolane-Flag")
    ctx.flag = policy.decide(
        request_id=ctx.request_id, tenant=ctx.tenant, flag_header=None if flag is None else flag.decode("latin-1")
    )
