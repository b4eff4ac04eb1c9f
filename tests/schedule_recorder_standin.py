"""A minimal stand-in for reprolane's recording scheduler, for the pipeline's tests only (issue 22).

The real recorder (`capture.schedule.recorder.RecordingScheduler`) is written elsewhere; the pipeline's tests need
a vLLM that names its engine requests and writes segments in the on-disk contract (`schemas.schedule_delivery`),
so that the join (sidecar's ``X-Request-Id`` → vLLM's external id → the arrival) is checked against the real
server. This one records arrivals (external id: the engine request id without vLLM's ``-<8 hex>`` suffix, the
engine-side request keeps no other) and the shapes vLLM scheduled, and closes a segment after every step. It is
not the recorder: no settings beyond the few the schema requires, no chunk accounting, no preemptions.

Loaded by vLLM's engine process through ``--scheduler-cls tests.schedule_recorder_standin.RecordingScheduler``
(so it imports vLLM at module level; nothing else imports it).
"""

from __future__ import annotations

import os
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vllm.v1.core.sched.scheduler import Scheduler

from schemas.canonical import canonical_bytes
from schemas.schedule import EngineStart, RequestArrival, ScheduledRequest, ScheduleRecord, ScheduleStep
from schemas.schedule_delivery import segment_file_name


class RecordingScheduler(Scheduler):  # type: ignore[misc]
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._engine_id = f"standin-{uuid.uuid4().hex[:12]}"
        self._dir = Path(os.environ["REPROLANE_SCHEDULE_DIR"]) / self._engine_id
        self._dir.mkdir(parents=True, exist_ok=True)
        self._seq = 0
        self._step = 0
        config = self.scheduler_config
        self._pending: list[ScheduleRecord] = [
            EngineStart(
                engine_id=self._engine_id, started_at=datetime.now(UTC), vllm_version="0.32.0", model="standin",
                dtype="bfloat16", max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=self.max_model_len,
                block_size=self.block_size, enable_chunked_prefill=bool(config.enable_chunked_prefill),
                enable_prefix_caching=bool(self.cache_config.enable_prefix_caching), scheduling_policy="fcfs",
            )
        ]  # fmt: skip
        self._finished: list[str] = []

    def add_request(self, request: Any) -> None:
        super().add_request(request)
        rid = request.request_id
        self._pending.append(
            RequestArrival(
                engine_id=self._engine_id, step=self._step, engine_request_id=rid,
                external_request_id=rid.rsplit("-", 1)[0], num_prompt_tokens=request.num_prompt_tokens,
            )
        )  # fmt: skip

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids or ())
        self._finished.extend(ids)
        return super().finish_requests(request_ids, finished_status)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        if out.num_scheduled_tokens:
            finished = sorted(set(self._finished) | set(out.finished_req_ids))
            self._finished = []
            self._pending.append(
                ScheduleStep(
                    engine_id=self._engine_id, step=self._step, at=datetime.now(UTC),
                    scheduled=tuple(
                        ScheduledRequest(engine_request_id=rid, num_computed_tokens=0, num_scheduled_tokens=n)
                        for rid, n in out.num_scheduled_tokens.items()
                    ),
                    finished=tuple(finished),
                )
            )  # fmt: skip
            self._step += 1
            self._close()
        return out

    def _close(self) -> None:
        final = self._dir / segment_file_name(self._seq)
        part = final.with_name(final.name + ".part")
        with part.open("wb") as fh:
            fh.write(b"".join(canonical_bytes(r) + b"\n" for r in self._pending))
            fh.flush()
            os.fsync(fh.fileno())
        part.rename(final)
        self._pending = []
        self._seq += 1
