"""Envelopes that name their engine schedule, recorded on the session stack, their schedule shipped to its S3.

The stack's vLLM records its schedule (`capture.schedule.recorder`, started by the stack's launcher); the real
sidecar app (`capture.request.app.build_app`, a fake spool) sends the requests to it, so each envelope names its engine
request; the envelopes and their indexes are written to the stack's S3 as the capture side lays them out; the
real shipper (`capture.schedule.shipper.Shipper`) ships the closed segments, with their per-arrival index entries,
to the same S3. It ships a *copy* of the segments (the shipper deletes what it shipped): the stack's own directory
is left as it is for whoever else ships it (a segment shipped twice holds the same bytes: a redelivery).

`replay_by_period` replays such envelopes as the service does with ``replay_unit = "busy_period"``: one lane run per
busy period, every captured request of it with its real content.

Used by the schedule-replay stack tests and benchmarks/replay_latency.py.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from capture.metrics import CaptureMetrics
from capture.request.app import build_app
from capture.schedule.shipper import Shipper
from capture.schedule.shipper_settings import ShipperSettings
from capture.settings import CaptureSettings
from infra.stack import servers
from infra.stack.buckets import s3_client
from infra.stack.env import stack_defaults
from infra.stack.state import StackInfo
from replayer.errors import ScheduleNotFoundError
from replayer.schedule.lane import ScheduleLane, ScheduleReplay
from replayer.schedule.replay import period_members, replay_on_schedule, replay_period_on_schedule
from replayer.schedule.store import ScheduleStore, ScheduleWindow
from replayer.schedule.window import read_window
from replayer.settings import ReplayerSettings
from schemas import Envelope, ReplayResult
from schemas.layout import schedule_engine_prefix
from schemas.schedule_delivery import parse_segment_file_name
from tests.capture.fake_spool import FakeSpool
from tests.capture.fake_upstream import serve
from tests.replayer.support import S3Target, seed_envelope


def schedule_dir(stack: StackInfo) -> Path:
    """Where the stack's vLLM writes its schedule; an `AssertionError` when it records none."""
    directory = stack_defaults(stack).get("REPROLANE_SHIPPER_SCHEDULE_DIR")
    assert directory is not None, f"the stack's vLLM ({stack.run_dir}) records no schedule: start it with the recorder"
    return Path(directory)


def _stored(client: Any, bucket: str, engine: str) -> dict[str, str]:
    """Segment file name -> object key, of every segment of `engine` stored in `bucket`."""
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=schedule_engine_prefix(engine))
    keys = (o["Key"] for page in pages for o in page.get("Contents", ()))
    return {k.rsplit("/", 1)[-1]: k for k in keys if parse_segment_file_name(k.rsplit("/", 1)[-1]) is not None}


def _to_ship(stack: StackInfo, bucket: str, source: Path, copies: Path) -> set[Path]:
    """What need not be copied from `source`: the segments `bucket` holds already (not shipped again: each shipper
    run would log every one again), after copying into `copies` those the stack's audit bucket holds and `source`
    no longer does (a shipper deletes what it shipped: the demo's, a soak's; an engine's first segment holds its
    engine record), so that they are shipped into `bucket` too; as source paths."""
    client = s3_client(stack.s3_endpoint, stack.s3_credentials)
    skip: set[Path] = set()
    for engine in (p.name for p in source.iterdir() if p.is_dir()):
        there = _stored(client, bucket, engine)
        skip |= {source / engine / name for name in there}
        if bucket == stack.audit_bucket:
            continue
        for name, key in _stored(client, stack.audit_bucket, engine).items():
            if name not in there and not (source / engine / name).exists():
                (copies / engine).mkdir(exist_ok=True)
                (copies / engine / name).write_bytes(
                    client.get_object(Bucket=stack.audit_bucket, Key=key)["Body"].read()
                )
                skip.add(source / engine / name)
    return skip


def stack_sidecar(stack: StackInfo) -> tuple[Any, FakeSpool]:
    """The real sidecar app in front of the running stack's recording vLLM (auth off, the stack's runtime and
    manifest), with its spool: what the benchmarks drive traffic through."""
    assert stack.vllm_url is not None
    env = stack_defaults(stack)
    settings = CaptureSettings(
        upstream=stack.vllm_url, spool_max_bytes=1 << 24, schedule_recorder=servers.RECORDER_NAME, auth_mode="off",
        runtime_path=env["REPROLANE_CAPTURE_RUNTIME_PATH"], manifest_path=env["REPROLANE_CAPTURE_MANIFEST_PATH"],
    )  # fmt: skip
    spool = FakeSpool()
    return build_app(settings, spool=spool, metrics=CaptureMetrics()), spool


def stack_replayer_settings(stack: StackInfo) -> ReplayerSettings:
    """The replayer's settings for the running stack (its S3, Kafka), as `reprolane` reads them from the
    environment the stack's launcher prints."""
    prefix = "REPROLANE_REPLAYER_"
    fields: dict[str, Any] = {
        k.removeprefix(prefix).lower(): v for k, v in stack_defaults(stack).items() if k.startswith(prefix)
    }
    return ReplayerSettings(**fields)


def chat(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
    }


async def record_scheduled(
    stack: StackInfo, s3: S3Target, bodies: list[dict[str, Any]], headers: list[dict[str, str]] | None = None
) -> list[Envelope]:
    """POST every chat body at once through the real sidecar to the stack's recording vLLM (`headers[i]` with
    body i), store the envelopes in `s3` as the capture side does; the envelopes, in the bodies' order."""
    assert stack.vllm_url is not None
    schedule_dir(stack)
    settings = CaptureSettings(
        upstream=stack.vllm_url, spool_max_bytes=1 << 22, schedule_recorder=servers.RECORDER_NAME, auth_mode="off"
    )
    spool = FakeSpool()
    app = build_app(settings, spool=spool, metrics=CaptureMetrics())
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=600.0) as client:
        replies = await asyncio.gather(
            *(client.post("/v1/chat/completions", json=b, headers=(headers or [{}] * len(bodies))[i])
              for i, b in enumerate(bodies))
        )  # fmt: skip
    assert [r.status_code for r in replies] == [200] * len(bodies), [r.text for r in replies]
    ids = [r.headers["x-reprolane-request-id"] for r in replies]
    deadline = time.monotonic() + 60
    while len(found := {e.request_id: e for e in spool.envelopes if e.request_id in ids}) < len(ids):
        assert time.monotonic() < deadline, f"{len(found)} of {len(ids)} envelopes spooled"
        await asyncio.sleep(0.2)
    envelopes = [found[i] for i in ids]
    client_s3 = s3.client()
    for envelope in envelopes:
        assert envelope.schedule is not None, "the sidecar did not name the envelope's schedule"
        seed_envelope(client_s3, s3.bucket, envelope)
    return envelopes


async def ship_schedules(stack: StackInfo, settings: ReplayerSettings, envelopes: list[Envelope], work: Path) -> None:
    """Ship copies of the stack's closed segments (into the bucket `settings` read) until every envelope's
    schedule window is complete in S3, read back through the index as the replayer reads it."""
    source = schedule_dir(stack)
    copies, quarantine = work / "schedules", work / "quarantine"
    copied: set[Path] = set()
    defaults = {
        k.removeprefix("REPROLANE_SHIPPER_").lower(): v
        for k, v in stack_defaults(stack).items()
        if k.startswith("REPROLANE_SHIPPER_")
    }
    defaults.update(schedule_dir=str(copies), quarantine_dir=str(quarantine), retention_days=0,
                    s3_bucket=settings.s3_bucket)  # fmt: skip
    copies.mkdir(parents=True, exist_ok=True)
    copied |= _to_ship(stack, settings.s3_bucket, source, copies)
    shipper = Shipper(ShipperSettings(**defaults))
    store = ScheduleStore.from_settings(settings)
    try:
        deadline = time.monotonic() + 90
        while True:
            for segment in sorted(source.glob("*/*.jsonl")):  # closed segments only (a .part is being written)
                if segment not in copied:
                    (copies / segment.parent.name).mkdir(exist_ok=True)
                    shutil.copy2(segment, copies / segment.parent.name / segment.name)
                    copied.add(segment)
            await shipper.ship_pending()
            try:
                if all(read_window(store, e).complete for e in envelopes):
                    break
            except ScheduleNotFoundError:
                pass
            assert time.monotonic() < deadline, "the envelopes' schedules were not shipped in 90 s"
            await asyncio.sleep(0.5)
    finally:
        await shipper.close()
    assert shipper.quarantined == 0


def replay_by_period(
    envelopes: list[Envelope],
    windows: list[ScheduleWindow],
    lane: ScheduleLane,
    settings: ReplayerSettings,
    *,
    alone: int = 1,
) -> dict[str, tuple[ReplayResult, ScheduleReplay]]:
    """Every envelope replayed on its schedule, by request id: the first ``alone`` each on its own with fillers for
    every companion (``replay_unit = "request"``), the rest once per busy period with the real content of its
    captured requests (``"busy_period"``). A request its period's run could not replay gets a run of its own."""
    by_id = {e.request_id: e for e in envelopes}
    results: dict[str, tuple[ReplayResult, ScheduleReplay]] = {}
    for i, (envelope, window) in enumerate(zip(envelopes, windows, strict=True)):
        if envelope.request_id in results:
            continue
        if i < alone:
            results[envelope.request_id] = replay_on_schedule(envelope, window, lane, settings)
            continue
        members = {
            rid: (by_id[rid], arrivals)
            for rid, arrivals in period_members(window).items()
            if rid in by_id and rid not in results
        }
        period, replay = replay_period_on_schedule(envelope, window, lane, settings, members)
        results.update({rid: (result, replay) for rid, result in period.items()})
    return results
