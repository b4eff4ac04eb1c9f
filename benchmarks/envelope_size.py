"""Envelope size by prompt length, output length and top-k: the table behind docs/SCALING.md section 1.

Builds real `schemas.Envelope` records (the same shape tests/factories.py builds, scaled up) and measures
``len(envelope.canonical())``, the bytes the capture sidecar publishes to Kafka and writes to S3, plus their
gzip size (Kafka's gzip codec and a compressed S3 copy would see about this much).

What the synthetic values look like, and why (each choice makes the measurement realistic, not small):
- token ids drawn uniformly from a 128,256-token vocabulary (Llama 3 size: 5-6 digit ids, as in production);
- token strings of 1-8 characters (typical BPE pieces), prompt and output text ~4 characters per token;
- logprobs are float32 values widened to float64, as vLLM returns them, so their shortest repr is 8-20
  characters like the real ones (a random float64 would overstate, a rounded one understate);
- top-k candidates carry token, token_id, logprob and rank, as the sidecar records them;
  "k=0" records the chosen token's logprob per step and no alternatives.

Run:  .venv/bin/python benchmarks/envelope_size.py [--vocab N] [--seed S] [--markdown]
"""

from __future__ import annotations

import argparse
import gzip
import random
import struct
import time
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


def measure(vocab: int, seed: int) -> list[tuple[int, int, int, int, int, float]]:
    """Rows of (prompt_len, output_len, top_k, canonical bytes, gzip bytes, bytes per output step)."""
    rows = []
    for prompt_len in PROMPT_LENGTHS:
        for output_len in OUTPUT_LENGTHS:
            for top_k in TOP_KS:
                raw = build_envelope(prompt_len, output_len, top_k, vocab=vocab, seed=seed).canonical()
                packed = gzip.compress(raw, compresslevel=6, mtime=0)
                rows.append((prompt_len, output_len, top_k, len(raw), len(packed), 0.0))
    # Marginal cost of one generated step at each top-k: difference between the longest and shortest output.
    by_shape = {(p, o, k): size for p, o, k, size, _, _ in rows}
    lo, hi = OUTPUT_LENGTHS[0], OUTPUT_LENGTHS[-1]
    return [
        (p, o, k, size, gz, (by_shape[(p, hi, k)] - by_shape[(p, lo, k)]) / (hi - lo)) for p, o, k, size, gz, _ in rows
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
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.vocab, args.seed)
    elapsed = time.perf_counter() - started
    if args.markdown:
        print("| prompt tokens | output tokens | top-k | canonical | gzip | ratio | bytes/step |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for p, o, k, size, gz, per_step in rows:
            print(f"| {p} | {o} | {k} | {_human(size)} | {_human(gz)} | {size / gz:.1f}x | {per_step:.0f} |")
    else:
        print(f"{'prompt':>7} {'output':>7} {'top_k':>5} {'canonical_B':>12} {'gzip_B':>10} {'bytes/step':>10}")
        for p, o, k, size, gz, per_step in rows:
            print(f"{p:>7} {o:>7} {k:>5} {size:>12} {gz:>10} {per_step:>10.0f}")
    print(f"# vocab={args.vocab} seed={args.seed}; {len(rows)} envelopes built and encoded in {elapsed:.1f} s")


if __name__ == "__main__":
    main()
