"""The replay-flagging policy: header, tenant list, deterministic sample on the request id."""

from __future__ import annotations

import hashlib

import pytest

from capture.request.policy import NOT_FLAGGED, FlagDecision, ReplayPolicy, header_asks_flag, sample_point


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "on"])
def test_header_values_that_flag(value: str) -> None:
    assert header_asks_flag(value)


@pytest.mark.parametrize("value", [None, "", "0", "false", "no", "maybe"])
def test_header_values_that_do_not_flag(value: str | None) -> None:
    assert not header_asks_flag(value)


def test_rules_in_order_header_then_tenant_then_sample() -> None:
    policy = ReplayPolicy(flag_tenants=["acme"], sample_rate=1.0)
    assert policy.decide(request_id="r1", tenant="acme", flag_header="1") == FlagDecision(True, "header")
    assert policy.decide(request_id="r1", tenant="acme", flag_header=None) == FlagDecision(True, "tenant")
    assert policy.decide(request_id="r1", tenant="other", flag_header="0") == FlagDecision(True, "sample")


def test_nothing_flagged_by_default() -> None:
    policy = ReplayPolicy()
    assert policy.decide(request_id="r1", tenant="default", flag_header=None) is NOT_FLAGGED


def test_sample_point_is_sha256_over_2_pow_256() -> None:
    rid = "req-20260714-001"
    expected = int(hashlib.sha256(rid.encode()).hexdigest(), 16) / 2**256
    assert sample_point(rid) == expected
    assert 0.0 <= sample_point(rid) < 1.0


def test_sample_is_deterministic_and_close_to_rate() -> None:
    policy = ReplayPolicy(sample_rate=0.25)
    ids = [f"req-{i}" for i in range(4000)]
    first = [policy.decide(request_id=r, tenant="t", flag_header=None).flagged for r in ids]
    again = [ReplayPolicy(sample_rate=0.25).decide(request_id=r, tenant="t", flag_header=None).flagged for r in ids]
    assert first == again
    assert 0.22 < sum(first) / len(ids) < 0.28
    for rid, flagged in zip(ids, first, strict=True):
        assert flagged == (sample_point(rid) < 0.25)


def test_rate_zero_and_one() -> None:
    assert not ReplayPolicy(sample_rate=0.0).decide(request_id="x", tenant="t", flag_header=None).flagged
    assert ReplayPolicy(sample_rate=1.0).decide(request_id="x", tenant="t", flag_header=None).reason == "sample"


def test_rate_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="sample_rate"):
        ReplayPolicy(sample_rate=1.5)
