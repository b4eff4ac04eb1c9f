"""LoRA adapters end to end on the real stack (issue 29, deliverable 6).

The test builds two random LoRA adapters for the model itself (`infra.model.lora.build_random_adapter`, seeds 1 and 2:
outputs differ, nothing is downloaded). The stack's launcher starts a private vLLM serving the first as ``tone``
(the stack's flags plus ``--enable-lora --lora-modules tone=PATH``); the real sidecar, told the same adapter
(``lora_modules``), captures a request naming ``tone`` and one naming the base model. Then:

- the adapter's envelope records the adapter's name and the digest of its files beside the model's hashes; the
  base request's records none;
- both replay bitwise on the in-process vLLM lane with the lane's own copy of the adapter (LoRA enabled, as
  production's engine was);
- the lane's copy replaced by the other adapter's weights: the replay is refused, naming
  ``artifacts.adapter_sha256``; and what it would have replayed differs (the second adapter, or none at all, is
  not the recorded computation: the check is what stands between them and a wrong verdict).

One private vLLM, stopped before the lane's engine starts (one vLLM of ours at a time), and one lane engine for the
module.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.settings import CaptureSettings
from infra.clients.digest import directory_sha256
from infra.model.lora import build_random_adapter
from infra.stack.state import StackInfo
from replayer.errors import NotReplayableError
from replayer.lanes.vllm_lane import VllmLane
from replayer.replay import replay_envelope
from replayer.settings import ReplayerSettings
from schemas import CapturedOutput, Envelope
from schemas.manifest import MANIFEST_NAME
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import serve
from tests.private_vllm import launched_vllm

pytestmark = [pytest.mark.stack, pytest.mark.model, pytest.mark.own_engines]

ADAPTER = "tone"
MESSAGES = [{"role": "user", "content": "Describe the sea at dawn in one sentence."}]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The served adapter (``recorded``), the lane's copy of it (``lane``), and another one (``other``)."""
    assert stack.model_dir is not None
    root = tmp_path_factory.mktemp("lora")
    recorded = build_random_adapter(stack.model_dir, root / "recorded", seed=1)
    other = build_random_adapter(stack.model_dir, root / "other", seed=2)
    lane = shutil.copytree(recorded, root / "lane")
    return {"recorded": recorded, "lane": lane, "other": other}


def lora_vllm(adapter: Path, run_dir: Path) -> contextlib.AbstractContextManager[str]:
    """A private vLLM with the stack's flags, serving ``adapter`` as ``tone``."""
    return launched_vllm(run_dir, ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}"])


async def _capture(settings: CaptureSettings, models: tuple[str, ...]) -> list[Envelope]:
    spool = FakeSpool()
    app = build_app(settings, spool=spool, metrics=CaptureMetrics())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=300.0) as client:
        for model in models:
            body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
            reply = await client.post("/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
    return spool.envelopes


@pytest.fixture(scope="module")
def captured(
    stack: StackInfo, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Envelope]:
    """A request naming the adapter and one naming the base model, through the real sidecar to the private vLLM,
    which is stopped once they are captured (one engine of ours at a time on this machine)."""
    assert stack.model_dir is not None
    with lora_vllm(adapters["recorded"], tmp_path_factory.mktemp("lora-vllm")) as url:
        settings = CaptureSettings(
            upstream=url,
            spool_max_bytes=1 << 22,
            manifest_path=stack.model_dir / MANIFEST_NAME,
            lora_modules={ADAPTER: adapters["recorded"]},
        )
        envelopes = asyncio.run(_capture(settings, (ADAPTER, stack.model_name)))
    return {e.model: e for e in envelopes}


@pytest.fixture(scope="module")
def lane(stack: StackInfo, captured: dict[str, Envelope], adapters: dict[str, Path]) -> Iterator[VllmLane]:
    """The in-process vLLM lane with LoRA on (started after the capture): the lane's copy of ``tone``, and the
    other adapter as ``other``."""
    engine = VllmLane(_settings(stack, adapters))
    try:
        yield engine
    finally:
        engine.close()


def _lane_adapters(adapters: dict[str, Path]) -> dict[str, Path]:
    return {ADAPTER: adapters["lane"], "other": adapters["other"]}


def _settings(stack: StackInfo, adapters: dict[str, Path]) -> ReplayerSettings:
    return ReplayerSettings(lane="vllm", model_dir=stack.model_dir, lora_modules=_lane_adapters(adapters))


def test_the_adapter_is_in_the_envelopes_artifacts(
    stack: StackInfo, captured: dict[str, Envelope], adapters: dict[str, Path]
) -> None:
    tuned, base = captured[ADAPTER].artifacts, captured[stack.model_name].artifacts
    assert (tuned.adapter_name, tuned.adapter_sha256) == (ADAPTER, directory_sha256(adapters["recorded"]))
    assert tuned.model_sha256 is not None
    assert tuned.model_sha256 == base.model_sha256
    assert (base.adapter_name, base.adapter_sha256) == (None, None)
    a, b = (e.outcome for e in (captured[ADAPTER], captured[stack.model_name]))
    assert isinstance(a, CapturedOutput)
    assert isinstance(b, CapturedOutput)
    assert a.choices[0].token_ids != b.choices[0].token_ids  # the adapter changed what upstream answered


def test_replays_bitwise_with_the_same_adapter(
    stack: StackInfo, captured: dict[str, Envelope], adapters: dict[str, Path], lane: VllmLane
) -> None:
    for envelope in (captured[ADAPTER], captured[stack.model_name]):
        result = replay_envelope(envelope, lane, _settings(stack, adapters))
        assert result.event.verdict == "bitwise", (envelope.model, result.event.cause_detail)


def test_a_different_adapter_is_refused(
    stack: StackInfo, captured: dict[str, Envelope], adapters: dict[str, Path], lane: VllmLane
) -> None:
    envelope = captured[ADAPTER]
    copy = adapters["lane"] / "adapter_model.safetensors"
    kept = copy.read_bytes()
    copy.write_bytes((adapters["other"] / "adapter_model.safetensors").read_bytes())
    try:
        with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_sha256: this lane's adapter 'tone'"):
            replay_envelope(envelope, lane, _settings(stack, adapters))
    finally:
        copy.write_bytes(kept)
    # what the check prevents: the other adapter, or none, is another computation than the recorded one
    arts = envelope.artifacts
    other = envelope.model_copy(
        update={"artifacts": arts.model_copy(update={"adapter_name": "other", "adapter_sha256": _sha(adapters)})}
    )
    dropped = envelope.model_copy(
        update={
            "model": stack.model_name,
            "artifacts": arts.model_copy(update={"adapter_name": None, "adapter_sha256": None}),
        }
    )
    for wrong in (other, dropped):
        assert replay_envelope(wrong, lane, _settings(stack, adapters)).event.verdict != "bitwise"


def _sha(adapters: dict[str, Path]) -> str:
    return directory_sha256(adapters["other"])
