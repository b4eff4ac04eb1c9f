"""The recorder in vLLM's real OpenAI server, and a request of it replayed bitwise by the schedule lane.

A private vLLM server (the stack's flags: bfloat16, eager, max_num_seqs 256, prefix caching on) is started on a
free port with ``--scheduler-cls capture.schedule.recorder.RecordingScheduler`` and ``REPROLANE_SCHEDULE_DIR``;
concurrent completions are sent with ``X-Request-Id``; the segments the server wrote are read, each request is
joined to its arrival by that id, and one is replayed from the server's own schedule: its token ids and logprobs
equal the server's response.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from replayer.lanes.base import GenRequest
from replayer.lanes.batch_engine import render_chat
from replayer.matrix.inputs import DEFAULT_PROMPTS
from replayer.schedule.lane import ScheduleLane
from replayer.settings import ReplayerSettings
from schemas import SamplingContract
from schemas.schedule_delivery import decode_segment, external_request_id_for
from schemas.schedule_log import ScheduleLog
from tests.replayer.schedule.test_lane_model import model_dir

pytestmark = pytest.mark.model

MODEL_NAME = "smollm2-135m-instruct"
MAX_TOKENS = 12
TOP_K = 3
N = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    schedule_dir = tmp_path_factory.mktemp("server-schedule")
    port = _free_port()
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir()), "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "2048", "--enforce-eager",
        "--max-num-seqs", "256", "--enable-prefix-caching", "--seed", "0",
        "--scheduler-cls", "capture.schedule.recorder.RecordingScheduler",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[3]), os.environ.get("PYTHONPATH", "")]),
        "REPROLANE_SCHEDULE_DIR": str(schedule_dir),
        "REPROLANE_SCHEDULE_SEGMENT_SECONDS": "0.5",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    log = (schedule_dir.parent / "server.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        else:
            pytest.fail("vLLM did not become ready")
        yield url, schedule_dir
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _complete(url: str, ids: tuple[int, ...], request_id: str) -> dict[str, Any]:
    body = {
        "model": MODEL_NAME,
        "prompt": list(ids),
        "temperature": 0.0,
        "max_tokens": MAX_TOKENS,
        "logprobs": TOP_K,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    resp = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": request_id}, timeout=600)
    resp.raise_for_status()
    return dict(resp.json()["choices"][0])


def _read_log(directory: Path) -> ScheduleLog:
    (engine_dir,) = [p for p in directory.iterdir() if p.is_dir()]
    records: list[Any] = []
    for path in sorted(engine_dir.glob("*.jsonl")):
        records.extend(decode_segment(path.read_bytes(), engine_dir.name))
    return ScheduleLog.from_records(records)


def test_a_server_request_replays_bitwise_from_the_servers_schedule(server: tuple[str, Path]) -> None:
    url, directory = server
    prompts = render_chat(model_dir(), DEFAULT_PROMPTS[:N])
    names = [f"rl-sched-{i}" for i in range(N)]
    joins = [external_request_id_for("completions", n) for n in names]  # what vLLM names them
    with ThreadPoolExecutor(N) as pool:
        choices = list(pool.map(lambda a: _complete(url, *a), zip(prompts, names, strict=True)))
    log: ScheduleLog | None = None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        log = _read_log(directory)
        if all((a := log.by_external_id(j)) is not None and log.output_length(a.engine_request_id) for j in joins):
            break
        time.sleep(0.5)
    assert log is not None
    assert log.engine is not None
    assert log.problems() == []
    arrivals = [log.by_external_id(j) for j in joins]
    assert all(a is not None for a in arrivals)
    # the join names each request's own arrival: its prompt length and output length are the response's
    for a, ids, choice in zip(arrivals, prompts, choices, strict=True):
        assert a is not None
        assert a.num_prompt_tokens == len(ids)
        assert log.output_length(a.engine_request_id) == len(choice["token_ids"])
    assert any(len(s.scheduled) > 1 for s in log.steps.values()), "the server never batched the requests"
    # replay the one whose steps were shared with the most companions
    target = max(
        range(N),
        key=lambda i: sum(len(log.steps[s].scheduled) for s in log.requests[arrivals[i].engine_request_id].steps),
    )  # type: ignore[union-attr]
    arrival = arrivals[target]
    assert arrival is not None
    lane = ScheduleLane(ReplayerSettings(model_dir=model_dir()), log.engine)
    try:
        request = GenRequest(
            prompts[target],
            SamplingContract(temperature=0.0, seed_scope="none"),
            max_tokens=MAX_TOKENS,
            top_k_logprobs=TOP_K,
        )
        result = lane.replay_target(log, arrival.engine_request_id, request)
    finally:
        lane.close()
    assert result.steps.mismatch is None, result.steps.mismatch
    assert result.schedule_reproduced, result.notes
    assert result.output is not None
    choice = choices[target]
    assert list(result.output.token_ids) == choice["token_ids"]
    served = [
        {int(k.removeprefix("token_id:")): v for k, v in top.items()} for top in choice["logprobs"]["top_logprobs"]
    ]
    assert result.output.logprobs is not None
    replayed = [{c.token_id: c.logprob for c in step.top} for step in result.output.logprobs]
    assert replayed == [{k: v for k, v in s.items() if k in r} for s, r in zip(served, replayed, strict=True)]
    assert [s.logprob for s in result.output.logprobs] == choice["logprobs"]["token_logprobs"]
