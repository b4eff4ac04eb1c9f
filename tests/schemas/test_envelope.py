"""The envelope contract: immutability, strictness, canonical bytes and the pinned identity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from schemas import (
    CapturedError,
    ContractError,
    Envelope,
    PromptRecord,
    SamplingContract,
    Timings,
    canonical_bytes,
    decode_envelope,
)
from tests.factories import FIXED_TIME, envelope

GOLDEN = Path(__file__).parent / "golden"
# Pinned identity of golden/envelope_v1.json. If this changes, every stored envelope id changes:
# bump schema_version instead of editing this constant.
GOLDEN_ENVELOPE_ID = "d7bcf6e8829128d113c1da9a39b5c175d6bbe4e963c6857349055f24593a7d33"


def test_golden_vector_bytes_and_id() -> None:
    env = envelope()
    expected = (GOLDEN / "envelope_v1.json").read_bytes()
    assert env.canonical() == expected
    assert env.envelope_id() == GOLDEN_ENVELOPE_ID


def test_golden_vector_decodes_to_the_same_record() -> None:
    env = decode_envelope((GOLDEN / "envelope_v1.json").read_bytes())
    assert env == envelope()
    assert env.envelope_id() == GOLDEN_ENVELOPE_ID


def test_identity_ignores_key_order_and_whitespace() -> None:
    raw = json.loads((GOLDEN / "envelope_v1.json").read_bytes())
    shuffled = json.dumps(dict(reversed(list(raw.items()))), indent=4)
    assert decode_envelope(shuffled).envelope_id() == GOLDEN_ENVELOPE_ID


def test_any_field_change_changes_identity() -> None:
    base = envelope()
    assert envelope(tenant="other").envelope_id() != base.envelope_id()
    changed_prompt = base.prompt.model_copy(update={"token_ids": (1, 9690, 198, 2683, 315)})  # type: ignore[union-attr]
    assert envelope(prompt=changed_prompt).envelope_id() != base.envelope_id()


def test_frozen() -> None:
    env = envelope()
    with pytest.raises(ValidationError):
        env.tenant = "mallory"  # type: ignore[misc]


def test_unknown_field_is_named() -> None:
    raw = json.loads(envelope().canonical())
    raw["sampling"]["temprature"] = 0.5
    with pytest.raises(ContractError) as info:
        decode_envelope(json.dumps(raw))
    assert "sampling.temprature" in info.value.fields
    assert "sampling.temprature" in str(info.value)


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("sampling", "temperature"), -1),
        (("sampling", "top_p"), 0),
        (("sampling", "seed_scope"), "global"),
        (("prompt", "token_ids"), []),
        (("prompt", "token_ids"), [1, -5]),
        (("request_id",), "has space"),
        (("artifacts", "model_sha256"), "not-a-hash"),
        (("outcome", "kind"), "mystery"),
    ],
)
def test_invalid_values_name_their_field(path: tuple[str, ...], value: object) -> None:
    raw = json.loads(envelope().canonical())
    node = raw
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    with pytest.raises(ContractError) as info:
        decode_envelope(json.dumps(raw))
    dotted = ".".join(path)
    assert any(f.startswith(dotted.rsplit(".", 1)[0]) for f in info.value.fields), info.value.fields
    assert path[-1] in str(info.value) or path[0] in str(info.value)


def test_naive_datetime_rejected() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        envelope(captured_at=FIXED_TIME.replace(tzinfo=None))


def test_nan_logprob_rejected() -> None:
    raw = json.loads(envelope().canonical())
    raw["outcome"]["choices"][0]["logprobs"][0]["logprob"] = "NaN"
    with pytest.raises(ContractError, match="logprob"):
        decode_envelope(json.dumps(raw))


def test_error_envelope_round_trip_and_not_replayable() -> None:
    err = CapturedError(
        error_type="client_disconnect",
        message="client went away after 3 chunks",
        timings=Timings(received_at=FIXED_TIME, upstream_ms=5.0),
    )
    env = envelope(outcome=err)
    again = decode_envelope(env.canonical())
    assert again == env
    assert isinstance(again.outcome, CapturedError)
    assert not again.replayable
    assert envelope().replayable


def test_canonical_bytes_are_compact_sorted_utf8() -> None:
    env = envelope(
        outcome=envelope().outcome.model_copy(
            update={"choices": (envelope().outcome.choices[0].model_copy(update={"text": "Paris — café"}),)}  # type: ignore[union-attr]
        )
    )
    data = canonical_bytes(env)
    assert "Paris — café".encode() in data
    assert b": " not in data
    assert b", " not in data
    keys = list(json.loads(data).keys())
    assert keys == sorted(keys)


def test_schema_json_is_exportable() -> None:
    schema = Envelope.model_json_schema()
    assert schema["additionalProperties"] is False
    assert "request_id" in schema["required"]


def test_golden_id_is_plain_sha256_of_the_file() -> None:
    """Any implementation (another language) gets the id by hashing the canonical bytes, nothing more."""
    import hashlib

    assert hashlib.sha256((GOLDEN / "envelope_v1.json").read_bytes()).hexdigest() == GOLDEN_ENVELOPE_ID


def test_nulls_are_omitted_so_new_optional_fields_keep_old_ids() -> None:
    """A record that leaves an optional field unset encodes exactly as if the field did not exist."""
    env = envelope()
    data = json.loads(env.canonical())
    assert "sidecar_id" not in data["context"]  # None in the record
    assert env.context.sidecar_id is None
    data["context"]["sidecar_id"] = None  # an explicit null decodes to the same record and id
    assert decode_envelope(json.dumps(data)).envelope_id() == GOLDEN_ENVELOPE_ID


def test_several_prompts_round_trip_and_leave_other_envelopes_ids_alone() -> None:
    single = envelope()
    several = envelope(more_prompts=(PromptRecord(token_ids=(7, 8), source="upstream"),))
    assert decode_envelope(several.canonical()) == several
    assert several.replayable  # its choice 0 answers `prompt`, as for one prompt
    # an optional field left unset is not written: envelopes of one prompt keep their ids
    assert b"more_prompts" not in single.canonical()
    assert envelope(more_prompts=None).envelope_id() == single.envelope_id()
    with pytest.raises(ValidationError, match="more_prompts"):
        envelope(more_prompts=())


@pytest.mark.parametrize(
    ("temperature", "seed_scope", "unseeded"),
    [(0.8, "worker_global", True), (0.8, "per_request", False), (0.0, "worker_global", False), (0.0, "none", False)],
)
def test_only_a_sampled_contract_without_its_own_seed_is_unseeded(
    temperature: float, seed_scope: str, unseeded: bool
) -> None:
    seed = 7 if seed_scope == "per_request" else None
    contract = SamplingContract(temperature=temperature, seed=seed, seed_scope=seed_scope)  # type: ignore[arg-type]
    assert contract.unseeded is unseeded
