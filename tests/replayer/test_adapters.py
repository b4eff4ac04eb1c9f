"""LoRA adapters on replay (issue 29): the adapter an envelope records goes to the lane, which loads its own copy
only when that copy's digest is the recorded one and refuses otherwise, naming the field; lanes that cannot load
adapters refuse a request that ran with one; an envelope whose model is an adapter here but records none is
refused rather than replayed on the base model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from infra.clients.digest import directory_sha256
from replayer.errors import NotReplayableError
from replayer.lanes.adapters import Adapter, LocalAdapters
from replayer.lanes.base import GenRequest
from replayer.lanes.remote import RemoteLane
from replayer.lanes.transformers_lane import TransformersLane
from replayer.replay import replay_envelope
from replayer.schedule.replay import ScheduleReplayer
from replayer.settings import ReplayerSettings
from schemas import ArtifactHashes, Envelope, ReplayedOutput, SamplingContract
from tests.factories import lora_adapter_dir
from tests.replayer.schedule.test_replay import _scheduled
from tests.replayer.support import FakeLane, make_envelope
from tests.replayer.test_lanes import mock_server

GREEDY = SamplingContract(temperature=0.0, max_tokens=4, seed_scope="none")


def _with_adapter(envelope: Envelope, name: str, sha256: str) -> Envelope:
    arts = envelope.artifacts.model_copy(update={"adapter_name": name, "adapter_sha256": sha256})
    return envelope.model_copy(update={"model": name, "artifacts": arts})


@dataclass
class AdapterLane(FakeLane):
    """A fake lane that loads adapters the way the vllm lane does (`LocalAdapters.resolve`) and keeps each request."""

    adapters: LocalAdapters = field(default_factory=lambda: LocalAdapters({}, max_rank=16))
    requests: list[GenRequest] = field(default_factory=list)

    def replay(self, request: GenRequest) -> ReplayedOutput:
        self.requests.append(request)
        if request.adapter is not None:
            self.adapters.resolve(request.adapter)
        return super().replay(request)


def test_the_same_adapter_loads_with_one_engine_id_per_digest(tmp_path: Path) -> None:
    path = lora_adapter_dir(tmp_path / "tone")
    recorded = Adapter("tone", directory_sha256(path))
    adapters = LocalAdapters({"tone": path}, max_rank=16)
    first = adapters.resolve(recorded)
    assert (first.name, first.path) == ("tone", path)
    assert adapters.resolve(recorded).engine_id == first.engine_id
    (path / "adapter_model.safetensors").write_bytes(b"changed weights")
    changed = Adapter("tone", directory_sha256(path))
    assert adapters.resolve(changed).engine_id != first.engine_id  # a cached copy is never served for another


def test_a_different_adapter_is_refused(tmp_path: Path) -> None:
    recorded = Adapter("tone", directory_sha256(lora_adapter_dir(tmp_path / "recorded")))
    other = lora_adapter_dir(tmp_path / "tone", b"other lora weights")
    adapters = LocalAdapters({"tone": other}, max_rank=16)
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_sha256: this lane's adapter 'tone'.*not the"):
        adapters.resolve(recorded)
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_name: .*'style', which this lane does not"):
        adapters.resolve(Adapter("style", recorded.sha256))
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_name: .*its adapters: none"):
        LocalAdapters({}, max_rank=16).resolve(recorded)
    gone = LocalAdapters({"tone": tmp_path / "gone"}, max_rank=16)
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_sha256: .*cannot be read"):
        gone.resolve(recorded)


def test_an_adapter_above_the_lanes_rank_is_refused(tmp_path: Path) -> None:
    path = lora_adapter_dir(tmp_path / "tone", rank=32)
    with pytest.raises(NotReplayableError, match="rank 32, above this lane's max_lora_rank 16"):
        LocalAdapters({"tone": path}, max_rank=16).resolve(Adapter("tone", directory_sha256(path)))


def test_a_replay_hands_the_recorded_adapter_to_the_lane(tmp_path: Path) -> None:
    """Fails when the adapter is dropped between the envelope and the lane: the lane would run the base model."""
    path = lora_adapter_dir(tmp_path / "tone")
    envelope = _with_adapter(make_envelope(1), "tone", directory_sha256(path))
    settings = ReplayerSettings(lora_modules={"tone": path})
    lane = AdapterLane(adapters=LocalAdapters(settings.lora_modules, max_rank=16))
    lane.learn(envelope)
    result = replay_envelope(envelope, lane, settings)
    assert result.event.verdict == "bitwise"
    assert [r.adapter for r in lane.requests] == [Adapter("tone", directory_sha256(path))]

    base = make_envelope(2)
    lane.learn(base)
    replay_envelope(base, lane, settings)
    assert lane.requests[-1].adapter is None

    (path / "adapter_model.safetensors").write_bytes(b"retrained weights")
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_sha256"):
        replay_envelope(envelope, lane, settings)


def test_an_envelope_naming_an_adapter_here_without_recording_it_is_refused(tmp_path: Path) -> None:
    path = lora_adapter_dir(tmp_path / "tone")
    settings = ReplayerSettings(lora_modules={"tone": path})
    envelope = make_envelope(1, model="tone", artifacts=ArtifactHashes())
    lane = AdapterLane()
    lane.learn(envelope)
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_sha256: the request named 'tone'"):
        replay_envelope(envelope, lane, settings)
    assert lane.requests == []


def test_lanes_that_cannot_load_adapters_refuse(tmp_path: Path) -> None:
    request = GenRequest((1, 2), GREEDY, max_tokens=2, top_k_logprobs=0, adapter=Adapter("tone", "a" * 64))
    client, bodies = mock_server()
    remote = RemoteLane(ReplayerSettings(lane="remote", remote_url="http://lane"), client=client)
    with pytest.raises(NotReplayableError, match=r"artifacts\.adapter_name: .*the remote lane does not load"):
        remote.replay(request)
    assert [b["prompt"] for b in bodies] == [[0]]  # only the lane's start-up probe: nothing replayed on the base
    remote.close()
    bare = object.__new__(TransformersLane)  # the refusal comes before the model is touched
    with pytest.raises(NotReplayableError, match="the transformers lane does not load"):
        bare.replay(request)


def test_the_schedule_lane_says_why_it_is_not_used() -> None:
    envelope = _with_adapter(make_envelope(1), "tone", "a" * 64)
    answer = ScheduleReplayer(ReplayerSettings()).find(envelope.model_copy(update={"schedule": None}))
    assert answer == "the envelope names no schedule (its upstream did not record one)"
    answer = ScheduleReplayer(ReplayerSettings()).find(_scheduled(envelope))
    assert answer == "the schedule lane does not load LoRA adapters (artifacts.adapter_name 'tone')"
