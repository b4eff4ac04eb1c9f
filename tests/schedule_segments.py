"""Schedule-log segments written the way the recorder writes them (`schemas.schedule_delivery`), for the tests of
the shipper and the reader until (and besides) the real recorder: records from the schema, canonical lines, the
``.part`` then rename protocol."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from schemas.canonical import canonical_bytes
from schemas.schedule import EngineStart, RequestArrival, ScheduledRequest, ScheduleRecord, ScheduleStep
from schemas.schedule_delivery import segment_file_name

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def engine_start(engine_id: str) -> EngineStart:
    return EngineStart(
        engine_id=engine_id,
        started_at=T0,
        vllm_version="0.32.0",
        model="SmolLM2-135M-Instruct",
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        block_size=16,
        num_kv_blocks=1000,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        scheduling_policy="fcfs",
        seed=0,
    )


def encode(records: Iterable[ScheduleRecord]) -> bytes:
    return b"".join(canonical_bytes(r) + b"\n" for r in records)


@dataclass
class FakeEngine:
    """An engine's schedule log as the recorder would write it: requests arrive, run for some steps, finish.

    `request` adds a request (its engine id is ``<external>-<8 hex>``, like vLLM's); `run` schedules every running
    request one token per step (the first step its whole prompt) until each has its output length."""

    engine_id: str
    records: list[ScheduleRecord] = field(default_factory=list)
    step_no: int = 0
    running: dict[str, list[int]] = field(default_factory=dict)  # engine request id -> [computed, prompt, left]

    def __post_init__(self) -> None:
        self.records.append(engine_start(self.engine_id))

    def request(
        self,
        external_id: str,
        prompt_tokens: int = 8,
        output_tokens: int = 3,
        cached_from: tuple[tuple[str, int], ...] | None = None,
    ) -> str:
        """``cached_from``: (engine request id, blocks) whose prefix-cache blocks this request reads."""
        engine_rid = f"{external_id}-{os.urandom(4).hex()}"
        self.records.append(
            RequestArrival(
                engine_id=self.engine_id,
                step=self.step_no,
                engine_request_id=engine_rid,
                external_request_id=external_id,
                num_prompt_tokens=prompt_tokens,
                max_tokens=output_tokens,
                cached_from=cached_from,
            )
        )
        self.running[engine_rid] = [0, prompt_tokens, output_tokens]
        return engine_rid

    def step(self) -> None:
        scheduled, finished = [], []
        for rid, state in self.running.items():
            computed, prompt, _ = state
            n = prompt if computed == 0 else 1
            scheduled.append(
                ScheduledRequest(engine_request_id=rid, num_computed_tokens=computed, num_scheduled_tokens=n)
            )
            state[0] += n
            state[2] -= 1
            if state[2] <= 0:
                finished.append(rid)
        if scheduled:
            self.records.append(
                ScheduleStep(
                    engine_id=self.engine_id,
                    step=self.step_no,
                    at=T0 + timedelta(milliseconds=10 * self.step_no),
                    scheduled=tuple(scheduled),
                    finished=tuple(finished),
                )
            )
        for rid in finished:
            del self.running[rid]
        self.step_no += 1

    def run(self) -> None:
        while self.running:
            self.step()

    def take(self) -> list[ScheduleRecord]:
        """The records written since the last take (one segment's worth)."""
        out, self.records = self.records, []
        return out


def write_segment(directory: Path, engine_id: str, seq: int, data: bytes | Sequence[ScheduleRecord]) -> Path:
    """A closed segment as the recorder leaves it: written to ``.part``, fsynced, renamed to ``.jsonl``."""
    engine_dir = directory / engine_id
    engine_dir.mkdir(parents=True, exist_ok=True)
    body = data if isinstance(data, bytes) else encode(data)
    final = engine_dir / segment_file_name(seq)
    part = final.with_name(final.name + ".part")
    with part.open("wb") as fh:
        fh.write(body)
        fh.flush()
        os.fsync(fh.fileno())
    part.rename(final)
    return final
