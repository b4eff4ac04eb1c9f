"""An in-process vLLM engine that records its own schedule, driven step by step (what the schedule lane runs).

`start_recording_engine` starts ``vllm.LLMEngine`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
vLLM's scheduler class set to the recorder production runs, ``capture.schedule.recorder.RecordingScheduler``
(named to vLLM as a string, so the replayer never imports the capture package), writing to a directory of its
own. `read_log` reads that directory back as a `schemas.schedule_log.ScheduleLog`; with ``consume`` it removes the
segments it read, so that a long-running lane reads each of its own steps once and its directory stays small.

`StepDriver` is the in-process "production" the proof tests and the benchmark use: it runs requests that
arrive before given step numbers through such an engine, exactly as vLLM's server loop interleaves arrivals and
steps, and returns their outputs with their engine request ids.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.base import GenRequest, quiet_imports
from replayer.lanes.engine_thread import set_torch_threads
from replayer.lanes.vllm_lane import output_from_vllm, release_engine
from replayer.lanes.vllm_params import sampling_kwargs
from schemas import ReplayedOutput
from schemas.schedule import ScheduleStep
from schemas.schedule_delivery import decode_segment, parse_segment_file_name
from schemas.schedule_log import ScheduleLog

RECORDER_CLS: Final = "capture.schedule.recorder.RecordingScheduler"
ENV_DIR: Final = "REPROLANE_SCHEDULE_DIR"


def prepare_environment() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def start_recording_engine(model_dir: Path, log_dir: Path | None, **engine_kwargs: Any) -> tuple[Any, Any]:
    """``(LLMEngine, its recorder)``; ``engine_kwargs`` are ``vllm.EngineArgs`` fields (eager unless told).
    Without ``log_dir`` the engine runs vLLM's own scheduler and the recorder is None (the benchmark's baseline)."""
    prepare_environment()
    previous = os.environ.get(ENV_DIR)
    if log_dir is not None:
        os.environ[ENV_DIR] = str(log_dir)
        engine_kwargs["scheduler_cls"] = RECORDER_CLS
    try:
        with quiet_imports():
            from vllm import EngineArgs, LLMEngine

            engine_kwargs.setdefault("enforce_eager", True)
            engine: Any = LLMEngine.from_engine_args(EngineArgs(model=str(model_dir), **engine_kwargs))
    except ImportError as exc:
        raise LaneUnavailableError(f"the schedule lane needs the lanes extra (vllm): {exc}") from exc
    except Exception as exc:  # vLLM raises many types; all mean "this engine cannot start here"
        raise LaneUnavailableError(f"vLLM refused the engine settings: {type(exc).__name__}: {exc}") from exc
    finally:
        if previous is None:
            os.environ.pop(ENV_DIR, None)
        else:
            os.environ[ENV_DIR] = previous
    recorder = getattr(engine.engine_core.engine_core.scheduler, "schedule_recorder", None)
    if recorder is None and log_dir is not None:
        release_engine(engine)
        raise LaneUnavailableError("the engine's scheduler does not record (is capture.schedule importable?)")
    return engine, recorder


def read_log(recorder: Any, *, consume: bool = False) -> ScheduleLog:
    """The recorder's log so far (its open segment completed first); with ``consume``, only what no earlier
    consuming read returned, and the segments read are removed."""
    recorder.writer.sync()
    return read_segments(Path(recorder.writer.directory), str(recorder.engine_id), consume=consume)


def read_segments(directory: Path, engine_id: str, *, consume: bool = False) -> ScheduleLog:
    """The closed segments of engine `engine_id` in `directory` (a recorder's, in this process or another), as one
    log; with ``consume`` the segments read are removed."""
    records: list[Any] = []
    for path in sorted(directory.iterdir()):
        if parse_segment_file_name(path.name) is not None:
            records.extend(decode_segment(path.read_bytes(), engine_id))
            if consume:
                path.unlink()
    return ScheduleLog.from_records(records)


def steps_from(log: ScheduleLog, first: int) -> list[ScheduleStep]:
    return [log.steps[n] for n in sorted(log.steps) if n >= first]


def sampling_params(request: GenRequest, tokenizer: Any = None) -> Any:
    """The request's ``vllm.SamplingParams`` (`tokenizer`: the engine's, for a request that offered tools)."""
    from vllm import SamplingParams

    try:
        return SamplingParams(**sampling_kwargs(request, tokenizer))
    except (TypeError, ValueError) as exc:
        raise NotReplayableError(f"vLLM rejects the recorded sampling contract: {exc}") from exc


class StepDriver:
    """An in-process engine with the recorder on: requests arrive before given (relative) step numbers."""

    def __init__(
        self, model_dir: Path, log_dir: Path | None, num_threads: int | None = None, **engine_kwargs: Any
    ) -> None:
        """``num_threads``: torch's thread count for the engine, set on the calling thread before it starts (the
        engine steps there); None keeps the thread's count, which an earlier lane in the process may have set."""
        if num_threads is not None:
            with quiet_imports():
                import torch
            set_torch_threads(torch, num_threads)
        self.engine, self.recorder = start_recording_engine(model_dir, log_dir, **engine_kwargs)
        self._n = 0
        self._steps = 0  # engine steps that scheduled something (the recorder's count, kept without one too)

    @property
    def step_count(self) -> int:
        return int(self.recorder.step) if self.recorder is not None else self._steps

    def run(self, arrivals: Sequence[tuple[int, GenRequest]]) -> list[tuple[str, ReplayedOutput]]:
        """Each request added before the ``step``-th step of this run (arrivals in order); ``(engine request id,
        output)`` per request, in the order given."""
        from vllm.inputs import TokensPrompt

        first = self.step_count
        order = sorted(range(len(arrivals)), key=lambda i: arrivals[i][0])
        ids: dict[int, str] = {}
        external: dict[str, str] = {}
        done: dict[str, Any] = {}
        while len(done) < len(arrivals):
            rel = self.step_count - first
            for i in [i for i in order if i not in ids and arrivals[i][0] <= rel]:
                req = arrivals[i][1]
                name = f"prod-{self._n}"
                ids[i] = self.engine.add_request(
                    name,
                    TokensPrompt(prompt_token_ids=list(req.prompt_token_ids)),
                    sampling_params(req, self.engine.get_tokenizer()),
                )
                external[name] = ids[i]
                self._n += 1
            if not self.engine.has_unfinished_requests():
                if len(ids) == len(arrivals):
                    break
                first -= min(a for i, (a, _) in enumerate(arrivals) if i not in ids) - rel
                continue
            outs = self.engine.step()
            self._steps += 1
            for out in outs:
                if out.finished:
                    done[external.get(out.request_id, out.request_id)] = out.outputs[0]
        return [(ids[i], output_from_vllm(done[ids[i]])) for i in range(len(arrivals))]

    def log(self) -> ScheduleLog:
        if self.recorder is None:
            raise LaneUnavailableError("this engine runs without the recorder")
        return read_log(self.recorder)

    def close(self) -> None:
        release_engine(self.engine)
        if self.recorder is not None:
            self.recorder.writer.close()
