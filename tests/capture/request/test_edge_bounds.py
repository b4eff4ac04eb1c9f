"""Bounds on what one request makes the sidecar do, and on what it writes to the log (in-process sidecar in
front of the fake upstream): an echoed request's ``/detokenize`` calls, control characters in logged paths."""

from __future__ import annotations

import logging
import time

import pytest

from capture.request.proxy import DETOKENIZE_CONCURRENCY
from tests.capture.fake_upstream import FakeUpstream
from tests.capture.support import MODEL, sidecar, upstream_calls

PROMPTS = 40
DELAY_S = 0.05


async def test_an_echo_of_many_token_id_prompts_detokenizes_them_concurrently_within_a_bound() -> None:
    prompts = [[504, 6376, i] for i in range(PROMPTS)]
    upstream = FakeUpstream(detokenize_delay_s=DELAY_S)
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "echo": True}
    async with sidecar(upstream=upstream) as (client, _, spool, _):
        t0 = time.perf_counter()
        resp = await client.post("/v1/completions", json=body)
        elapsed = time.perf_counter() - t0
    assert resp.status_code == 200
    calls = upstream_calls(upstream, "/detokenize")
    assert sorted(c["tokens"][2] for c in calls) == list(range(PROMPTS))  # each prompt asked for once
    assert 1 < upstream.detokenize_peak <= DETOKENIZE_CONCURRENCY
    assert elapsed < PROMPTS * DELAY_S / 2  # not one after the other
    assert resp.json()["choices"][0]["text"].startswith("text of 504,6376,0")
    assert upstream_calls(upstream, "/v1/completions")[0].get("return_token_ids") is True
    assert len(spool.envelopes) == 1


async def test_an_echo_stops_detokenizing_at_the_first_failure() -> None:
    """When upstream refuses to detokenize, no worker asks again after a refusal: at most one call each, not one
    per prompt."""
    prompts = [[504, 6376, i] for i in range(PROMPTS)]
    upstream = FakeUpstream(detokenize_delay_s=DELAY_S, detokenize_status=404)
    body = {"model": MODEL, "prompt": prompts, "max_tokens": 3, "echo": True}
    async with sidecar(upstream=upstream) as (client, _, _, _):
        resp = await client.post("/v1/completions", json=body)
    assert resp.status_code == 200
    assert 1 <= len(upstream_calls(upstream, "/detokenize")) <= DETOKENIZE_CONCURRENCY
    assert "return_token_ids" not in upstream_calls(upstream, "/v1/completions")[0]


@pytest.mark.parametrize(
    ("path", "shown"),
    [
        ("/x%1B%5B31mRED%1B%5B0m", "/x\\x1b[31mRED\\x1b[0m"),  # an ANSI colour
        ("/x%0D2026-12-01 ERROR forged line", "/x\\x0d2026-12-01 ERROR forged line"),  # a forged log line
        ("/x%09%7F%C2%85", "/x\\x09\\x7f\\x85"),  # a tab, DEL, a C1 control (NEL)
        ("/x%E2%80%AEtxt.exe", "/x\\u202etxt.exe"),  # a right-to-left override
        ("/x%5Cx1b", "/x\\\\x1b"),  # a backslash, doubled: an escape cannot be forged with one
    ],
)
async def test_control_characters_of_a_path_reach_the_log_escaped(
    caplog: pytest.LogCaptureFixture, path: str, shown: str
) -> None:
    async with sidecar() as (client, _, _, _):
        with caplog.at_level(logging.WARNING, logger="capture.request.passthrough"):
            await client.post(path, content=b"{}")
    (record,) = [r for r in caplog.records if r.name == "capture.request.passthrough"]
    message = record.getMessage()
    assert shown in message, message
    assert message.isprintable()
