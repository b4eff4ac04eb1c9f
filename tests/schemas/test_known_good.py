"""The known-good record: image references split, consistency with its fingerprint and manifest, its key."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import ContractError
from schemas.known_good import check_known_good, decode_known_good, parse_image_ref
from schemas.layout import known_good_key, known_good_prefix
from tests.infra.release.known_good_support import record

DIGEST = "sha256:" + "0f" * 32


@pytest.mark.parametrize(
    ("text", "repository", "tag", "digest"),
    [
        ("vllm/vllm-openai:v0.32.0", "vllm/vllm-openai", "v0.32.0", None),
        (f"ghcr.io/acme/vllm@{DIGEST}", "ghcr.io/acme/vllm", None, DIGEST),
        (f"registry.local:5000/acme/vllm:0.32-cpu@{DIGEST}", "registry.local:5000/acme/vllm", "0.32-cpu", DIGEST),
        ("busybox", "busybox", None, None),
    ],
)
def test_image_references_split_into_repository_tag_and_digest(
    text: str, repository: str, tag: str | None, digest: str | None
) -> None:
    ref = parse_image_ref(text)
    assert (ref.repository, ref.tag, ref.digest) == (repository, tag, digest)
    assert ref.pinned == (f"{repository}@{digest}" if digest else text)


@pytest.mark.parametrize("text", ["", "UPPER/case", "repo:tag@sha256:short", "repo@md5:" + "0" * 32, "a b", "x:"])
def test_bad_image_references_are_contract_errors(text: str) -> None:
    with pytest.raises(ContractError):
        parse_image_ref(text)


def test_record_round_trips_and_its_key_holds_its_id() -> None:
    rec = record("prod")
    back = decode_known_good(rec.canonical())
    assert back == rec
    key = known_good_key("prod", rec.passed_at, rec.record_id())
    assert key.startswith(known_good_prefix("prod"))
    assert key.endswith(f"-{rec.record_id()}.json")
    check_known_good(back, key)


def test_a_record_under_another_key_is_refused() -> None:
    rec, other = record("prod"), record("prod", minutes=5, dtype="float32")
    with pytest.raises(ContractError, match="does not match its key"):
        check_known_good(rec, known_good_key("prod", other.passed_at, other.record_id()))
    with pytest.raises(ContractError, match="does not match its key"):
        check_known_good(rec, known_good_key("staging", rec.passed_at, rec.record_id()))


def test_environment_sha256_must_be_the_fingerprints() -> None:
    rec = record("prod")
    data = rec.model_dump(mode="json")
    data["environment_sha256"] = "0" * 64
    with pytest.raises(ContractError, match="environment_sha256"):
        decode_known_good(__import__("json").dumps(data))


def test_keys_sort_by_passing_time() -> None:
    early = known_good_key("d", datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=UTC), "f" * 64)
    late = known_good_key("d", datetime(2026, 1, 2, 3, 4, 5, 7, tzinfo=UTC), "0" * 64)
    assert early < late
    assert early == f"environments/deployment=d/known-good/20260102T030405000006Z-{'f' * 64}.json"


def test_deployment_names_are_key_safe() -> None:
    data = record("prod").model_dump(mode="json")
    data["deployment"] = "../etc"
    with pytest.raises(ContractError, match="deployment"):
        decode_known_good(__import__("json").dumps(data))
