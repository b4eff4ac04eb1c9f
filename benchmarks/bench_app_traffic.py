"""Real application traffic through the sidecar, every request replayed on its schedule: per category, how many were
captured, replayed, bitwise against what the client received, and refused (with the reason).

    REPROLANE_RUN_DIR=DIR .venv/bin/python benchmarks/bench_app_traffic.py [--rounds 2] [--gap 0.3]

Against a running local stack whose vLLM records its schedule and serves tool calls (``reprolane stack up``): the
categories regulated workflows and agent teams send (extraction into a JSON schema, classification by choice, a
regex-bound field, tool-calling agent steps with ``required``, a named tool and ``auto``, RAG prompts of 1-3k
tokens behind one long shared system prompt (prefix cache, chunked prefill), seeded sampling with ``n = 2``, plain
chat) go through the real sidecar app in rounds: each round sends every request of every category at once, the
next round staggered by ``--gap`` seconds. The schedule is shipped with the real shipper (a copy of the stack's
segments, `tests.replayer.schedule.scheduled_stack`), each envelope's window is read back through the index as the
service reads it, and each is replayed on the schedule lane by the service's own path
(`replayer.schedule.replay.ScheduleReplayer`, in process): with ``--unit busy_period`` (the default, issue 32) a
busy period is replayed once for every captured request of it, with ``--unit request`` once per request with
fillers for the rest. The reference is what the client received: choice 0's ``token_ids`` and per-token logprobs;
the other choice of an ``n = 2`` request is checked by the event against its recorded choice. Prints the table
BENCHMARKS.md keeps, and the lane runs it took. LoRA adapters are not in it (their stack test is).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx

from infra import paths
from infra.stack.launcher import LocalStack
from infra.stack.state import StackInfo
from replayer.schedule.lane import ScheduleLane
from replayer.schedule.replay import Companions, ScheduleReplayer
from replayer.schedule.store import ScheduleStore
from replayer.settings import ReplayerSettings
from schemas import ReplayResult
from schemas.schedule import EngineStart
from tests.capture.fake_upstream import serve
from tests.replayer.schedule.scheduled_stack import ship_schedules, stack_replayer_settings, stack_sidecar
from tests.replayer.schedule.test_traffic_stack import CLAIM, CLAIM_SCHEMA, POLICY, WEATHER

MODEL = "smollm2-135m-instruct"
POLICY_TEXT = " ".join(
    f"Section {i}: claims for damage of kind {i} are paid up to {1000 * i} euros after the excess; the holder reports "
    f"within {i + 7} days, keeps receipts, and the assessor decides within {2 * i + 5} working days."
    for i in range(1, 40)
)  # a long shared system prompt (about 1.5k tokens): the prefix cache serves it after the first request


def _body(content: str, max_tokens: int, *, system: str | None = None, **fields: Any) -> dict[str, Any]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    return {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
        "return_token_ids": True,
        **fields,
    }


def categories() -> dict[str, list[dict[str, Any]]]:
    """Every category's requests (one round)."""
    schema = {"type": "json_schema", "json_schema": {"name": "claim", "schema": CLAIM_SCHEMA}}
    claims = [CLAIM, "Claim from Jon Berg: a fire in the garage, 900 euros of tools lost.", "Claim: hail, 300 euros."]
    return {
        "extraction (json_schema)": [
            _body(f"Extract the claim as JSON. {c}", 40, response_format=schema) for c in claims
        ],
        "classification (choice)": [
            _body(
                f"Classify: approve, review or deny. {c}",
                4,
                structured_outputs={"choice": ["approve", "review", "deny"]},
            )
            for c in claims
        ],
        "field (regex)": [_body("Give a policy number.", 12, structured_outputs={"regex": "POL-[0-9]{6}"})] * 2,
        "agent step (tools)": [
            _body("What is the weather in Lisbon?", 64, tools=[WEATHER, POLICY], tool_choice="required"),
            _body(
                "Look up policy 123456.",
                32,
                tools=[WEATHER, POLICY],
                tool_choice={"type": "function", "function": {"name": "lookup_policy"}},
            ),
            _body("What is the weather in Oslo?", 24, tools=[WEATHER], tool_choice="auto"),
        ],
        "RAG (shared 1.5k-token prefix)": [
            _body(f"Question {q}: how long does the assessor take for kind {q}?", 24, system=POLICY_TEXT)
            for q in (3, 17, 31)
        ],
        "seeded sampling, n=2": [
            _body("Name a colour and a fruit.", 12, temperature=0.8, seed=7, n=2),
            _body("Name a river.", 12, temperature=0.8, seed=8, n=2),
        ],
        "plain chat": [_body("Name three rivers.", 16), _body("What is two plus two?", 8)],
    }


async def _send(app: Any, bodies: list[dict[str, Any]], gap_s: float) -> list[httpx.Response]:
    async with serve(app) as url, httpx.AsyncClient(base_url=url, timeout=900.0) as client:

        async def one(i: int, body: dict[str, Any]) -> httpx.Response:
            await asyncio.sleep(i * gap_s)
            return await client.post("/v1/chat/completions", json=body)

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


def _reference(reply: httpx.Response) -> list[tuple[list[int], list[float]]]:
    """Per choice, the token ids and chosen-token logprobs the client received."""
    return [
        (c["token_ids"], [item["logprob"] for item in (c.get("logprobs") or {}).get("content") or ()])
        for c in sorted(reply.json()["choices"], key=lambda c: c["index"])
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2, help="rounds sent (the first at once, then staggered)")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between requests of a staggered round")
    parser.add_argument(
        "--unit", choices=("busy_period", "request"), default="busy_period",
        help="busy_period: each busy period replayed once for all its captured requests; request: one replay each",
    )  # fmt: skip
    args = parser.parse_args()
    stack: StackInfo = LocalStack(paths.run_dir()).info()  # the running stack (started elsewhere)
    app, spool = stack_sidecar(stack)
    cats = categories()
    sent: list[tuple[str, httpx.Response]] = []
    started = time.monotonic()
    for round_no in range(args.rounds):
        order = [(name, body) for name, bodies in cats.items() for body in bodies]
        replies = asyncio.run(_send(app, [b for _, b in order], 0.0 if round_no == 0 else args.gap))
        sent += [(name, reply) for (name, _), reply in zip(order, replies, strict=True)]
    traffic_s = time.monotonic() - started
    captured = {r.headers.get("x-reprolane-request-id"): (n, r) for n, r in sent if r.status_code == 200}
    deadline = time.monotonic() + 60
    while len({e.request_id for e in spool.envelopes} & set(captured)) < len(captured) and time.monotonic() < deadline:
        time.sleep(0.2)
    envelopes = {e.request_id: e for e in spool.envelopes if e.request_id in captured}
    store_settings = stack_replayer_settings(stack)
    asyncio.run(ship_schedules(stack, store_settings, list(envelopes.values()), Path(tempfile.mkdtemp())))
    store = ScheduleStore.from_settings(store_settings)
    lanes: list[ScheduleLane] = []
    runs: list[int] = []  # per run of the lane: how many requests it replayed with their real content

    def make_lane(settings: ReplayerSettings, engine: EngineStart) -> ScheduleLane:
        lane = ScheduleLane(settings, engine)
        replay_requests = lane.replay_requests

        def counted(log: Any, requests: Any) -> Any:
            runs.append(len(requests))
            return replay_requests(log, requests)

        lane.replay_requests = counted  # type: ignore[method-assign]
        lanes.append(lane)
        return lane

    replayer = ScheduleReplayer(ReplayerSettings(), store, make_lane)
    results: dict[str, ReplayResult] = {}
    companions = Companions(envelopes.get, lambda e, r: results.__setitem__(e.request_id, r))
    rows: dict[str, Counter[str]] = defaultdict(Counter)
    refusals: dict[str, set[str]] = defaultdict(set)
    unreproduced: set[str] = set()
    started = time.monotonic()
    for name, reply in sent:
        rows[name]["sent"] += 1
        rid = reply.headers.get("x-reprolane-request-id")
        if rid not in envelopes:
            refusals[name].add(f"HTTP {reply.status_code}: {reply.text[:120]}")
            continue
        rows[name]["captured"] += 1
        envelope = envelopes[rid]
        if rid not in results:
            t = time.monotonic()
            answer = replayer.replay(
                envelope,
                stored=lambda env, fp: results.get(env.request_id),
                companions=companions if args.unit == "busy_period" else None,
            )
            if isinstance(answer, str):
                rows[name]["refused"] += 1
                refusals[name].add(answer[:160])
                continue
            results[rid] = answer
            print(f"replayed {rid} ({name}) in {time.monotonic() - t:.1f} s; {len(results)} results, "
                  f"{len(runs)} lane runs", file=sys.stderr, flush=True)  # fmt: skip
        result = results[rid]
        rows[name]["replayed"] += 1
        reference = _reference(reply)
        event = result.event
        ids, lps = reference[0]
        same = list(result.replayed.token_ids) == ids and [s.logprob for s in result.replayed.logprobs or ()] == lps
        if len(reference) > 1:  # the other choices: the event's check of each against its recorded choice
            same = same and event.choices is not None and all(c.verdict == "bitwise" for c in event.choices)
        rows[name]["bitwise"] += int(same and event.verdict == "bitwise" and event.target_met)
        rows[name]["schedule reproduced"] += int(bool(event.schedule_reproduced))
        if not event.schedule_reproduced:
            unreproduced.add(event.cause_detail.split("schedule lane: ", 1)[-1][:300])
    replay_s = time.monotonic() - started
    replayer.close()
    cols = ("sent", "captured", "replayed", "bitwise", "schedule reproduced", "refused")
    print(f"{'category':<32}" + "".join(f"{c:>21}" for c in cols))
    for name in cats:
        print(f"{name:<32}" + "".join(f"{rows[name][c]:>21}" for c in cols))
    total = Counter[str]()
    for counts in rows.values():
        total.update(counts)
    print(f"{'all':<32}" + "".join(f"{total[c]:>21}" for c in cols))
    for name, reasons in refusals.items():
        for reason in sorted(reasons):
            print(f"  refused, {name}: {reason}")
    for why in sorted(unreproduced):
        print(f"  schedule not reproduced: {why}")
    how = f"{args.rounds} rounds, the first at once, then {args.gap} s apart"
    print(f"traffic {traffic_s:.1f} s ({how}); replays {replay_s:.1f} s in {len(runs)} lane runs "
          f"(replay unit: {args.unit}; requests per run: {sorted(runs, reverse=True)})")  # fmt: skip
    return 0 if total["bitwise"] == total["sent"] else 1


if __name__ == "__main__":
    sys.exit(main())
