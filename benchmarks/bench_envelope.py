"""CPU per request of the sidecar's envelope work: parse upstream's answer, build the envelope, encode it.

    .venv/bin/python benchmarks/bench_envelope.py [--rounds 7] [--seed 0]

For each shape (16 tokens x top-5: the capture benchmark's; 256 tokens x top-20: a long answer at the highest
audit k) it times, per request, in one process and one run:

- ``parse+collect``: `capture.request.edge.decode_json` of upstream's body (msgspec) and `OutputCollector.add` (the
  same on both paths);
- ``build``: reference `capture.request.assembly.build_envelope_checked` (one pydantic model per record, ~100 for
  16 x 5) against `build_envelope` (the whole envelope validated once from plain data);
- ``encode``: reference ``canonical_json(model_dump(mode="json", exclude_none=True))`` (= the generic
  `schemas.canonical.canonical_bytes`) against `Envelope.canonical()` (logprobs written by the specialised
  encoder);
- ``sidecar bytes``: reference build + encode against `build_envelope_bytes` (what the sidecar runs: no
  logprob records at all, see `capture.request.assembly`);

and asserts that both paths give the same envelope and the same bytes. Figures are the best of ``--rounds``
rounds (the machine is shared: the minimum is the least disturbed). Logprobs are float32 values widened to
float64, as vLLM returns them, so their shortest repr has 8-17 digits like real ones: float formatting is a
large part of the encoding cost, and short values like -0.125 would understate it.
"""

from __future__ import annotations

import argparse
import json
import random
import struct
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capture.protocol.audit_fields import prepare
from capture.protocol.output import OutputCollector
from capture.request.assembly import (
    EnvelopeInputs,
    RequestContext,
    build_envelope,
    build_envelope_bytes,
    build_envelope_checked,
    prompt_record,
)
from capture.request.edge import decode_json
from capture.request.policy import NOT_FLAGGED
from schemas import ArtifactHashes, Envelope, RuntimeFingerprint
from schemas.canonical import canonical_json

SHAPES = ((16, 5), (256, 20))
RUNTIME = RuntimeFingerprint(
    engine="vllm",
    engine_version="0.32.0",
    system_fingerprint="vllm-0.32.0-a7512781",
    torch_version="2.13.0+cpu",
    device="cpu",
    dtype="bfloat16",
    max_num_seqs=256,
)
ARTIFACTS = ArtifactHashes(model_sha256="a" * 64, tokenizer_sha256="b" * 64, chat_template_sha256="c" * 64)
CLIENT_BODY = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 256, "temperature": 0.7}


def f32(x: float) -> float:
    return float(struct.unpack("f", struct.pack("f", x))[0])


def upstream_body(rng: random.Random, n: int, k: int) -> bytes:
    """A vLLM 0.32 chat answer with ``return_tokens_as_token_ids`` and top-k logprobs, as the sidecar asks."""
    ids = [rng.randrange(128_000) for _ in range(n)]
    words = [rng.choice([" the", " sea", ",", " wonder", " é", " 海", "."]) for _ in range(n)]
    content = []
    for tid, word in zip(ids, words, strict=True):
        lp = f32(-rng.expovariate(3.0))
        alts = sorted((f32(-rng.expovariate(0.5)) for _ in range(k - 1)), reverse=True)
        top = [{"token": f"token_id:{tid}", "logprob": lp, "bytes": list(word.encode())}]
        top += [{"token": f"token_id:{rng.randrange(128_000)}", "logprob": a, "bytes": [32, 97]} for a in alts]
        content.append({"token": f"token_id:{tid}", "logprob": lp, "bytes": list(word.encode()), "top_logprobs": top})
    doc = {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1764400000,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(words)},
                "logprobs": {"content": content},
                "finish_reason": "length",
                "token_ids": ids,
            }
        ],
        "system_fingerprint": "vllm-0.32.0-a7512781",
        "usage": {"prompt_tokens": 19, "completion_tokens": n, "total_tokens": 19 + n},
        "prompt_token_ids": [rng.randrange(128_000) for _ in range(19)],
    }
    return json.dumps(doc).encode()


def collect(raw: bytes) -> OutputCollector:
    col = OutputCollector("chat.completions")
    col.add(decode_json(raw)[0])  # as the sidecar reads upstream's answer
    return col


def build_inputs(col: OutputCollector, ctx: RequestContext) -> EnvelopeInputs:
    prepared = prepare("chat.completions", CLIENT_BODY, request_id=ctx.request_id, audit_k=5, inject_seed=True)
    return EnvelopeInputs(
        ctx,
        model=prepared.model,
        artifacts=ARTIFACTS,
        runtime=RUNTIME,
        prompt=prompt_record(col.prompt_token_ids, "upstream"),
        sampling=prepared.sampling,
        collector=col,
        error=None,
        captured_at=datetime.now(UTC),
        sidecar_id="bench",
    )


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def reference_encode(env: Envelope) -> bytes:
    return canonical_json(env.model_dump(mode="json", exclude_none=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    print(f"{'shape':>10} {'bytes':>8} {'step':>14} {'reference us':>13} {'fast us':>9} {'speed-up':>9}")
    for n, k in SHAPES:
        raw = upstream_body(rng, n, k)
        ctx = RequestContext(
            request_id="rl-bench-1",
            received_at=datetime.now(UTC),
            tenant="default",
            workflow=None,
            flag=NOT_FLAGGED,
            endpoint="chat.completions",
            stream=False,
            in_flight_at_start=3,
            in_flight_at_end=2,
            body_sha256="e" * 64,
            upstream_ms=12.5,
        )
        col = collect(raw)
        inputs = build_inputs(col, ctx)
        ref_env, fast_env = build_envelope_checked(inputs), build_envelope(inputs)
        assert ref_env == fast_env, "fast build differs from the reference"
        payload = reference_encode(ref_env)
        assert fast_env.canonical() == payload, "fast encoding differs from the reference"
        assert build_envelope_bytes(inputs) == payload, "the sidecar's bytes differ from the reference"
        calls = max(10, 3000 // (n * k))
        collect_us = per_call_us(partial(collect, raw), calls, args.rounds)
        rows = [
            (
                "build",
                per_call_us(partial(build_envelope_checked, inputs), calls, args.rounds),
                per_call_us(partial(build_envelope, inputs), calls, args.rounds),
            ),
            (
                "encode",
                per_call_us(partial(reference_encode, ref_env), calls, args.rounds),
                per_call_us(fast_env.canonical, calls, args.rounds),
            ),
        ]
        rows.append(("build+encode", rows[0][1] + rows[1][1], rows[0][2] + rows[1][2]))
        rows.append(("+parse+collect", rows[2][1] + collect_us, rows[2][2] + collect_us))
        sidecar_us = per_call_us(partial(build_envelope_bytes, inputs), calls, args.rounds)
        rows.append(("sidecar bytes", rows[2][1], sidecar_us))
        rows.append(("+parse+collect", rows[2][1] + collect_us, sidecar_us + collect_us))
        shape = f"{n}x{k}"
        print(f"{shape:>10} {len(payload):>8} {'parse+collect':>14} {collect_us:>13.1f} {collect_us:>9.1f} {'':>9}")
        for name, ref_us, fast_us in rows:
            print(f"{shape:>10} {len(payload):>8} {name:>14} {ref_us:>13.1f} {fast_us:>9.1f} {ref_us / fast_us:>8.2f}x")


if __name__ == "__main__":
    main()
