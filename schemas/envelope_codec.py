"""The envelope's fast canonical encoder: exactly `schemas.canonical.canonical_bytes` of an `Envelope`, with the
per-token logprobs written by msgspec.

The logprobs (one record per generated token and per alternative) are most of an envelope's bytes and most of
the generic encoder's work. Here they are written straight from the records (or, on the capture sidecar's hot
path, from plain rows that were never validated into records: `TopRow`, `StepRow`, `steps_canonical_text`),
and spliced into the canonical text of the rest of the envelope (`canonical_envelope`, `canonical_with_logprobs`).
Exactness rests on what `schemas.canonical.MSGSPEC_TEXT_IS_CANONICAL` checks at import, on the value checks in
`steps_canonical_text`, and on two guards that make every envelope take the generic encoder should the records
ever change shape (`_FAST_LOGPROBS`, `_KNOWN_FLOATS`). tests/schemas/test_canonical.py compares both encoders
byte for byte on random envelopes; benchmarks/bench_envelope.py measures them (BENCHMARKS.md).

This module reads the records of `schemas.envelope`, so that module cannot import it: the package hands
`canonical_envelope` to `schemas.envelope.use_canonical_writer`, and `Envelope.canonical` writes with it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final, get_args

import msgspec
from pydantic import BaseModel

from schemas.canonical import (
    MSGSPEC_TEXT_IS_CANONICAL,
    canonical_bytes,
    canonical_object_with,
    canonical_text,
    canonical_text_of_plain,
    encode_string,
    is_plain_float,
)
from schemas.envelope import CapturedError, CapturedOutput, Choice, Envelope, StepLogprobs, TopCandidate


class TopRow(msgspec.Struct, omit_defaults=True, gc=False):
    """One alternative (a `TopCandidate`) as plain, unchecked data for `steps_canonical_text`: compact (a slotted
    record, no dict per alternative) and written by msgspec with its fields in canonical (sorted) order, None
    members left out."""

    logprob: Any = None
    rank: Any = None
    token: Any = None
    token_id: Any = None


class StepRow(msgspec.Struct, omit_defaults=True):
    """One generation step (a `StepLogprobs`) as plain, unchecked data, like `TopRow`; ``top`` is a list of them."""

    logprob: Any = None
    token: Any = None
    token_id: Any = None
    top: Any = None


# If the records' fields ever change, the rows no longer mirror them and every envelope takes the generic path
# rather than be written wrong.
_FAST_LOGPROBS: Final = (
    tuple(sorted(TopCandidate.model_fields)) == TopRow.__struct_fields__
    and tuple(sorted(StepLogprobs.model_fields)) == StepRow.__struct_fields__
    and MSGSPEC_TEXT_IS_CANONICAL
)
_ENCODE: Final = msgspec.json.Encoder().encode
_INF: Final = float("inf")


def steps_canonical_text(steps: Sequence[StepRow]) -> str | None:
    """Canonical text of one choice's logprobs given as rows, or None when a value is not exactly one a validated
    record holds: a float that is not a finite ``float``, an int that is not an ``int`` (``bool`` included), a
    negative chosen token id, a rank below 1, a token that is not a ``str``, a ``top`` that is not a list of
    `TopRow`. Whoever gets None uses the model path, which validates, coerces or refuses as the contract says.

    The values are checked here, in one pass; msgspec then writes the rows in one C call. Its text is the
    canonical one (strings escaped alike, same digits for every float, same spelling for 0 and magnitudes in
    [1e-4, 1e16); see `schemas.canonical`) except for the other logprobs (a near-certain token's
    ``-1.1920928955078125e-07``), which msgspec writes ``0.00001`` / ``1e-7`` / ``1e16`` where ``repr`` writes
    ``1e-05`` / ``1e-07`` / ``1e+16``: the check notes those few and they are rewritten. Exact: ``"logprob":``
    then a number then ``,`` occurs in the text only as a row's member (``logprob`` is each row's first member
    and never its last, and a ``"`` inside a string is written ``\\"``), and msgspec's text of a float reads back
    as that float.
    """
    if not _FAST_LOGPROBS:
        return None
    odd: set[float] = set()
    # The range tests below are `is_plain_float`, written out: a call per value is a large part of this loop.
    for step in steps:
        lp, tid, token, top = step.logprob, step.token_id, step.token, step.top
        if type(lp) is not float or type(tid) is not int or tid < 0 or type(top) is not list:
            return None
        if token is not None and type(token) is not str:
            return None
        if not (-1e16 < lp <= -1e-4 or lp == 0 or 1e-4 <= lp < 1e16):
            if not -_INF < lp < _INF:  # also false for NaN
                return None
            odd.add(lp)
        for cand in top:
            if type(cand) is not TopRow:
                return None
            clp, rank, ctid = cand.logprob, cand.rank, cand.token_id
            if type(clp) is not float or type(cand.token) is not str:
                return None
            if (rank is not None and (type(rank) is not int or rank < 1)) or (
                ctid is not None and type(ctid) is not int
            ):
                return None
            if not (-1e16 < clp <= -1e-4 or clp == 0 or 1e-4 <= clp < 1e16):
                if not -_INF < clp < _INF:
                    return None
                odd.add(clp)
    try:
        text = _ENCODE(steps).decode("utf-8")
    except (msgspec.EncodeError, ValueError, TypeError, OverflowError):
        return None  # a lone surrogate (UnicodeEncodeError is a ValueError), an int too long to write
    for value in odd:
        text = text.replace(f'"logprob":{_ENCODE(value).decode()},', f'"logprob":{value!r},')
    return text


def _steps_text(steps: tuple[StepLogprobs, ...]) -> str | None:
    """`steps_canonical_text` of records (None for anything that is not exactly a `StepLogprobs`)."""
    rows: list[StepRow] = []
    for step in steps:
        if type(step) is not StepLogprobs:
            return None
        tops: list[TopRow] = []
        for cand in step.top:
            if type(cand) is not TopCandidate:
                return None
            tops.append(TopRow(cand.logprob, cand.rank, cand.token, cand.token_id))
        rows.append(StepRow(step.logprob, step.token, step.token_id, tops))
    return steps_canonical_text(rows)


def _choices_of(envelope: Envelope) -> tuple[str, tuple[Choice, ...]] | None:
    """The member of the outcome that holds choices, and those choices (None: not a validated outcome)."""
    outcome = envelope.outcome
    if type(outcome) is CapturedOutput:
        return "choices", outcome.choices
    if type(outcome) is CapturedError:
        return "partial", outcome.partial
    return None  # only a `model_construct`-ed record gets here


def canonical_envelope(envelope: Envelope) -> bytes:
    """Exactly `canonical_bytes(envelope)`, faster when it holds per-step logprobs.

    The logprobs (one record per generated token and per alternative: most of an envelope's bytes) are
    written straight from the records by `_steps_text`, without the JSON-mode dump and the generic sorted
    encoding; everything else is dumped and encoded as `canonical_bytes` does, and the parts are joined by
    `_joined`. tests/schemas/test_canonical.py compares both paths byte for byte.
    """
    found = _choices_of(envelope)
    if found is None:
        return canonical_bytes(envelope)
    key, choices = found
    if not _FAST_LOGPROBS or not any(type(c) is Choice and c.logprobs for c in choices):
        return canonical_bytes(envelope)
    texts: list[str | None] = []
    for choice in choices:
        try:
            text = None if type(choice) is not Choice or choice.logprobs is None else _steps_text(choice.logprobs)
        except ValueError:  # an int too long to write: the generic encoder refuses it with a ContractError
            return canonical_bytes(envelope)
        if text is None and (type(choice) is not Choice or choice.logprobs is not None):
            return canonical_bytes(envelope)
        texts.append(text)
    return _joined(envelope, key, texts)


def canonical_with_logprobs(envelope: Envelope, logprobs: Sequence[str | None]) -> bytes | None:
    """The canonical bytes of `envelope` with choice ``i``'s ``logprobs`` set to the record whose canonical
    text is ``logprobs[i]`` (from `steps_canonical_text`; None: that choice has none), or None when this cannot
    be done exactly (a choice already holds logprobs, the counts differ, the encoder is disabled).

    Lets the capture sidecar validate an envelope's small part with pydantic and write its large part (the
    per-token logprobs, already checked value by value by `steps_canonical_text`) without building a record per
    token and per alternative: the bytes are those of the envelope with the logprobs validated in (tests/capture
    compare).
    """
    found = _choices_of(envelope)
    if found is None or not _FAST_LOGPROBS:
        return None
    key, choices = found
    if len(choices) != len(logprobs) or any(type(c) is not Choice or c.logprobs is not None for c in choices):
        return None
    return _joined(envelope, key, logprobs)


def _float_fields(model: type[BaseModel], prefix: str = "", within: frozenset[type] = frozenset()) -> set[str]:
    """Dotted paths of the fields of `model` and its nested records whose annotation mentions ``float``
    (``Any`` counts: it may hold one); a record nested in itself is reported as ``<path>.*``."""
    out: set[str] = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        if re.search(r"\b(float|Any)\b", str(info.annotation)):
            out.add(path)
        stack: list[Any] = [info.annotation]
        while stack:
            kind = stack.pop()
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                nested = within | {model}
                out |= {f"{path}.*"} if kind in nested else _float_fields(kind, path + ".", nested)
            stack.extend(get_args(kind))
    return out


# The floats of an envelope outside its logprobs, which `_other_floats_plain` reads one by one. If the records
# ever hold others, the set differs and `_joined` always takes the stdlib encoder rather than miss one.
_OTHER_FLOATS: Final = frozenset(
    {f"sampling.{name}" for name in ("temperature", "top_p", "min_p", "logit_bias")}
    | {f"sampling.{name}_penalty" for name in ("repetition", "presence", "frequency")}
    | {f"outcome.timings.{name}" for name in ("upstream_ms", "first_token_ms", "added_ms")}
)
_LOGPROB_FLOATS: Final = frozenset(
    f"outcome.{key}.logprobs.{name}" for key in ("choices", "partial") for name in ("logprob", "top.logprob")
)
_KNOWN_FLOATS: Final = _float_fields(Envelope) == _OTHER_FLOATS | _LOGPROB_FLOATS


def _other_floats_plain(envelope: Envelope) -> bool:
    """Whether msgspec writes every float of `envelope` outside its logprobs as ``repr`` does."""
    if not _KNOWN_FLOATS:
        return False
    t = envelope.outcome.timings
    values = [t.upstream_ms, t.first_token_ms or 0.0, t.added_ms or 0.0]
    s = envelope.sampling
    if s is not None:
        values += (s.temperature, s.top_p, s.min_p, s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
        values += s.logit_bias.values()
    return all(type(v) is int or (type(v) is float and is_plain_float(v)) for v in values)


def _joined(envelope: Envelope, key: str, texts: Sequence[str | None]) -> bytes:
    """The envelope's canonical bytes with choice i's ``logprobs`` written as ``texts[i]`` (None: as in the record).

    One encoding pass: each such ``logprobs`` is dumped as a marker string (``"\\u0000logprobs i\\u0000"`` once
    encoded), which is then replaced by the text. Exact: an unescaped ``"`` only delimits a JSON string, so that
    quoted marker occurs in the output only as a whole string equal to the marker; when it occurs more than
    once (the envelope holds such a string itself) the parts are joined member by member instead.
    """
    data = envelope.model_dump(mode="json", exclude_none=True, exclude={"outcome": {key: {"__all__": {"logprobs"}}}})
    members = data["outcome"][key]
    marks: list[tuple[str, str]] = []
    for i, (member, text) in enumerate(zip(members, texts, strict=True)):
        if text is not None:
            member["logprobs"] = marker = f"\x00logprobs {i}\x00"
            marks.append((encode_string(marker), text))
    out = canonical_text_of_plain(data) if _other_floats_plain(envelope) else canonical_text(data)
    if all(out.count(quoted) == 1 for quoted, _ in marks):
        for quoted, text in marks:
            out = out.replace(quoted, text)
        return out.encode("utf-8")
    return _joined_by_member(data, key, texts)


def _joined_by_member(data: dict[str, Any], key: str, texts: Sequence[str | None]) -> bytes:
    """`_joined` with `canonical_object_with` at each level (no marker; slower: several encoding passes)."""
    out = data.pop("outcome")
    parts = []
    for member, text in zip(out.pop(key), texts, strict=True):
        member.pop("logprobs", None)
        parts.append(canonical_object_with(member, "logprobs", text) if text is not None else canonical_text(member))
    outcome_text = canonical_object_with(out, key, "[" + ",".join(parts) + "]")
    return canonical_object_with(data, "outcome", outcome_text).encode("utf-8")
