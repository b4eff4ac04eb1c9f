"""Every ``X-Reprolane-*`` value is bounded at the edge (issue 18, finding 2): a value that would make an S3 key
over 1,024 bytes, or carry characters no key or label should hold, is a 400 in OpenAI's error format naming the
header, refused before upstream and recorded without the bad value.

Through the real app (served on a loopback socket, a fake upstream, a fake spool). Before the fix a step of 1000
digits was accepted (and later blocked the publisher: the workflow index key was over S3's limit).
"""

from __future__ import annotations

import pytest

from capture.request.request_headers import MAX_STEP
from schemas import CapturedError
from schemas.layout import MAX_KEY_BYTES, workflow_index_key
from tests.capture.support import CHAT, only, sidecar, upstream_calls

LONG_ID = "a" * 129


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": "1" * 1000}, "X-Reprolane-Step"),
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": str(MAX_STEP + 1)}, "X-Reprolane-Step"),
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": "-1"}, "X-Reprolane-Step"),
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": "+5"}, "X-Reprolane-Step"),
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": "1_000"}, "X-Reprolane-Step"),
        ({"X-Reprolane-Workflow-Id": "wf", "X-Reprolane-Step": "\u0663"}, "X-Reprolane-Step"),  # Arabic-Indic 3
        ({"X-Reprolane-Step": "9" * 50}, "X-Reprolane-Step"),  # checked even without a workflow id
        ({"X-Reprolane-Workflow-Id": LONG_ID}, "X-Reprolane-Workflow-Id"),
        ({"X-Reprolane-Workflow-Id": "wf/../x"}, "X-Reprolane-Workflow-Id"),
        ({"X-Reprolane-Tenant": LONG_ID}, "X-Reprolane-Tenant"),
        ({"X-Reprolane-Tenant": "acme bank"}, "X-Reprolane-Tenant"),
        ({"X-Reprolane-Flag": "t" * 17}, "X-Reprolane-Flag"),
        ({"X-Reprolane-Flag": "true; drop"}, "X-Reprolane-Flag"),
        ({"X-Reprolane-Flag": "\u00e9"}, "X-Reprolane-Flag"),
    ],
)
async def test_an_unbounded_or_odd_header_is_a_400_naming_it(headers: dict[str, str], named: str) -> None:
    encoded = {k: v.encode("utf-8") for k, v in headers.items()}
    async with sidecar() as (client, upstream, spool, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=encoded)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == named
    assert error["type"] == "invalid_request_error"
    assert named in error["message"]
    assert upstream_calls(upstream, "/v1/chat/completions") == []
    env = only(spool)
    assert isinstance(env.outcome, CapturedError)
    assert env.workflow is None or len(str(env.workflow.step)) <= 9


async def test_the_largest_bounded_values_are_accepted_and_make_keys_s3_takes() -> None:
    headers = {
        "X-Request-Id": "r" * 128,
        "X-Reprolane-Tenant": "t" * 128,
        "X-Reprolane-Workflow-Id": "w" * 128,
        "X-Reprolane-Step": str(MAX_STEP),
        "X-Reprolane-Flag": "TRUE",
    }
    async with sidecar() as (client, _upstream, spool, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert resp.status_code == 200
    env = only(spool)
    assert env.workflow is not None
    assert (env.tenant, env.workflow.workflow_id, env.workflow.step) == ("t" * 128, "w" * 128, MAX_STEP)
    assert env.flagged
    assert len(workflow_index_key(env.workflow.workflow_id, env.workflow.step, env.request_id).encode()) < MAX_KEY_BYTES


async def test_an_unusable_client_request_id_is_a_400_naming_it_and_never_reaches_a_key() -> None:
    """The client's X-Request-Id is recorded as client_request_id (the request id is always the sidecar's own),
    so an unbounded one is the client's error, not a value an S3 key would be built from."""
    async with sidecar() as (client, upstream, spool, _m):
        resp = await client.post("/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "x" * 5000})
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "X-Request-Id"
    assert [s.path for s in upstream.seen if s.path == "/v1/chat/completions"] == []
    env = only(spool)
    assert env.request_id.startswith("rl-")
    assert env.client_request_id is None
