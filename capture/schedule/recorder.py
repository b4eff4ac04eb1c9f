"""`RecordingScheduler`: vLLM's own scheduler, recording the shapes of every step it schedules.

Loaded by vLLM through its scheduler-class option::

    REPROLANE_SCHEDULE_DIR=/var/lib/reprolane/schedule \\
    python -m vllm.entrypoints.openai.api_server ... --scheduler-cls capture.schedule.recorder.RecordingScheduler

It changes no scheduling decision: each hook calls vLLM's method first and then only *reads* what it returned.
Per step that scheduled (or finished, or preempted) anything it queues a `schemas.schedule.ScheduleStep` once
the step's output is in: the scheduler's order of requests, each one's tokens computed before the step
(prefix-cache hits included) and scheduled in it, which requests were preempted to make room for it, and which
finished in it (its output stopped them, or they were aborted since the previous step). vLLM itself reports a
finished request only at the *next* schedule, which never comes when the engine then idles; recording at the
output keeps the last step of every burst complete. A request's
`schemas.schedule.RequestArrival` is written just before the first step that schedules it (or that reports it
finished unscheduled), because only then is its prefix-cache hit known: ``cached_from`` names, per hit block, the
engine request that computed that block. That comes from a block-id -> request map kept from the scheduler's own
allocations (every block a request is given and did not read from the cache, it computes); hashes and content
are never looked at. One `schemas.schedule.EngineStart` opens the log, with a new engine id per start.

Step numbers count the recorded steps from 0, so a missing number in the log is a dropped step. Nothing here may
break serving: a failure in a hook is counted and logged, the scheduler's result is returned regardless; without
``REPROLANE_SCHEDULE_DIR`` the class is vLLM's scheduler and records nothing. ``RecordingAsyncScheduler`` is the
same for vLLM's async scheduler (engines that schedule one step ahead, on GPUs).

This is the one module of ``capture`` that imports vLLM, at module level (it subclasses vLLM's scheduler); only
vLLM's process imports it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from capture.schedule.segments import DEFAULT_ROTATE_BYTES, DEFAULT_ROTATE_SECONDS, SegmentWriter
from schemas.fingerprint import RuntimeFingerprint, cpu_model_name_of
from schemas.schedule import UNKNOWN_PROVIDER, EngineStart
from schemas.schedule_delivery import encode_record, external_request_id

logger = logging.getLogger(__name__)

ENV_DIR: Final = "REPROLANE_SCHEDULE_DIR"
ENV_SEGMENT_SECONDS: Final = "REPROLANE_SCHEDULE_SEGMENT_SECONDS"
#: `schemas.schedule.EngineRequestId`'s bound.
MAX_ID: Final = 256


def bounded_id(rid: str) -> str:
    """A request id as the log holds it: ids are client-chosen (``X-Request-Id``) and the contract bounds them, so
    an over-long one is cut and made unique again with a digest (the same id always maps to the same text)."""
    if len(rid) <= MAX_ID:
        return rid
    return rid[: MAX_ID - 17] + "#" + hashlib.sha256(rid.encode("utf-8", "replace")).hexdigest()[:16]


def _iso(ts: float) -> str:
    """A UTC time as pydantic's JSON mode writes it (so a step line is the record's canonical JSON)."""
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def _cpu_name() -> str | None:
    """The CPU's "model name" (`schemas.fingerprint.cpu_model_name_of`, the spelling the lanes' fingerprint uses)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            return cpu_model_name_of(fh) or None
    except OSError:
        return None


def engine_start(scheduler: Any, engine_id: str) -> EngineStart:
    """The schedule-shaping settings of the engine `scheduler` serves (``vllm.v1.core.sched.scheduler.Scheduler``)."""
    import torch
    import vllm

    cfg = scheduler.vllm_config
    model, sched, cache = cfg.model_config, cfg.scheduler_config, cfg.cache_config
    parallel = cfg.parallel_config
    dtype = str(model.dtype).removeprefix("torch.")
    on_gpu = bool(torch.cuda.is_available())
    capability = None
    if on_gpu:
        major, minor = torch.cuda.get_device_capability(0)
        capability = f"{major}.{minor}"
    runtime = RuntimeFingerprint(
        engine="vllm",
        engine_version=vllm.__version__,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda if on_gpu else None,
        device="cuda" if on_gpu else "cpu",
        device_name=torch.cuda.get_device_name(0) if on_gpu else _cpu_name(),
        compute_capability=capability,
        dtype=dtype,
        quantization=str(model.quantization or "none"),
        tensor_parallel_size=parallel.tensor_parallel_size,
        pipeline_parallel_size=parallel.pipeline_parallel_size,
        data_parallel_size=parallel.data_parallel_size,
        cuda_graphs=(not model.enforce_eager) if on_gpu else False,
        batch_invariant=False,
        max_num_seqs=sched.max_num_seqs,
        prefix_caching=bool(cache.enable_prefix_caching),
        num_threads=torch.get_num_threads(),
    )
    return EngineStart(
        engine_id=engine_id,
        started_at=datetime.now(UTC),
        vllm_version=vllm.__version__,
        model=str(model.model),
        dtype=dtype,
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_model_len=model.max_model_len,
        block_size=scheduler.block_size,
        num_kv_blocks=scheduler.kv_cache_config.num_blocks,
        enable_chunked_prefill=bool(sched.enable_chunked_prefill),
        enable_prefix_caching=bool(cache.enable_prefix_caching),
        scheduling_policy=str(sched.policy),
        seed=model.seed,
        long_prefill_token_threshold=sched.long_prefill_token_threshold or None,
        async_scheduling=bool(sched.async_scheduling),
        enforce_eager=bool(model.enforce_eager),
        runtime=runtime,
    )


class ScheduleRecorder:
    """The recording state of one engine: step counter, pending arrivals, block owners, the writer."""

    def __init__(self, scheduler: Any, directory: Path, rotate_seconds: float) -> None:
        self.engine_id = f"{datetime.now(UTC):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}"
        self.block_size: int = scheduler.block_size
        self.prefix_caching = bool(scheduler.cache_config.enable_prefix_caching)
        self.writer = SegmentWriter(directory, self.engine_id, rotate_seconds=rotate_seconds)
        self.step = 0
        self.errors = 0
        self._pending: dict[str, dict[str, Any]] = {}
        self._owner: dict[int, str] = {}
        self._open: dict[int, dict[str, Any]] = {}  # id(SchedulerOutput) -> its step, until its output is in
        self._reported: set[str] = set()  # finished ids recorded at their step, not yet echoed by vLLM
        self.writer.submit(encode_record(engine_start(scheduler, self.engine_id)))

    def on_add(self, request: Any) -> None:
        rid = str(request.request_id)
        self._pending[rid] = {
            "kind": "arrival",
            "engine_id": self.engine_id,
            "step": self.step,
            "engine_request_id": bounded_id(rid),
            "external_request_id": bounded_id(external_request_id(rid)),
            "num_prompt_tokens": int(request.num_prompt_tokens),
            "max_tokens": int(request.max_tokens),
        }
        if getattr(request, "use_structured_output", False):  # waits for its grammar: `RequestArrival`
            self._pending[rid]["structured_output"] = True

    def _arrived(self, rid: str, hit_blocks: list[int]) -> None:
        arrival = self._pending.pop(rid, None)
        if arrival is None:
            return
        if hit_blocks:
            runs: list[list[Any]] = []
            for block in hit_blocks:
                owner = self._owner.get(block, UNKNOWN_PROVIDER)
                if runs and runs[-1][0] == owner:
                    runs[-1][1] += 1
                else:
                    runs.append([owner, 1])
            arrival["cached_from"] = runs
        self.writer.submit(arrival)

    def _own(self, rid: str, blocks: list[int]) -> None:
        name = bounded_id(rid)
        for block in blocks:
            self._owner[block] = name

    def on_schedule(self, out: Any) -> None:
        bs = self.block_size
        computed: dict[str, int] = {}
        new_reqs = {new.req_id: new for new in out.scheduled_new_reqs}
        cached = out.scheduled_cached_reqs
        running = {
            rid: (int(num), blocks)
            for rid, num, blocks in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids, strict=True)
        }
        # in the scheduler's order: a request can hit blocks that one scheduled before it in the same step was
        # given (vLLM caches a block when it is allocated), so owners are assigned in that order
        for rid in out.num_scheduled_tokens:
            new = new_reqs.get(rid)
            if new is not None:
                computed[rid] = int(new.num_computed_tokens)
                blocks = list(new.block_ids[0]) if new.block_ids else []
                hit = computed[rid] // bs if self.prefix_caching else 0
                self._arrived(rid, blocks[:hit])
                self._own(rid, blocks[hit:])
            elif rid in running:
                num, new_blocks = running[rid]
                computed[rid] = num
                blocks = list(new_blocks[0]) if new_blocks else []
                skip = num // bs if rid in cached.resumed_req_ids and self.prefix_caching else 0
                self._own(rid, blocks[skip:])
        for rid in out.finished_req_ids:
            self._arrived(rid, [])
        # finished since the previous step's output: aborts in between (those its output stopped were recorded
        # with that step already, see on_update)
        earlier = {r for r in out.finished_req_ids if r not in self._reported}
        self._reported.difference_update(out.finished_req_ids)
        self._open[id(out)] = {
            "kind": "step",
            "engine_id": self.engine_id,
            "step": -1,
            "at": _iso(time.time()),
            "scheduled": [
                {"engine_request_id": bounded_id(rid), "num_computed_tokens": computed[rid], "num_scheduled_tokens": n}
                for rid, n in out.num_scheduled_tokens.items()
            ],
            "finished": earlier,
            "preempted": sorted(bounded_id(r) for r in out.preempted_req_ids or ()),
        }

    def on_update(self, out: Any, finished_now: set[str]) -> None:
        """After the step's output: requests it stopped (or aborted meanwhile) are finished *in* this step, so the
        last step of a burst says so even when the engine then idles (no next schedule to report it)."""
        record = self._open.pop(id(out), None)
        if record is None:
            return
        for rid in finished_now:
            self._arrived(rid, [])
        self._reported.update(finished_now)
        finished = record["finished"] | finished_now
        if not record["scheduled"] and not finished and not record["preempted"]:
            return
        record["finished"] = sorted(bounded_id(r) for r in finished)
        record["step"] = self.step
        self.writer.submit(record)
        self.step += 1

    def close(self) -> None:
        for rid in list(self._pending):
            self._arrived(rid, [])
        self.writer.close()


def _make_recorder(scheduler: Any) -> ScheduleRecorder | None:
    directory = os.environ.get(ENV_DIR)
    if not directory:
        logger.warning("%s is not set: the schedule recorder records nothing", ENV_DIR)
        return None
    try:
        seconds = float(os.environ.get(ENV_SEGMENT_SECONDS, DEFAULT_ROTATE_SECONDS))
        recorder = ScheduleRecorder(scheduler, Path(directory), seconds if seconds > 0 else DEFAULT_ROTATE_SECONDS)
    except Exception:
        logger.exception("the schedule recorder could not start; serving without it")
        return None
    logger.info(
        "recording the schedule of engine %s to %s (segments of %.1f s or %d bytes)",
        recorder.engine_id,
        recorder.writer.directory,
        recorder.writer.rotate_seconds,
        DEFAULT_ROTATE_BYTES,
    )
    return recorder


class _RecordingMixin:
    """The hooks, shared by the sync and async schedulers; each calls vLLM first, then records."""

    _recorder: ScheduleRecorder | None = None

    def _record(self, hook: str, *args: Any) -> None:
        recorder = self._recorder
        if recorder is None:
            return
        try:
            getattr(recorder, hook)(*args)
        except Exception:
            recorder.errors += 1
            if recorder.errors <= 10 or recorder.errors % 1000 == 0:
                logger.exception("schedule recorder: %s failed (%d errors); serving on", hook, recorder.errors)

    def add_request(self, request: Any) -> None:
        new = request.request_id not in self.requests  # type: ignore[attr-defined]
        super().add_request(request)  # type: ignore[misc]
        if new:
            self._record("on_add", request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)  # type: ignore[misc]
        self._record("on_schedule", out)
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        result = super().update_from_output(scheduler_output, model_runner_output)  # type: ignore[misc]
        if self._recorder is not None:
            self._record("on_update", scheduler_output, set(self.finished_req_ids))  # type: ignore[attr-defined]
        return result

    def shutdown(self) -> None:
        try:
            super().shutdown()  # type: ignore[misc]
        finally:
            self._record("close")

    @property
    def schedule_recorder(self) -> ScheduleRecorder | None:
        return self._recorder


class RecordingScheduler(_RecordingMixin, Scheduler):
    """vLLM's scheduler, recording its schedule to ``$REPROLANE_SCHEDULE_DIR`` (nothing when it is unset)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = _make_recorder(self)


class RecordingAsyncScheduler(_RecordingMixin, AsyncScheduler):
    """vLLM's async scheduler, recording like `RecordingScheduler`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._recorder = _make_recorder(self)
