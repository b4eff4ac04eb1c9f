"""Unit tests of the lanes' pure parts (no model, no server): contract mapping, output parsing, the remote lane's
HTTP handling (httpx.MockTransport), lane selection and model-dir resolution."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes import GenRequest, make_lane, resolve_model_dir
from replayer.lanes.base import effective_seed
from replayer.lanes.remote import RemoteLane, steps_from_completion
from replayer.lanes.vllm_lane import steps_from_vllm
from replayer.lanes.vllm_params import completion_body, sampling_kwargs
from replayer.settings import ReplayerSettings
from schemas import SamplingContract

SAMPLED = SamplingContract(
    temperature=0.8,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    repetition_penalty=1.1,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    max_tokens=200,
    min_tokens=4,
    stop=("\n\n",),
    stop_token_ids=(2,),
    ignore_eos=True,
    seed=7,
    seed_scope="per_request",
    logprobs=5,
    logit_bias={"42": -100.0},
    extra={"bad_words": '["never"]'},
)


def test_effective_seed_drops_worker_global() -> None:
    assert effective_seed(SAMPLED) == 7
    worker = SAMPLED.model_copy(update={"seed_scope": "worker_global", "seed": 3})
    assert effective_seed(worker) is None


def test_vllm_sampling_kwargs_carry_the_whole_contract() -> None:
    kw = sampling_kwargs(GenRequest((), SAMPLED, max_tokens=20, top_k_logprobs=5))
    assert kw == {
        "n": 1,
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "max_tokens": 20,
        "min_tokens": 4,
        "stop": ["\n\n"],
        "stop_token_ids": [2],
        "ignore_eos": True,
        "seed": 7,
        "logprobs": 5,
        "logit_bias": {42: -100.0},
        "structured_outputs": None,
        "bad_words": ["never"],
    }
    greedy = SamplingContract(temperature=0.0, seed_scope="none")
    assert (
        sampling_kwargs(GenRequest((), greedy, max_tokens=3, top_k_logprobs=0))["top_k"] == 0
    )  # -1 (disabled) -> vLLM's 0


def test_logits_processors_and_bad_extra_are_not_replayable() -> None:
    processors = SAMPLED.model_copy(update={"logits_processors": ("my.proc",)})
    bad_extra = SAMPLED.model_copy(update={"extra": {"bad_words": "{"}})
    duplicate = SAMPLED.model_copy(update={"extra": {"seed": "1"}})
    with pytest.raises(NotReplayableError, match="logits processors"):
        sampling_kwargs(GenRequest((), processors, max_tokens=1, top_k_logprobs=0))
    with pytest.raises(NotReplayableError, match=r"sampling\.extra\.bad_words is not JSON"):
        completion_body("m", GenRequest((1,), bad_extra, max_tokens=1, top_k_logprobs=0))
    with pytest.raises(NotReplayableError, match="duplicates"):
        sampling_kwargs(GenRequest((), duplicate, max_tokens=1, top_k_logprobs=0))


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
SHAPE = {"type": "object", "properties": {"label": {"type": "string"}}, "required": ["label"]}


def constrained(**fields: object) -> GenRequest:
    """A greedy request whose contract holds the output constraint the capture side records from ``fields``."""
    from capture.protocol.sampling import sampling_contract

    contract = sampling_contract("chat.completions", {"temperature": 0, **fields}, recorded_k=5, seed_injected=False)
    return GenRequest((1, 2), contract, max_tokens=8, top_k_logprobs=5)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SHAPE}}}, {"json": SHAPE}),
        ({"response_format": {"type": "json_object"}}, {"json_object": True}),
        ({"structured_outputs": {"regex": "[a-z]+"}}, {"regex": "[a-z]+"}),
        ({"structured_outputs": {"choice": ["approve", "deny"]}}, {"choice": ["approve", "deny"]}),
        ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, {"grammar": 'root ::= "a" | "b"'}),
    ],
)
def test_the_recorded_constraint_becomes_vllms_structured_outputs(
    fields: dict[str, object], expected: dict[str, object]
) -> None:
    """Dropping the constraint from the lane's parameters (or from the contract) fails this test."""
    params = sampling_kwargs(constrained(**fields))["structured_outputs"]
    assert params is not None
    for name, value in expected.items():
        assert getattr(params, name) == value


def test_a_responses_text_format_becomes_vllms_structured_outputs() -> None:
    from capture.protocol.sampling import sampling_contract

    text = {"format": {"type": "json_schema", "name": "x", "schema": SHAPE}}
    contract = sampling_contract("responses", {"temperature": 0, "text": text}, recorded_k=5, seed_injected=False)
    params = sampling_kwargs(GenRequest((1,), contract, max_tokens=4, top_k_logprobs=0))["structured_outputs"]
    assert params.json == SHAPE


def test_a_text_response_format_constrains_nothing() -> None:
    request = constrained(response_format={"type": "text"})
    assert request.sampling.constraint is not None
    assert sampling_kwargs(request)["structured_outputs"] is None


def test_tools_need_the_recorded_parser_and_a_tokenizer() -> None:
    request = constrained(tools=TOOLS, tool_choice="required")
    with pytest.raises(NotReplayableError, match=r"runtime.tool_call_parser"):
        sampling_kwargs(request)  # production named no parser: its constraint is unknown
    named = GenRequest((1, 2), request.sampling, max_tokens=8, top_k_logprobs=5, tool_call_parser="hermes")
    with pytest.raises(NotReplayableError, match="no tokenizer"):
        sampling_kwargs(named)
    with pytest.raises(NotReplayableError, match=r"sampling\.constraint\.tools"):
        completion_body("m", named)  # /v1/completions takes no tools


@pytest.mark.model
def test_a_required_tool_choice_is_masked_as_the_hermes_parser_masks_it() -> None:
    """The tool parser the server ran turns the tools into the constraint (vLLM's code, not ours)."""
    from transformers import AutoTokenizer  # noqa: TID251 - vLLM's tool parser is built on the model's tokenizer

    settings = ReplayerSettings()
    try:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(settings))
    except (OSError, LaneUnavailableError):
        pytest.skip("no converted model (reprolane model fetch)")
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        request = constrained(tools=TOOLS, tool_choice=choice)
        named = GenRequest((1, 2), request.sampling, max_tokens=8, top_k_logprobs=5, tool_call_parser="hermes")
        params = sampling_kwargs(named, tokenizer)["structured_outputs"]
        assert params is not None, choice
        assert "get_weather" in (params.structural_tag or json.dumps(params.json)), choice
    auto = constrained(tools=TOOLS, tool_choice="auto")
    named = GenRequest((1, 2), auto.sampling, max_tokens=8, top_k_logprobs=5, tool_call_parser="hermes")
    assert sampling_kwargs(named, tokenizer)["structured_outputs"] is None  # hermes masks nothing under auto


def test_completion_body_passes_response_format_and_structured_outputs() -> None:
    body = completion_body("m", constrained(structured_outputs={"choice": ["a", "b"]}))
    assert body["structured_outputs"] == {"choice": ["a", "b"]}
    body = completion_body("m", constrained(response_format={"type": "json_object"}))
    assert body["response_format"] == {"type": "json_object"}


def test_completion_body() -> None:
    body = completion_body("smol", GenRequest((1, 2, 3), SAMPLED, max_tokens=20, top_k_logprobs=5))
    assert body["prompt"] == [1, 2, 3]
    assert body["seed"] == 7
    assert body["logprobs"] == 5
    assert body["return_token_ids"] is True
    assert body["return_tokens_as_token_ids"] is True
    assert body["stop"] == ["\n\n"]
    assert body["logit_bias"] == {"42": -100.0}
    assert body["bad_words"] == ["never"]
    worker = SAMPLED.model_copy(update={"seed_scope": "worker_global"})
    assert "seed" not in completion_body("smol", GenRequest((1,), worker, max_tokens=1, top_k_logprobs=0))


@dataclass
class FakeLogprob:
    logprob: float
    rank: int | None
    decoded_token: str | None


def test_steps_from_vllm_keeps_the_whole_dict_in_its_order() -> None:
    # step 0: the sampled token (7) is outside the top-2, vLLM adds it to the dict first
    per_step = [
        {7: FakeLogprob(-3.0, 5, "x"), 1: FakeLogprob(-0.5, 1, "a"), 2: FakeLogprob(-1.0, 2, "b")},
        {3: FakeLogprob(-0.1, 1, "c"), 4: FakeLogprob(float("-inf"), 2, "d")},
    ]
    steps = steps_from_vllm((7, 3), per_step)
    assert steps is not None
    assert [(c.token_id, c.rank) for c in steps[0].top] == [(7, 5), (1, 1), (2, 2)]  # the servers' views cut this
    assert (steps[0].token_id, steps[0].logprob, steps[0].token) == (7, -3.0, "x")
    assert steps[1].top[1].logprob == -9999.0  # -inf clamped (contract records refuse infinities)
    assert steps_from_vllm((7,), None) is None


def completion_choice() -> dict[str, Any]:
    return {
        "text": "Hi",
        "token_ids": [5, 6],
        "finish_reason": "length",
        "logprobs": {
            "tokens": ["token_id:5", "token_id:6"],
            "token_logprobs": [-0.1, -0.2],
            "top_logprobs": [
                {"token_id:9": -3.0, "token_id:5": -0.1, "token_id:8": -2.0},
                {"token_id:6": -0.2, "token_id:1": -1.5},
            ],
        },
    }


def test_steps_from_completion_parses_ids_and_sorts() -> None:
    steps = steps_from_completion(completion_choice(), (5, 6), 2)
    assert steps is not None
    assert [(c.token_id, c.rank) for c in steps[0].top] == [(5, 1), (8, 2)]  # sorted, cut to k
    assert steps[1].logprob == -0.2
    bad = completion_choice()
    bad["logprobs"]["token_logprobs"] = [-0.1]
    with pytest.raises(LaneUnavailableError, match="logprobs cover 2 steps"):
        steps_from_completion(bad, (5, 6, 7), 2)


def mock_server(*, status: int = 200) -> tuple[httpx.Client, list[dict[str, Any]]]:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        body = json.loads(request.content)
        bodies.append(body)
        if status != 200 and body["prompt"] != [0]:
            return httpx.Response(status, json={"error": {"message": "prompt too long", "type": "BadRequestError"}})
        return httpx.Response(200, json={"system_fingerprint": "vllm-0.32.0-abc", "choices": [completion_choice()]})

    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://lane"), bodies


def test_remote_lane_round_trip() -> None:
    client, bodies = mock_server()
    lane = RemoteLane(ReplayerSettings(lane="remote", remote_url="http://lane"), client=client)
    fp = lane.fingerprint()
    assert (fp.engine, fp.engine_version, fp.system_fingerprint) == ("vllm", "0.32.0", "vllm-0.32.0-abc")
    out = lane.replay(GenRequest((1, 2), SAMPLED, max_tokens=2, top_k_logprobs=2))
    assert out.token_ids == (5, 6)
    assert out.finish_reason == "length"
    assert bodies[-1]["prompt"] == [1, 2]
    lane.close()


def test_remote_lane_translates_errors() -> None:
    client, _ = mock_server(status=400)
    lane = RemoteLane(ReplayerSettings(lane="remote", remote_url="http://lane"), client=client)
    with pytest.raises(NotReplayableError, match="prompt too long"):
        lane.replay(GenRequest((1, 2), SAMPLED, max_tokens=2, top_k_logprobs=2))
    client5, _ = mock_server(status=503)
    lane5 = RemoteLane(ReplayerSettings(lane="remote", remote_url="http://lane"), client=client5)
    with pytest.raises(LaneUnavailableError, match="server error 503"):
        lane5.replay(GenRequest((1, 2), SAMPLED, max_tokens=2, top_k_logprobs=2))

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    dead = httpx.Client(transport=httpx.MockTransport(refuse), base_url="http://lane")
    with pytest.raises(LaneUnavailableError, match="unreachable"):
        RemoteLane(ReplayerSettings(lane="remote", remote_url="http://lane"), client=dead)


def test_make_lane_remote_needs_a_url() -> None:
    with pytest.raises(LaneUnavailableError, match="REMOTE_URL"):
        make_lane(ReplayerSettings(lane="remote"))


def test_resolve_model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(LaneUnavailableError, match="no model at"):
        resolve_model_dir(ReplayerSettings(model_dir=tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(ReplayerSettings(model_dir=tmp_path)) == tmp_path
    monkeypatch.setenv("REPROLANE_CACHE_DIR", str(tmp_path))
    with pytest.raises(LaneUnavailableError, match=re.escape(str(tmp_path / "models/smollm2-135m-instruct"))):
        resolve_model_dir(ReplayerSettings())


def test_cublas_version_reads_the_first_installed_cublas_wheel(monkeypatch: pytest.MonkeyPatch) -> None:
    from replayer.lanes import base
    from tests.factories import fake_installed

    installed = {"nvidia-cublas": "13.1.0.3", "nvidia-cublas-cu12": "12.8.4.1"}
    fake_installed(monkeypatch, installed)
    assert base.cublas_version() == "12.8.4.1"  # cu13 first, then cu12, then the unsuffixed wheel
    del installed["nvidia-cublas-cu12"]
    assert base.cublas_version() == "13.1.0.3"
    installed.clear()
    assert base.cublas_version() is None


def _stub_torch(gpu: bool) -> Any:
    """The few torch attributes `torch_lane_fingerprint` reads, without torch."""
    from types import SimpleNamespace

    cuda = SimpleNamespace(
        is_available=lambda: gpu,
        get_device_name=lambda i: "NVIDIA H200",
        get_device_capability=lambda i: (9, 0),
    )
    return SimpleNamespace(
        __version__="2.9.0", version=SimpleNamespace(cuda="12.8"), cuda=cuda, get_num_threads=lambda: 3
    )


def test_torch_lane_fingerprint_names_the_device_and_the_fixed_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    from replayer.lanes import base

    monkeypatch.setattr(base, "cpu_model_name", lambda: "Some CPU")
    monkeypatch.setattr(base, "cublas_version", lambda: "12.8.4.1")
    args: dict[str, Any] = {"engine": "vllm", "engine_version": "0.32.0", "dtype": "bfloat16"}
    cpu = base.torch_lane_fingerprint(_stub_torch(False), **args, attention_backend="CPU_ATTN", batch_invariant=False)
    assert (cpu.device, cpu.device_name, cpu.compute_capability) == ("cpu", "Some CPU", None)
    assert (cpu.cuda_version, cpu.cublas_version) == (None, None)
    assert (cpu.engine, cpu.engine_version, cpu.torch_version, cpu.dtype) == ("vllm", "0.32.0", "2.9.0", "bfloat16")
    assert (cpu.max_num_seqs, cpu.prefix_caching, cpu.cuda_graphs, cpu.num_threads) == (1, False, False, 3)
    assert (cpu.tensor_parallel_size, cpu.pipeline_parallel_size, cpu.data_parallel_size) == (1, 1, 1)
    assert cpu.attention_backend == "CPU_ATTN"
    assert cpu.quantization == "none"
    assert not cpu.batch_invariant
    gpu = base.torch_lane_fingerprint(_stub_torch(True), **args, attention_backend=None, batch_invariant=True)
    assert (gpu.device, gpu.device_name, gpu.compute_capability) == ("cuda", "NVIDIA H200", "9.0")
    assert (gpu.cuda_version, gpu.cublas_version) == ("12.8", "12.8.4.1")
    assert gpu.batch_invariant


def test_every_lane_name_has_its_class_and_every_class_a_name() -> None:
    """The names are written once (`replayer.settings.LaneName`); the registry, the CLI's ``--lane`` and the
    service's lane choice follow them."""
    import importlib
    from typing import get_args

    from replayer.lane_choice import ONE_AT_A_TIME
    from replayer.lanes import LANE_CLASSES
    from replayer.settings import LaneName

    assert tuple(LANE_CLASSES) == get_args(LaneName) == ONE_AT_A_TIME
    for module, name in LANE_CLASSES.values():
        assert isinstance(getattr(importlib.import_module(module), name), type)
