"""The ``matrix`` and ``explain`` commands' argument handling (exit 2, one line), and `EnvelopeStore.list_envelopes`
(moto). The runs themselves are exercised for real in test_matrix_stack.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infra.cli.root import build_app
from replayer.errors import StoreError
from replayer.matrix.cli import s3_prefix
from replayer.store import EnvelopeStore
from schemas import CapturedError, Timings
from tests import factories
from tests.replayer.support import make_envelope, moto_s3, seed_envelope


def _run(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(build_app(), list(args))
    return result.exit_code, result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("matrix", "--cells", "batch,bogus"), "unknown dimension(s) bogus"),
        (("matrix", "--workload", "--envelopes", "x.jsonl"), "give one input"),
        (("matrix", "--baseline", "later"), "--baseline must be recorded or single"),
        (("explain", "r1", "--variations", "alone,psychic"), "unknown variation(s) psychic"),
    ],
)
def test_bad_arguments_exit_2_with_one_line(args: tuple[str, ...], message: str, tmp_path: Path) -> None:
    envs = tmp_path / "e.jsonl"
    envs.write_text(factories.envelope(request_id="r1").model_dump_json() + "\n")
    if args[0] == "explain":
        args = (*args, "--envelopes", str(envs))
    code, out = _run(*args)
    assert code == 2
    assert message in out


def test_explain_unknown_or_unreplayable_request_exits_2(tmp_path: Path) -> None:
    err = CapturedError(
        error_type="timeout", message="t", timings=Timings(received_at=factories.FIXED_TIME, upstream_ms=1)
    )
    envs = tmp_path / "e.jsonl"
    envs.write_text(
        factories.envelope(request_id="ok").model_dump_json() + "\n\n"
        + factories.envelope(request_id="broken", outcome=err).model_dump_json() + "\n"
    )  # fmt: skip
    code, out = _run("explain", "missing", "--envelopes", str(envs))
    assert (code, "no envelope with request id 'missing'" in out) == (2, True)
    code, out = _run("explain", "broken", "--envelopes", str(envs))
    assert (code, "not replayable" in out) == (2, True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"request_id": 1}\n')
    code, out = _run("explain", "x", "--envelopes", str(bad))
    assert code == 2
    assert "bad.jsonl:1" in out


def test_s3_prefix_forms() -> None:
    want = "envelopes/tenant=acme/date=2026-11-29/"
    assert s3_prefix("acme/2026-11-29") == want
    assert s3_prefix("tenant=acme/date=2026-11-29") == want
    assert s3_prefix("envelopes/tenant=acme/date=2026-11-29") == want
    with pytest.raises(ValueError, match="TENANT/YYYY-MM-DD"):
        s3_prefix("acme")


def test_list_envelopes_reads_one_tenant_day() -> None:
    with moto_s3() as s3:
        client = s3.client()
        day = [make_envelope(i, prefix="lst") for i in range(3)]
        other_day = make_envelope(9, prefix="lst", captured_at=factories.FIXED_TIME + timedelta(days=1))
        for env in (*day, other_day):
            seed_envelope(client, s3.bucket, env)
        store = EnvelopeStore(client, s3.bucket)
        got = store.list_envelopes(s3_prefix(f"{day[0].tenant}/2026-07-14"))
        assert sorted(e.request_id for e in got) == sorted(e.request_id for e in day)
        assert store.list_envelopes("envelopes/tenant=nobody/") == []
        everyone = store.list_envelopes("envelopes/", contains="/date=2026-07-15/")
        assert [e.request_id for e in everyone] == [other_day.request_id]


def test_scan_envelopes_sets_undecodable_objects_apart() -> None:
    with moto_s3() as s3:
        client = s3.client()
        env = make_envelope(1, prefix="scan")
        seed_envelope(client, s3.bucket, env)
        odd = f"envelopes/tenant=enc/date=2026-07-14/{'f' * 64}.json"
        client.put_object(Bucket=s3.bucket, Key=odd, Body=b'{"ciphertext": "x"}')
        store = EnvelopeStore(client, s3.bucket)
        got, bad = store.scan_envelopes("envelopes/", contains="/date=2026-07-14/")
        assert [e.request_id for e in got] == [env.request_id]
        assert [k for k, _ in bad] == [odd]
        with pytest.raises(StoreError, match="does not decode"):
            store.list_envelopes("envelopes/")
