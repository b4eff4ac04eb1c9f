"""Envelope size by prompt length, output length and top-k: the table behind docs/SCALING.md section 1.

Builds real `schemas.Envelope` records (the same shape tests/factories.py builds, scaled up) and measures, side by
side in one run, what an envelope costs in both stored forms:

- JSON: ``len(envelope.canonical())``, what the sidecar stored before compact envelopes (``envelope_encoding =
  "json"``), and its gzip size (Kafka's gzip codec and a compressed S3 copy would see about this much);
- compact: ``len(encode_compact(canonical))`` (`schemas.envelope_compact`, the default ``envelope_encoding``),
  what the sidecar now publishes to Kafka and writes to S3; each one is checked to decode to the canonical bytes.

``bytes/step`` is the marginal cost of one generated token: the size difference between the longest and the
shortest output of the same prompt and top-k, per token. ``--timing`` adds the encode and decode time of the
compact form (best of three), the CPU a publisher and a reader pay per envelope.

What the synthetic values look like, and why (each choice makes the measurement realistic, not small):
- token ids drawn uniformly from a 128,256-token vocabulary (Llama 3 size: 5-6 digit ids, as in production);
- token strings of 1-8 characters (typical BPE pieces), prompt and output text ~4 characters per token, every one
  drawn afresh (even a candidate's text is not its id's: a real tokenizer's would repeat, so this overstates);
- logprobs are float32 values widened to float64, as vLLM returns them, so their shortest repr is 8-20
  characters like the real ones (a random float64 would overstate, a rounded one understate);
- top-k candidates carry token, token_id, logprob and rank, as the sidecar records them; the chosen token is
  candidate 1 (same id and logprob), as in greedy and most sampled steps;
  "k=0" records the chosen token's logprob per step and no alternatives.

Run:  .venv/bin/python benchmarks/envelope_size.py [--vocab N] [--seed S] [--markdown] [--timing]
"""

from __future__ import annotations

import argparse
import gzip
import random
import struct
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from schemas import (
    ArtifactHashes,
    CapturedOutput,
    Choice,
    Envelope,
    ExecutionContext,
    PromptRecord,
    RuntimeFingerprint,
    SamplingContract,
    StepLogprobs,
    Timings,
    TopCandidate,
)
from schemas.envelope_compact import decode_compact, encode_compact

PROMPT_LENGTHS = (128, 1024, 8192)
OUTPUT_LENGTHS = (16, 256, 2048)
TOP_KS = (0, 5, 20)
_ALPHABET = "abcdefghijklmnopqrstuvwxyz      ,.ABCDEFGHIJ0123456789"
_AT = datetime(2026, 7, 14, 9, 30, 0, 123456, tzinfo=UTC)


def _f32(x: float) -> float:
    """The float64 a float32 logprob becomes in JSON (what vLLM returns)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _piece(rng: random.Random) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(rng.randint(1, 8)))


def _text(rng: random.Random, tokens: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(4 * tokens))


def _step(rng: random.Random, vocab: int, top_k: int) -> StepLogprobs:
    chosen = rng.randrange(vocab)
    chosen_lp = _f32(-rng.expovariate(4.0))
    top: list[TopCandidate] = []
    if top_k:
        top.append(TopCandidate(token=_piece(rng), token_id=chosen, logprob=chosen_lp, rank=1))
        lp = chosen_lp
        for rank in range(2, top_k + 1):
            lp = _f32(lp - rng.expovariate(1.0))
            top.append(TopCandidate(token=_piece(rng), token_id=rng.randrange(vocab), logprob=lp, rank=rank))
    return StepLogprobs(token_id=chosen, token=_piece(rng), logprob=chosen_lp, top=tuple(top))


def build_envelope(prompt_len: int, output_len: int, top_k: int, *, vocab: int, seed: int) -> Envelope:
    """One complete, valid envelope of the given shape (deterministic for a seed)."""
    rng = random.Random(seed)
    steps = tuple(_step(rng, vocab, top_k) for _ in range(output_len))
    return Envelope(
        request_id=f"req-{prompt_len}-{output_len}-{top_k}",
        captured_at=_AT,
        tenant="acme-insurance",
        flagged=False,
        target_level="token",
        endpoint="chat.completions",
        model="llama-3.1-8b-instruct",
        artifacts=ArtifactHashes(
            model_sha256="a" * 64,
            tokenizer_sha256="b" * 64,
            chat_template_sha256="c" * 64,
            manifest_source="reprolane-manifest.json",
        ),
        prompt=PromptRecord(
            token_ids=tuple(rng.randrange(vocab) for _ in range(prompt_len)),
            source="upstream",
            text=_text(rng, prompt_len),
        ),
        sampling=SamplingContract(
            temperature=0.7, top_p=0.95, max_tokens=output_len, seed=42, seed_scope="per_request", logprobs=top_k
        ),
        runtime=RuntimeFingerprint(
            engine="vllm",
            engine_version="0.32.0",
            system_fingerprint="vllm-0.32.0-1a2b3c4d",
            torch_version="2.13.0",
            cuda_version="12.8",
            device="cuda",
            device_name="NVIDIA H200",
            compute_capability="9.0",
            dtype="bfloat16",
            quantization="none",
            tensor_parallel_size=1,
            pipeline_parallel_size=1,
            data_parallel_size=1,
            attention_backend="FLASH_ATTN",
            cuda_graphs=True,
            batch_invariant=False,
            max_num_seqs=256,
            prefix_caching=True,
        ),
        context=ExecutionContext(in_flight_at_start=17, in_flight_at_end=12, stream=True, sidecar_id="capture-0"),
        outcome=CapturedOutput(
            choices=(
                Choice(
                    index=0,
                    token_ids=tuple(s.token_id for s in steps),
                    text=_text(rng, output_len),
                    finish_reason="length",
                    logprobs=steps,
                ),
            ),
            timings=Timings(received_at=_AT, upstream_ms=812.25, first_token_ms=41.5, added_ms=0.4),
            usage={
                "prompt_tokens": prompt_len,
                "completion_tokens": output_len,
                "total_tokens": prompt_len + output_len,
            },
        ),
    )


@dataclass(frozen=True)
class Row:
    prompt: int
    output: int
    top_k: int
    json: int
    gzip: int
    compact: int
    json_per_step: float = 0.0
    compact_per_step: float = 0.0
    encode_ms: float = 0.0
    decode_ms: float = 0.0


def _best_ms(work: object, repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        work()  # type: ignore[operator]
        best = min(best, time.perf_counter() - started)
    return best * 1000


def measure(vocab: int, seed: int, *, timing: bool = False) -> list[Row]:
    """One `Row` per shape; the per-step figures from the longest and shortest output of each prompt and top-k."""
    rows = []
    for prompt_len in PROMPT_LENGTHS:
        for output_len in OUTPUT_LENGTHS:
            for top_k in TOP_KS:
                raw = build_envelope(prompt_len, output_len, top_k, vocab=vocab, seed=seed).canonical()
                compact = encode_compact(raw)
                assert compact is not None, "the codec refused a valid envelope"
                assert decode_compact(compact) == raw, "compact form is not lossless"
                encode_ms = _best_ms(lambda raw=raw: encode_compact(raw)) if timing else 0.0
                decode_ms = _best_ms(lambda compact=compact: decode_compact(compact)) if timing else 0.0
                packed = gzip.compress(raw, compresslevel=6, mtime=0)
                rows.append(
                    Row(prompt_len, output_len, top_k, len(raw), len(packed), len(compact), 0, 0, encode_ms, decode_ms)
                )
    by_shape = {(r.prompt, r.output, r.top_k): r for r in rows}
    lo, hi = OUTPUT_LENGTHS[0], OUTPUT_LENGTHS[-1]

    def per_step(r: Row, size: str) -> float:
        long, short = by_shape[(r.prompt, hi, r.top_k)], by_shape[(r.prompt, lo, r.top_k)]
        return float(getattr(long, size) - getattr(short, size)) / (hi - lo)

    return [
        Row(**{**r.__dict__, "json_per_step": per_step(r, "json"), "compact_per_step": per_step(r, "compact")})
        for r in rows
    ]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024 or unit == "MiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--timing", action="store_true", help="also time encoding and decoding the compact form")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.vocab, args.seed, timing=args.timing)
    elapsed = time.perf_counter() - started
    timed = " encode | decode |" if args.timing else ""
    if args.markdown:
        head = "| prompt tokens | output tokens | top-k | JSON | gzip | compact | JSON/compact "
        head += "| bytes/step JSON -> compact |"
        print(head + timed)
        print("|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if args.timing else ""))
        for r in rows:
            cells = f" {r.encode_ms:.1f} ms | {r.decode_ms:.1f} ms |" if args.timing else ""
            print(
                f"| {r.prompt} | {r.output} | {r.top_k} | {_human(r.json)} | {_human(r.gzip)} | {_human(r.compact)} | "
                f"{r.json / r.compact:.1f}x | {r.json_per_step:.0f} -> {r.compact_per_step:.1f} |{cells}"
            )
    else:
        head = f"{'prompt':>7} {'output':>7} {'top_k':>5} {'json_B':>9} {'gzip_B':>9} {'compact_B':>9} {'ratio':>6}"
        print(
            head + f" {'step_json':>9} {'step_compact':>12}" + (f" {'enc_ms':>7} {'dec_ms':>7}" if args.timing else "")
        )
        for r in rows:
            line = f"{r.prompt:>7} {r.output:>7} {r.top_k:>5} {r.json:>9} {r.gzip:>9} {r.compact:>9} "
            line += f"{r.json / r.compact:>6.1f} {r.json_per_step:>9.0f} {r.compact_per_step:>12.1f}"
            print(line + (f" {r.encode_ms:>7.1f} {r.decode_ms:>7.1f}" if args.timing else ""))
    print(f"# vocab={args.vocab} seed={args.seed}; {len(rows)} envelopes built, encoded both ways in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
