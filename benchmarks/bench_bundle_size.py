"""The size of an evidence bundle per request, plain and re-executable (issue 33), member by member.

    REPROLANE_RUN_DIR=DIR .venv/bin/python benchmarks/bench_bundle_size.py [-n 6] [--max-tokens 24]

Against a running local stack whose vLLM records its schedule (``reprolane stack up``): sends `n` chat requests
at once through the real sidecar (`tests.replayer.schedule.scheduled_stack`), publishes their envelopes with the
Merkle log into a bucket of its own, ships their schedule there (each segment logged in the engine's schedule
log), signs the day's log and the schedule log (``reprolane audit checkpoint``),
then exports each request twice with the real command, ``reprolane audit evidence export`` without and with
``--reexecutable``, and prints the bundle sizes (median, max) and the median size of each member. The
re-executable members grow with the busy period the request ran in (every step of it), not with its output.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from infra import paths
from infra.stack.state import StackInfo
from schemas import Envelope
from tests.capture.audit.evidence.test_export_stack import publish_settings
from tests.capture.audit.support import new_key, publish_through_s3
from tests.infra.reexecution.support import checkpoint, evidence_bucket, operator_env, reprolane
from tests.replayer.schedule.scheduled_stack import (
    chat,
    ship_schedules,
    stack_replayer_settings,
    stack_sidecar,
)
from tests.replayer.schedule.test_replay_stack import _send, _spooled

QUESTIONS = [
    "Name three rivers in Europe.", "What is a prime number?", "Describe the colour of the sea.",
    "Why do leaves fall in autumn?", "What does a lighthouse keeper do?", "How many legs has a spider?",
]  # fmt: skip


async def _capture(stack: StackInfo, n: int, max_tokens: int, work: Path, bucket: str) -> list[Envelope]:
    app, spool = stack_sidecar(stack)
    prompts = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" ({i})") for i in range(n)]
    ids = await _send(app, [chat(p, max_tokens) for p in prompts], 0.0)
    envelopes = await _spooled(spool, ids)
    await publish_through_s3(publish_settings(stack, work / "spool", bucket), envelopes, work / "spool")
    settings = stack_replayer_settings(stack).model_copy(update={"s3_bucket": bucket})
    await ship_schedules(stack, settings, envelopes, work / "ship")
    return envelopes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", type=int, default=6, help="requests, sent at once")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args()
    os.environ.setdefault("REPROLANE_CAPTURE_AUTH_MODE", "off")  # the publisher's settings; no caller is served
    stack = StackInfo.load(paths.run_dir(None))
    bucket = evidence_bucket(stack)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        envelopes = asyncio.run(_capture(stack, args.n, args.max_tokens, work, bucket))
        ids = [e.request_id for e in envelopes]
        private, _ = new_key()
        env = {**operator_env(stack, private, bucket), "REPROLANE_RUN_DIR": str(stack.run_dir)}
        checkpoint(envelopes[0].captured_at, env)
        sizes: dict[str, list[int]] = {"plain": [], "re-executable": []}
        members: dict[str, list[int]] = {}
        for rid in ids:
            for kind, extra in (("plain", []), ("re-executable", ["--reexecutable"])):
                path = work / f"{rid}-{kind}.zip"
                done = reprolane("audit", "evidence", "export", rid, "-o", str(path), *extra, env=env)
                assert done.returncode == 0, done.stdout + done.stderr
                sizes[kind].append(path.stat().st_size)
                if extra:
                    with zipfile.ZipFile(path) as zf:
                        for info in zf.infolist():
                            members.setdefault(info.filename.split("/")[0], []).append(info.compress_size)
    print(f"{args.n} requests sent at once, {args.max_tokens} tokens each; bundle bytes per request (zip):")
    for kind, values in sizes.items():
        print(f"  {kind:14s} median {statistics.median(values):9,.0f}   max {max(values):9,}")
    print("re-executable bundle, median compressed bytes per member:")
    for name, values in sorted(members.items(), key=lambda kv: -statistics.median(kv[1])):
        print(f"  {name:22s} {statistics.median(values):9,.0f}")
    print(f"machine: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
