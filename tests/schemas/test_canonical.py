"""The canonical-encoding rule, pinned with literal bytes; the envelope's fast encoder against the generic one."""

from __future__ import annotations

import math
import random
import struct
import sys
import warnings
from typing import Any

import msgspec
import pytest
from pydantic import BaseModel

import schemas.canonical
import schemas.envelope_codec
from schemas import (
    CapturedError,
    CapturedOutput,
    Choice,
    ContractError,
    Envelope,
    SamplingContract,
    StepLogprobs,
    Timings,
    TopCandidate,
)
from schemas.canonical import canonical_json, canonical_object_with, canonical_text, encode_string
from schemas.envelope_codec import _steps_text
from tests.factories import FIXED_TIME, envelope


def test_rule_literal_vector() -> None:
    data = {"b": [1, 2.5, -0.0001, 1e-07], "a": {"z": "café", "y": None, "x": True}}
    assert canonical_json(data) == '{"a":{"x":true,"y":null,"z":"café"},"b":[1,2.5,-0.0001,1e-07]}'.encode()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_refused(bad: float) -> None:
    with pytest.raises(ContractError, match="canonical"):
        canonical_json({"x": bad})


# ------------------------------------------------------------------ the envelope's fast encoder


_TIMING_FLOATS = {"nested.first_token_ms", "nested.added_ms"}


def _reference(model: BaseModel) -> bytes:
    return canonical_json(model.model_dump(mode="json", exclude_none=True))


_TEXTS = [
    "",
    "a",
    " the",
    "café",
    "海",
    "🙂",
    'q"uote',
    "back\\slash",
    "\n\t\x00\x1f",
    "\u2028\u2029",
    "\x7f",
    "token_id:3",
    "\x00logprobs 0\x00",  # the marker `schemas.envelope_codec._joined` uses: its exactness guard must catch it
]


def _float(rng: random.Random) -> float:
    kind = rng.randrange(9)
    if kind == 0:
        return rng.choice([0.0, -0.0, 1.0, -1.0, 2.0, 1e-7, 1e-5, 1e-4, 1e16, 1e15, 1e22, -1e-300, 5e-324])
    if kind == 1:
        return rng.choice([sys.float_info.max, -sys.float_info.max, sys.float_info.min, sys.float_info.epsilon])
    if kind == 2:
        return -rng.expovariate(1.0) * 10.0 ** rng.randint(-320, 300)  # tiny to huge, subnormals included
    if kind == 3:
        return float(struct.unpack("f", struct.pack("f", -rng.expovariate(0.5)))[0])  # float32, as vLLM returns
    if kind == 4:
        return float(rng.randint(-(2**60), 2**60))
    if kind == 5:
        return round(-rng.random() * 20, rng.randint(0, 6))
    return -rng.random() * rng.choice([1.0, 30.0, 1e-6, 1e6])


def test_msgspec_writes_repr_in_the_plain_range_and_the_same_double_elsewhere() -> None:
    """What `steps_canonical_text` relies on: msgspec's float text is ``repr``'s for 0 and magnitudes in
    [1e-4, 1e16); any other finite float's text reads back as the same double (so ``repr`` can replace it)."""
    assert schemas.canonical.MSGSPEC_TEXT_IS_CANONICAL  # else msgspec is never used and this proves nothing
    rng = random.Random(11)
    values: list[float] = []
    while len(values) < 200_000:
        bits = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        for v in (bits, -(10.0 ** rng.uniform(-12, 18)) * rng.random(), _float(rng)):
            if math.isfinite(v):
                values.append(v)
    values += [0.0, -0.0, 1e-4, -1e-4, 9.999999999999999e-05, 1e16, 9999999999999998.0, 5e-324, sys.float_info.max]
    texts = msgspec.json.encode(values).decode("ascii")[1:-1].split(",")
    plain = [(t, v) for t, v in zip(texts, values, strict=True) if v == 0 or 1e-4 <= abs(v) < 1e16]
    assert 0 < len(plain) < len(values)
    assert [t for t, _ in plain] == [repr(v) for _, v in plain]
    back = [float(t) for t in texts]
    assert back == values
    assert [math.copysign(1, b) for b in back] == [math.copysign(1, v) for v in values]


def test_msgspec_escapes_every_code_point_as_the_canonical_encoder() -> None:
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c < 0xE000)
    assert msgspec.json.encode(text).decode("utf-8") == encode_string(text)


def test_without_a_canonical_msgspec_every_envelope_takes_the_generic_path(monkeypatch: pytest.MonkeyPatch) -> None:
    step = StepLogprobs(token_id=1, token="x", logprob=-1e-05, top=(TopCandidate(token="x", logprob=-0.5, rank=1),))
    expected = '[{"logprob":-1e-05,"token":"x","token_id":1,"top":[{"logprob":-0.5,"rank":1,"token":"x"}]}]'
    assert _steps_text((step,)) == expected  # msgspec alone would write -0.00001
    monkeypatch.setattr(schemas.envelope_codec, "_FAST_LOGPROBS", False)
    assert _steps_text((step,)) is None
    env = _random_envelope(random.Random(3))
    assert env.canonical() == _reference(env)


def _opt(rng: random.Random, value: object) -> object:
    return None if rng.random() < 0.25 else value


def _candidate(rng: random.Random, rank: int) -> TopCandidate:
    return TopCandidate(
        token=rng.choice(_TEXTS) + rng.choice(_TEXTS),
        token_id=_opt(rng, rng.choice([0, 1, -3, 2**40, rng.randrange(200_000)])),  # type: ignore[arg-type]
        logprob=_float(rng),
        rank=_opt(rng, rank),  # type: ignore[arg-type]
    )


def _choice(rng: random.Random, index: int) -> Choice:
    n = rng.randint(0, 12)
    ids = tuple(rng.randrange(200_000) for _ in range(n))
    logprobs = None
    if rng.random() < 0.85:
        logprobs = tuple(
            StepLogprobs(
                token_id=tid,
                token=_opt(rng, rng.choice(_TEXTS)),  # type: ignore[arg-type]
                logprob=_float(rng),
                top=tuple(_candidate(rng, r) for r in range(1, rng.randint(0, 6) + 1)),
            )
            for tid in ids
        )
    return Choice(
        index=index,
        token_ids=ids,
        text="".join(rng.choice(_TEXTS) for _ in range(n)),
        finish_reason=_opt(rng, rng.choice(["stop", "length"])),  # type: ignore[arg-type]
        logprobs=logprobs,
    )


def _random_envelope(rng: random.Random) -> Envelope:
    timings = Timings(received_at=FIXED_TIME, upstream_ms=abs(_float(rng)), first_token_ms=_opt(rng, 1.5))  # type: ignore[arg-type]
    choices = tuple(_choice(rng, i) for i in range(rng.randint(1, 3)))
    outcome: CapturedOutput | CapturedError
    if rng.random() < 0.7:
        outcome = CapturedOutput(choices=choices, timings=timings, usage={"completion_tokens": rng.randrange(99)})
    else:
        outcome = CapturedError(
            error_type="timeout",
            status_code=_opt(rng, 504),
            message=rng.choice(_TEXTS),
            timings=timings,  # type: ignore[arg-type]
            partial=choices[: rng.randint(0, 3)],
        )
    overrides: dict[str, Any] = {"outcome": outcome, "model": "m" + rng.choice(_TEXTS)}
    if rng.random() < 0.5:  # sampling floats msgspec writes as repr, or not (tiny, huge)
        small = rng.choice([0.7, 0.0, 1e-05, 1.1920928955078125e-07, 0.5 * rng.random() ** 8])  # [0, 1)
        bias = {str(rng.randrange(50_000)): _float(rng) for _ in range(rng.randint(0, 3))}  # any finite float
        overrides["sampling"] = SamplingContract(
            temperature=small, min_p=small, repetition_penalty=1 + small, seed_scope="none", logit_bias=bias
        )
    if rng.random() < 0.3:
        overrides.update(prompt=None, sampling=None, workflow=None, request_body_sha256=None, flag_reason=None)
    return envelope(**overrides)


def test_envelope_fast_encoding_equals_the_reference_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    encoded: list[str] = []
    by_msgspec: list[bool] = []
    other_floats_plain = schemas.envelope_codec._other_floats_plain

    def spy_floats(env: Envelope) -> bool:
        by_msgspec.append(other_floats_plain(env))
        return by_msgspec[-1]

    monkeypatch.setattr(schemas.envelope_codec, "_other_floats_plain", spy_floats)

    def spy(steps: tuple[StepLogprobs, ...]) -> str | None:
        text = _steps_text(steps)
        if text is not None:
            encoded.append(text)
        return text

    monkeypatch.setattr(schemas.envelope_codec, "_steps_text", spy)
    rng = random.Random(20261129)
    for _ in range(400):
        env = _random_envelope(rng)
        assert env.canonical() == _reference(env)
    assert len(encoded) > 300  # the specialised encoder did the work, not the fallback
    assert by_msgspec.count(False) > 50  # odd floats: the stdlib encoder wrote the rest
    assert by_msgspec.count(True) > 50  # msgspec did, and agreed byte for byte


def test_the_floats_outside_logprobs_are_the_ones_checked() -> None:
    """`_other_floats_plain` reads known fields; if a record gains a float field, the fast text must step aside."""
    assert schemas.envelope_codec._KNOWN_FLOATS

    class Odd(BaseModel):
        ratio: float | None = None
        extra: dict[str, Any] = {}
        nested: Timings | None = None

    assert schemas.envelope_codec._float_fields(Odd) == {"ratio", "extra", "nested.upstream_ms", *_TIMING_FLOATS}


def test_a_string_equal_to_the_splice_marker_takes_the_member_by_member_join(monkeypatch: pytest.MonkeyPatch) -> None:
    joined: list[int] = []
    by_member = schemas.envelope_codec._joined_by_member

    def spy(*args: Any) -> bytes:
        joined.append(1)
        return by_member(*args)

    monkeypatch.setattr(schemas.envelope_codec, "_joined_by_member", spy)
    rng = random.Random(5)
    plain = _random_envelope(rng)
    while (
        not isinstance(plain.outcome, CapturedOutput)
        or not plain.outcome.choices[0].logprobs
        or "\\u0000logprobs" in plain.model_dump_json()  # _TEXTS holds the marker: it must not be there yet
    ):
        plain = _random_envelope(rng)
    assert plain.canonical() == _reference(plain)
    assert not joined
    choices = list(plain.outcome.choices)
    choices[0] = choices[0].model_copy(update={"text": "\x00logprobs 0\x00"})
    odd = plain.model_copy(update={"outcome": plain.outcome.model_copy(update={"choices": tuple(choices)})})
    assert odd.canonical() == _reference(odd)
    assert joined == [1]


@pytest.mark.parametrize(
    "bad",
    [
        {"logprob": math.nan},
        {"logprob": math.inf},
        {"logprob": -math.inf},
        {"logprob": 0},  # an int where the record holds floats
        {"token_id": True},
        {"rank": 1.0},
        {"token": None},
    ],
)
def test_values_only_model_construct_can_make_take_the_reference_path(bad: dict[str, Any]) -> None:
    good = _random_envelope(random.Random(1))
    odd = TopCandidate.model_construct(**{"token": "x", "token_id": 1, "logprob": -0.5, "rank": 1, **bad})
    step = StepLogprobs(token_id=1, token="x", logprob=-0.5, top=(odd,))  # nested records are not revalidated
    choice = Choice(index=0, token_ids=(1,), text="x", logprobs=(step,))
    outcome = CapturedOutput(choices=(choice,), timings=good.outcome.timings)
    env = envelope(outcome=outcome)
    assert _steps_text((step,)) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pydantic's serializer warns about the mistyped value
        try:
            expected: bytes | type[Exception] = _reference(env)
        except ContractError:
            expected = ContractError
        if expected is ContractError:
            with pytest.raises(ContractError):
                env.canonical()
        else:
            assert env.canonical() == expected


def test_canonical_object_with_splices_a_member_in_sorted_position() -> None:
    members = {"b": [1.5, None], "d": {"y": 1, "x": "é"}, "a": True}
    for key in ("0", "a", "c", "e", "bb"):
        assert canonical_object_with(members, key, '{"raw":1}') == canonical_text({**members, key: {"raw": 1}})
    assert canonical_object_with({}, "k", "[]") == '{"k":[]}'


@pytest.mark.parametrize(
    ("field", "digits", "error", "match"),
    [
        ("token", 0, UnicodeEncodeError, "surrogates not allowed"),  # a lone surrogate
        ("token_id", 5000, ContractError, "canonical"),  # an int past Python's digit limit
    ],
)
def test_unencodable_values_fail_the_same_way_on_both_paths(
    field: str, digits: int, error: type[Exception], match: str
) -> None:
    value: Any = 10**digits if digits else "\ud800"
    cand = TopCandidate.model_construct(**{"token": "x", "token_id": 1, "logprob": -0.5, "rank": 1, field: value})
    step = StepLogprobs(token_id=1, token="x", logprob=-0.5, top=(cand,))
    choice = Choice(index=0, token_ids=(1,), text="x", logprobs=(step,))
    env = envelope(outcome=CapturedOutput(choices=(choice,), timings=envelope().outcome.timings))
    with pytest.raises(error, match=match):
        _reference(env)
    with pytest.raises(error, match=match):
        env.canonical()
