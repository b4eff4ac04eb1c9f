"""Issue 18, "also prove", on the real parts: the edge fuzz's generated requests (fewer of them) sent to
``reprolane serve capture`` (a subprocess, API keys on, h11: the parser that hands the most to the app) in front
of the stack's vLLM. The process must stay alive, answer no 5xx of its own (vLLM's own answers pass as they
are), still serve a normal request at the end, and keep its resident memory bounded.

A generated JSON body names the stack's model where it named the fake one and asks for a few tokens at most, so
that the CPU-only vLLM answers within the test's time.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings

from infra.stack.state import StackInfo
from tests.capture.keys import ApiKeys, write_test_keys
from tests.capture.request.cli_sidecar import RunningSidecar, cli_sidecar
from tests.capture.request.edge_fuzz import FuzzRequest, any_requests, send_raw
from tests.capture.request.test_edge_fuzz import FUZZ, LoopThread

pytestmark = pytest.mark.stack

RSS_GROWTH_LIMIT = 128 * 1024 * 1024  # what the sidecar may grow by over the examples (its caches fill once)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


@pytest.fixture(scope="module")
def fuzzed(
    stack: StackInfo, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LoopThread, RunningSidecar, ApiKeys, str, list[int]]]:
    assert stack.vllm_url is not None
    assert stack.model_dir is not None
    tmp = tmp_path_factory.mktemp("edge-fuzz-stack")
    keys = write_test_keys(tmp)
    thread = LoopThread()
    exits = contextlib.AsyncExitStack()
    env = {
        "http_parser": "h11",
        "auth_mode": "keys",
        "api_keys_path": str(keys.path),
        "manifest_path": str(stack.model_dir / "reprolane-manifest.json"),
    }
    try:
        sidecar = thread.run(exits.enter_async_context(cli_sidecar(stack.vllm_url, tmp, **env)))
        yield thread, sidecar, keys, stack.model_name, [rss_bytes(sidecar.process.pid)]
    finally:
        thread.run(exits.aclose())
        thread.stop()


def for_the_stack(request: FuzzRequest, model: str) -> FuzzRequest:
    """`request` with a JSON object body naming `model` and asking for 3 tokens at most."""
    try:
        doc = json.loads(request.body)
    except (ValueError, RecursionError):  # sent as it is: the sidecar refuses it
        return request
    if not isinstance(doc, dict):
        return request
    if doc.get("model") == "fake-model":
        doc["model"] = model
    max_tokens = doc.get("max_tokens")
    doc["max_tokens"] = min(max_tokens, 3) if type(max_tokens) is int else 3
    return replace(request, body=json.dumps(doc, allow_nan=True).encode("utf-8", "surrogatepass"))


def keyring(keys: ApiKeys) -> dict[str, str]:
    return {"{bank}": keys.bank, "{attacker}": keys.attacker, "{reader}": keys.reader}


@settings(FUZZ, max_examples=int(os.environ.get("REPROLANE_FUZZ_STACK_EXAMPLES", "100")))
@given(request=any_requests)
def test_the_cli_sidecar_answers_no_5xx_of_its_own(
    fuzzed: tuple[LoopThread, RunningSidecar, ApiKeys, str, list[int]], request: FuzzRequest
) -> None:
    thread, sidecar, keys, model, _ = fuzzed
    answer = thread.run(send_raw(sidecar.port, for_the_stack(request, model).wire(keyring(keys)), 120.0), 150.0)
    assert sidecar.process.poll() is None, sidecar.log_text()[-4000:]
    if answer.status >= 500:  # vLLM's own 5xx passes as it is; the sidecar's are internal or upstream errors
        try:
            error = json.loads(answer.body)["error"]
        except (ValueError, KeyError, TypeError):
            pytest.fail(f"a 5xx that is not vLLM's: {answer!r}")
        assert error["type"] not in ("internal_error", "upstream_error"), answer
        assert not str(error["message"]).startswith("reprolane"), answer


def test_the_cli_sidecar_is_up_and_bounded_after_the_fuzzing(
    fuzzed: tuple[LoopThread, RunningSidecar, ApiKeys, str, list[int]],
) -> None:
    thread, sidecar, keys, model, (rss_at_start,) = fuzzed
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    chat = FuzzRequest(
        "POST",
        b"/v1/chat/completions",
        (("Authorization", b"Bearer {bank}"), ("Content-Type", b"application/json")),
        body.encode(),
        False,
    )
    answer = thread.run(send_raw(sidecar.port, chat.wire(keyring(keys)), 120.0), 150.0)
    assert answer.status == 200, answer
    assert answer.request_id is not None
    assert sidecar.process.poll() is None
    grown = rss_bytes(sidecar.process.pid) - rss_at_start
    assert grown < RSS_GROWTH_LIMIT, f"the sidecar grew by {grown} bytes of resident memory"
    assert "Traceback" not in sidecar.log_text(), sidecar.log_text()[-4000:]
