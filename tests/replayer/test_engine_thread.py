"""The engine's own thread, and the torch thread count a lane sets on it."""

from __future__ import annotations

import threading

import pytest

from replayer.lanes.engine_thread import EngineThread, set_torch_threads


def test_every_call_runs_on_the_one_engine_thread() -> None:
    thread = EngineThread("test-engine")
    try:
        idents = {thread.call(threading.get_ident) for _ in range(5)}
        assert len(idents) == 1
        assert threading.get_ident() not in idents
        with pytest.raises(ValueError, match="boom"):
            thread.call(int, "boom")
    finally:
        thread.close()


def test_a_lane_sets_its_thread_count_after_vllm_made_set_num_threads_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` in every process that starts an engine; a lane started
    after it (a test session's, the service's second) still runs production's count."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)  # what vLLM's CPU worker leaves behind
    thread = EngineThread("test-engine")
    try:
        start = thread.call(torch.get_num_threads)
        wanted = 2 if start == 1 else 1
        thread.call(torch.set_num_threads, wanted)
        assert thread.call(torch.get_num_threads) == start  # the no-op
        thread.call(set_torch_threads, torch, wanted)
        assert thread.call(torch.get_num_threads) == wanted
    finally:
        thread.close()
