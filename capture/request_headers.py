"""What the sidecar reads from a captured request's headers: its request id, and the ``X-Reprolane-*`` headers.

- ``X-Request-Id``: kept as the envelope's request id when it is a valid id not seen recently (`RecentIds`),
  else one is made (``rl-`` and 128 random bits), so two envelopes never share a request id by accident.
- ``X-Reprolane-Tenant``: the tenant (default: the settings' ``default_tenant``).
- ``X-Reprolane-Workflow-Id`` and ``X-Reprolane-Step``: where the request sits in an agent workflow.
- ``X-Reprolane-Flag``: asks for replay (`capture.policy.ReplayPolicy` decides, with its other rules).

An invalid header is the client's error: `BadRequest` 400 naming it (the attempt is still recorded). None of
these headers is forwarded upstream (`capture.edge.forward_headers`).
"""

from __future__ import annotations

import os

from capture.assembly import RequestContext
from capture.edge import BadRequest, RecentIds
from capture.policy import ReplayPolicy
from schemas import WorkflowRef
from schemas.envelope import is_valid_request_id


def request_id(supplied: bytes | None, recent: RecentIds) -> str:
    """The request id of a new request: the client's ``X-Request-Id`` when usable, else a fresh one."""
    if supplied is not None:
        value = supplied.decode("latin-1")
        if is_valid_request_id(value) and value not in recent:
            recent.add(value)
            return value
    value = f"rl-{os.urandom(16).hex()}"  # 128 random bits, as a uuid4's hex, without building a UUID
    recent.add(value)
    return value


def read_reprolane_headers(ctx: RequestContext, headers: dict[bytes, bytes], policy: ReplayPolicy) -> None:
    """Set the tenant, workflow and replay flag of `ctx` from the request's headers (`BadRequest` if invalid)."""
    tenant = headers.get(b"x-reprolane-tenant")
    if tenant is not None:
        value = tenant.decode("latin-1")
        if not is_valid_request_id(value):
            raise BadRequest(
                400, "X-Reprolane-Tenant must match [A-Za-z0-9][A-Za-z0-9._:-]{0,127}", "X-Reprolane-Tenant"
            )
        ctx.tenant = value
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
    ctx.flag = policy.decide(
        request_id=ctx.request_id, tenant=ctx.tenant, flag_header=None if flag is None else flag.decode("latin-1")
    )
