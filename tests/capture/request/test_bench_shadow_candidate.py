"""benchmarks/bench_shadow.py's candidates answer ``/v1/completions`` with bench_capture.py's fake upstream; the
benchmark's "recorded" count means something only if that answer is one the shadow sender records in full (text,
token ids, one logprob step per token with its alternatives), as `capture.request.shadow.ShadowTraffic` reads it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from capture.protocol.output import OutputCollector


def _bench_capture() -> ModuleType:
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_capture.py"
    spec = importlib.util.spec_from_file_location("bench_capture", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_candidate_answer_is_recorded_in_full() -> None:
    bc = _bench_capture()
    body = {"model": "m", "prompt": bc.PROMPT_IDS, "logprobs": 5, "return_token_ids": True}
    collector = OutputCollector("completions")
    collector.add(json.loads(bc._completion_answer(body)))
    (choice,) = collector.choices_record()
    assert choice.token_ids == tuple(bc.OUTPUT_IDS)
    assert choice.text == "".join(bc.OUTPUT_TEXT)
    assert choice.finish_reason == "stop"
    assert choice.logprobs is not None
    assert len(choice.logprobs) == len(bc.OUTPUT_IDS)
    assert [step.token_id for step in choice.logprobs] == bc.OUTPUT_IDS
    assert all(len(step.top) == 5 for step in choice.logprobs)
    assert collector.prompt_token_ids == bc.PROMPT_IDS
