"""The edge's fixes against the real parts: ``reprolane serve capture`` (a subprocess) in front of the real vLLM.

Hostile request targets never reach a second local server under either parser while vLLM still answers
through the sidecar; an echoed completion of many token-id prompts, whose texts the sidecar now asks of vLLM's
``/detokenize`` several at a time, still answers exactly what vLLM answers without the sidecar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from capture.request.http_server import Parser
from infra.stack.state import StackInfo
from tests.capture.request.cli_sidecar import bystander, cli_sidecar, exchange
from tests.capture.request.test_edge_security import assert_untouched, hostile_targets

pytestmark = pytest.mark.stack


def manifest_env(stack: StackInfo) -> dict[str, str]:
    assert stack.model_dir is not None
    return {"manifest_path": str(stack.model_dir / "reprolane-manifest.json")}


@pytest.mark.parametrize("parser", ["h11", "httptools"])
async def test_no_target_reaches_another_host_in_front_of_vllm(
    stack: StackInfo, tmp_path: Path, parser: Parser
) -> None:
    assert stack.vllm_url is not None
    async with (
        bystander() as other,
        cli_sidecar(stack.vllm_url, tmp_path, http_parser=parser, **manifest_env(stack)) as sidecar,
    ):
        answers = {}
        for target in hostile_targets(other.port):
            for method in ("GET", "POST"):
                request = f"{method} {target} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}"
                answers[method, target] = await exchange(sidecar.port, request.encode("latin-1"))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sidecar.port}", timeout=120) as client:
            models = await client.get("/v1/models")
            chat = await client.post(
                "/v1/chat/completions",
                json={"model": stack.model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
            )
    assert_untouched(other, answers)
    assert all(status in (400, 404) for status, _, _ in answers.values()), answers
    assert models.status_code == 200
    assert chat.status_code == 200, chat.text


async def test_an_echo_of_many_token_id_prompts_answers_as_vllm_does(stack: StackInfo, tmp_path: Path) -> None:
    assert stack.vllm_url is not None
    prompts = [[504, 3575, 314 + i] for i in range(12)]
    body: dict[str, Any] = {
        "model": stack.model_name,
        "prompt": prompts,
        "max_tokens": 0,  # the prompts alone: what they become does not hang on the batch vLLM runs them in
        "temperature": 0,
        "echo": True,
    }
    async with httpx.AsyncClient(timeout=300) as client:
        direct = await client.post(f"{stack.vllm_url}/v1/completions", json=body)
        async with cli_sidecar(stack.vllm_url, tmp_path, **manifest_env(stack)) as sidecar:
            via = await client.post(f"http://127.0.0.1:{sidecar.port}/v1/completions", json=body)
    assert direct.status_code == via.status_code == 200, via.text
    want = sorted((c["index"], c["text"]) for c in direct.json()["choices"])
    got = sorted((c["index"], c["text"]) for c in via.json()["choices"])
    assert got == want  # each prompt's text in front of its own choice, though asked for several at a time
    assert len({text for _, text in got}) == len(prompts)
    assert json.loads(via.text)["choices"][0].get("prompt_token_ids") is None  # stripped: the client asked none
