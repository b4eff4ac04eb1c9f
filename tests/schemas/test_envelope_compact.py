"""Compact envelopes (`schemas.envelope_compact`): golden vectors that pin the decoding byte for byte, lossless
round trips of random envelopes and of arbitrary JSON (hypothesis), hostile bytes refused cleanly, and the
readers' one entry point (`envelope_bytes`, `decode_envelope`)."""

from __future__ import annotations

import hashlib
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import (
    CapturedError,
    CapturedOutput,
    Choice,
    ContractError,
    Envelope,
    PromptRecord,
    StepLogprobs,
    Timings,
    TopCandidate,
    decode_envelope,
    envelope_bytes,
)
from schemas.canonical import canonical_json
from schemas.compact_columns import CODEC_NONE, CODEC_ZLIB
from schemas.envelope_compact import (
    decode_compact,
    encode_compact,
    encoding_of,
    is_compact,
)
from schemas.layout import COMPACT_MAGIC, ENCODING_COMPACT, ENCODING_JSON
from tests.factories import FIXED_TIME, envelope, step

GOLDEN = Path(__file__).parent / "golden"
# The pinned identity of golden/envelope_compact_source.json: the id every compact golden vector decodes to.
GOLDEN_COMPACT_ID = "bb371672961b8418b179a62f4028a6893d1b46fe70dcef17b7c48ec49c1f2d58"
GOLDEN_ENVELOPE_V1_ID = "d7bcf6e8829128d113c1da9a39b5c175d6bbe4e963c6857349055f24593a7d33"


def rich_envelope() -> Envelope:
    """An envelope with every edge the codec handles: odd floats (exponent forms, -0.0, not float32), text that
    JSON escapes, candidates without id or rank, a chosen token that is no candidate, a token of None."""
    steps = (
        step(9906, -0.0013790050288662314, (12, -6.6), (9, -7.25)),
        StepLogprobs(
            token_id=7,
            token=None,
            logprob=-1.1920928955078125e-07,
            top=(
                TopCandidate(token='"\\\u2028', token_id=7, logprob=-1.1920928955078125e-07, rank=1),
                TopCandidate(token="caf\u00e9 \U0001f600", token_id=None, logprob=-0.0, rank=None),
                TopCandidate(token="", token_id=-3, logprob=-1e-05, rank=7),
            ),
        ),
        StepLogprobs(token_id=0, token="\x00\x1f", logprob=0.1, top=()),
        StepLogprobs(
            token_id=123456,
            token="x",
            logprob=-2.5,
            top=(TopCandidate(token="y", token_id=5, logprob=-1.0, rank=1),),
        ),
    )
    base = envelope()
    assert isinstance(base.outcome, CapturedOutput)
    choice = Choice(
        index=0,
        token_ids=tuple(s.token_id for s in steps),
        text="Paris \u00e9\u4e2d",
        finish_reason="stop",
        logprobs=steps,
    )
    return base.model_copy(
        update={
            "prompt": PromptRecord(token_ids=tuple(range(1, 40)), source="upstream", text='say "hi"\n'),
            "outcome": base.outcome.model_copy(update={"choices": (choice, choice.model_copy(update={"index": 1}))}),
        }
    )


def partial_envelope() -> Envelope:
    """An error envelope whose streamed part has logprobs, and a request with more prompts."""
    base = envelope()
    partial = Choice(index=0, token_ids=(1, 2), text="ab", logprobs=(step(1, -0.5), step(2, -0.25, (3, -2.0))))
    return base.model_copy(
        update={
            "more_prompts": (PromptRecord(token_ids=tuple(range(100, 120)), source="tokenize"),),
            "outcome": CapturedError(
                error_type="client_disconnect",
                message="gone",
                timings=Timings(received_at=FIXED_TIME, upstream_ms=1e-07),
                partial=(partial,),
            ),
        }
    )


# -- golden vectors ---------------------------------------------------------------------------------------


def test_golden_source_is_the_rich_envelope_and_its_id_is_pinned() -> None:
    source = (GOLDEN / "envelope_compact_source.json").read_bytes()
    assert rich_envelope().canonical() == source
    assert hashlib.sha256(source).hexdigest() == GOLDEN_COMPACT_ID


@pytest.mark.parametrize("name", ["envelope_compact_zstd.bin", "envelope_compact_zlib.bin", "envelope_compact_raw.bin"])
def test_golden_compact_vectors_decode_to_the_canonical_bytes(name: str) -> None:
    """Every codec a stored record may use decodes, now and in every later version, to exactly these bytes."""
    data = (GOLDEN / name).read_bytes()
    assert data.startswith(COMPACT_MAGIC)
    canonical = decode_compact(data)
    assert canonical == (GOLDEN / "envelope_compact_source.json").read_bytes()
    assert hashlib.sha256(canonical).hexdigest() == GOLDEN_COMPACT_ID
    assert decode_envelope(data) == rich_envelope()


def test_the_golden_uncompressed_vector_is_what_the_encoder_writes() -> None:
    """Without compression the encoding is pinned byte for byte (compressed frames may differ between zstd
    builds, which is why identity is never taken over them)."""
    assert (
        encode_compact(rich_envelope().canonical(), prefer=CODEC_NONE)
        == (GOLDEN / "envelope_compact_raw.bin").read_bytes()
    )


def test_the_v1_golden_envelope_round_trips() -> None:
    canonical = (GOLDEN / "envelope_v1.json").read_bytes()
    compact = encode_compact(canonical)
    assert compact is not None
    assert is_compact(compact)
    assert hashlib.sha256(decode_compact(compact)).hexdigest() == GOLDEN_ENVELOPE_V1_ID


@pytest.mark.parametrize("build", [rich_envelope, partial_envelope])
@pytest.mark.parametrize("prefer", [CODEC_NONE, CODEC_ZLIB, 2])
def test_edge_envelopes_round_trip_with_every_codec(build: Any, prefer: int) -> None:
    env = build()
    compact = encode_compact(env.canonical(), prefer=prefer)
    assert compact is not None
    assert decode_compact(compact) == env.canonical()
    assert decode_envelope(compact).envelope_id() == env.envelope_id()


# -- the readers' entry point -----------------------------------------------------------------------------


def test_envelope_bytes_passes_json_through_and_decodes_compact() -> None:
    canonical = envelope().canonical()
    compact = encode_compact(canonical)
    assert compact is not None
    assert envelope_bytes(canonical) is canonical
    assert envelope_bytes(compact) == canonical
    assert (encoding_of(canonical), encoding_of(compact)) == (ENCODING_JSON, ENCODING_COMPACT)
    assert decode_envelope(compact) == decode_envelope(canonical) == envelope()


def test_it_is_far_smaller_at_top_5() -> None:
    """A size check, not a benchmark (benchmarks/envelope_size.py measures the table): at top-5, what a
    generated token costs compact is under a quarter of what it costs as JSON."""

    def sized(n: int) -> tuple[int, int]:
        steps = tuple(
            step(1000 + 7 * i, -0.25 - i / 1024, *((2000 + 11 * i + j, -1.5 - j - i / 4096) for j in range(4)))
            for i in range(n)
        )
        base = envelope()
        assert isinstance(base.outcome, CapturedOutput)
        choice = Choice(index=0, token_ids=tuple(s.token_id for s in steps), text="x" * n, logprobs=steps)
        env = base.model_copy(update={"outcome": base.outcome.model_copy(update={"choices": (choice,)})})
        compact = encode_compact(env.canonical())
        assert compact is not None
        return len(env.canonical()), len(compact)

    (json_16, compact_16), (json_256, compact_256) = sized(16), sized(256)
    assert (compact_256 - compact_16) * 4 <= json_256 - json_16


def test_a_record_that_is_not_canonical_is_not_compacted() -> None:
    """The encoder proves its output by decoding it; bytes it cannot reproduce stay JSON."""
    assert encode_compact(b'{"a": [1, 2, 3, 4, 5, 6, 7, 8, 9]}') is None  # spaces: not canonical text
    assert encode_compact(b"not json") is None
    assert encode_compact(b'{"n":1.50}') is None


def test_a_new_optional_field_is_carried_without_being_named() -> None:
    """A field the codec was never told about (an envelope's ``schedule``, say) rides along: int lists in it
    become columns, everything else stays in the skeleton."""
    doc = json.loads(envelope().canonical())
    doc["schedule"] = {"steps": [{"batch": list(range(30)), "note": "x"}], "engine": {"seed": 3, "frac": 0.5}}
    canonical = canonical_json(doc)
    compact = encode_compact(canonical)
    assert compact is not None
    assert decode_compact(compact) == canonical


# -- hostile bytes ----------------------------------------------------------------------------------------


def test_malformed_records_are_contract_errors() -> None:
    compact = encode_compact(rich_envelope().canonical())
    assert compact is not None
    with pytest.raises(ContractError, match="version"):
        decode_compact(COMPACT_MAGIC + b"\x02" + compact[5:])
    with pytest.raises(ContractError, match="truncated"):
        decode_compact(compact[:-3])
    with pytest.raises(ContractError, match="after the last frame"):
        decode_compact(compact + b"\x00")
    with pytest.raises(ContractError, match="header"):
        decode_compact(COMPACT_MAGIC)
    bomb = COMPACT_MAGIC + b"\x01" + struct.pack("<BII", 1, 2**31, 10) + b"\x00" * 10
    with pytest.raises(ContractError, match="more than"):
        decode_compact(bomb)
    head = b'{"d":{},"s":[[["x"],"ints",33554432]]}'
    too_many = COMPACT_MAGIC + b"\x01" + struct.pack("<BII", 0, len(head), len(head)) + head
    with pytest.raises(ContractError, match="count is out of range"):
        decode_compact(too_many)
    deep = b'{"d":{"a":' + b"[" * 5000 + b"]" * 5000 + b'},"s":[]}'
    nested = COMPACT_MAGIC + b"\x01" + struct.pack("<BII", 0, len(deep), len(deep)) + deep
    with pytest.raises(ContractError, match="malformed"):
        decode_compact(nested)
    copies = COMPACT_MAGIC + b"\x01" + struct.pack("<BII", 3, 0, 0)
    with pytest.raises(ContractError, match="copies one that is not before it"):
        decode_compact(copies)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_flipped_or_cut_bytes_decode_or_fail_cleanly(data: st.DataObject) -> None:
    """Whatever a bucket or a broker hands over, the decoder returns bytes or raises `ContractError`."""
    compact = encode_compact(rich_envelope().canonical(), prefer=data.draw(st.sampled_from([CODEC_NONE, CODEC_ZLIB])))
    assert compact is not None
    raw = bytearray(compact)
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(5, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(5, len(raw)))
    try:
        decode_compact(bytes(raw[:cut]))
    except ContractError:
        pass


# -- lossless round trips (hypothesis) --------------------------------------------------------------------

_finite = st.floats(allow_nan=False, allow_infinity=False)
_float32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
_logprob = st.one_of(_finite, _float32, st.sampled_from([0.0, -0.0, -1e-07, -1.1920928955078125e-07, -9999.0]))
_text = st.text(max_size=6)
_candidate = st.builds(
    TopCandidate,
    token=_text,
    token_id=st.one_of(st.none(), st.integers(-5, 2**20)),
    logprob=_logprob,
    rank=st.one_of(st.none(), st.integers(1, 30)),
)


@st.composite
def _steps(draw: st.DrawFn) -> tuple[StepLogprobs, ...]:
    out = []
    for _ in range(draw(st.integers(1, 12))):
        tid = draw(st.integers(0, 2**40))
        lp = draw(_logprob)
        top = draw(st.lists(_candidate, max_size=5))
        if top and draw(st.booleans()):  # the usual case: the chosen token is a candidate
            i = draw(st.integers(0, len(top) - 1))
            token = draw(st.one_of(st.none(), st.just(top[i].token), _text))
            top[i] = top[i].model_copy(update={"token_id": tid, "logprob": lp})
        else:
            token = draw(st.one_of(st.none(), _text))
        out.append(StepLogprobs(token_id=tid, token=token, logprob=lp, top=tuple(top)))
    return tuple(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps(), st.lists(st.integers(0, 2**33), min_size=1, max_size=40), st.integers(0, 2))
def test_random_envelopes_round_trip_exactly(steps: Any, prompt: list[int], prefer: int) -> None:
    base = envelope()
    assert isinstance(base.outcome, CapturedOutput)
    choice = Choice(index=0, token_ids=tuple(s.token_id for s in steps), text="t", logprobs=steps)
    env = base.model_copy(
        update={
            "prompt": PromptRecord(token_ids=tuple(prompt), source="upstream"),
            "outcome": base.outcome.model_copy(update={"choices": (choice,)}),
        }
    )
    canonical = env.canonical()
    compact = encode_compact(canonical, prefer=prefer)
    assert compact is not None, "a validated envelope is always compacted"
    assert decode_compact(compact) == canonical
    assert all(math.isfinite(s.logprob) for s in decode_envelope(compact).outcome.choices[0].logprobs or ())  # type: ignore[union-attr]


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | _finite | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(st.text(max_size=4), inner, max_size=6),
    max_leaves=60,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=4), _json, max_size=6))
def test_any_canonical_json_object_round_trips_or_stays_json(doc: dict[str, Any]) -> None:
    """The codec is a bytes-to-bytes encoding of canonical JSON: whatever the object, what it writes decodes
    to exactly the input (or it writes nothing)."""
    canonical = canonical_json(doc)
    compact = encode_compact(canonical)
    if compact is not None:
        assert decode_compact(compact) == canonical
