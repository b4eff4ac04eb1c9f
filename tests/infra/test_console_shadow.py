"""The console shows a request's shadow pair (issue 21): the shadow read from its own index entry (moto S3), and
the request page with the candidate's runtime differences, its text cut at the fork and the top-k there, judged
by the shadow report's comparison, every hostile byte escaped."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

from starlette.testclient import TestClient

from capture.audit.access_log import AccessLog
from capture.audit.store import AuditStore
from capture.ledger.key_file import write_key_file
from infra.console.app import Console, build_console_app
from infra.console.records import Hold, Inclusion, Records, RequestRecord
from infra.console.request_view import shadow_view
from infra.console.sessions import SessionStore
from replayer.settings import Thresholds
from replayer.store import EnvelopeStore
from schemas import CapturedError, CapturedOutput, Choice, Envelope, ReplayedOutput, ShadowMarker
from tests import factories
from tests.infra.test_console import MemoryLedger, MemoryRecords, forked_result, log_in, new_operator_key
from tests.replayer.support import S3Target, flip, moto_s3, seed_envelope, seed_shadow

HOSTILE = "<script>alert('shadow')</script>"
CANDIDATE = 'http://127.0.0.1:9/"><img src=x onerror=alert(1)>'


def shadow_of(prod: Envelope, fork_at: int | None = 1, error: bool = False) -> Envelope:
    """The candidate's answer: float32, forking at `fork_at` onto the recorded runner-up, whose token text is
    hostile markup (None: the same answer)."""
    assert isinstance(prod.outcome, CapturedOutput)
    choice = prod.outcome.choices[0]
    recorded = ReplayedOutput(token_ids=choice.token_ids, text=choice.text, logprobs=choice.logprobs)
    out = recorded if fork_at is None else flip(recorded, fork_at)
    steps = list(out.logprobs or ())
    if fork_at is not None:
        top = (steps[fork_at].top[0].model_copy(update={"token": HOSTILE}), *steps[fork_at].top[1:])
        steps[fork_at] = steps[fork_at].model_copy(update={"token": HOSTILE, "top": top})
    text = "".join(s.token or "" for s in steps)
    cand = Choice(index=0, token_ids=out.token_ids, text=text, finish_reason=out.finish_reason, logprobs=tuple(steps))
    outcome: Any = (
        CapturedError(error_type="timeout", message=HOSTILE, timings=prod.outcome.timings)
        if error
        else prod.outcome.model_copy(update={"choices": (cand,)})
    )
    return prod.model_copy(
        update={
            "captured_at": prod.captured_at + timedelta(seconds=3),
            "runtime": prod.runtime.model_copy(update={"dtype": "float32", "max_num_seqs": 64}),
            "outcome": outcome,
            "flagged": False,
            "flag_reason": None,
            "shadow": ShadowMarker(production_envelope_id=prod.envelope_id(), candidate=CANDIDATE),
        }
    )


def test_the_shadow_view_is_the_shadow_reports_judgement_with_the_fork_cut() -> None:
    prod = factories.envelope()
    view = shadow_view(prod, shadow_of(prod), Thresholds())
    assert view is not None
    assert view.candidate == CANDIDATE
    assert [d.field for d in view.runtime_diffs] == ["dtype", "max_num_seqs"]
    assert (view.pair.verdict, view.pair.first_divergence, view.pair.target_met) == ("diverged", 1, False)
    assert view.fork == 1
    assert view.candidate_cut is not None
    assert view.candidate_cut.at == HOSTILE
    assert [t.title for t in view.tables] == ["the step before the fork", "at the fork"]
    same = shadow_view(prod, shadow_of(prod, fork_at=None), Thresholds())
    assert same is not None
    assert (same.pair.verdict, same.fork, same.tables) == ("bitwise", None, [])
    failed = shadow_view(prod, shadow_of(prod, error=True), Thresholds())
    assert failed is not None
    assert failed.pair.candidate_error is not None
    assert failed.candidate_cut is None


def test_records_find_the_shadow_that_names_the_envelope_and_refuse_another() -> None:
    with moto_s3() as s3:
        _find_shadows(s3)


def _find_shadows(s3: S3Target) -> None:
    records = Records(EnvelopeStore(s3.client(), s3.bucket), AuditStore(s3.client(), s3.bucket), None,
                      public_key=None)  # fmt: skip
    prod = factories.envelope(request_id="r-shadowed")
    seed_envelope(s3.client(), s3.bucket, prod)
    assert records.shadow(prod) == (None, None)  # not shadowed
    shadow = shadow_of(prod)
    seed_shadow(s3.client(), s3.bucket, shadow)
    assert records.shadow(prod) == (shadow, None)
    late = factories.envelope(request_id="r-late", captured_at=factories.FIXED_TIME.replace(hour=23, minute=59))
    late_shadow = shadow_of(late).model_copy(update={"captured_at": late.captured_at + timedelta(minutes=2)})
    seed_shadow(s3.client(), s3.bucket, late_shadow)  # captured after midnight: indexed under the next day
    assert records.shadow(late) == (late_shadow, None)
    other = factories.envelope(request_id="r-other")
    stray = shadow_of(other).model_copy(
        update={"shadow": ShadowMarker(production_envelope_id="f" * 64, candidate=CANDIDATE)}
    )
    seed_shadow(s3.client(), s3.bucket, stray)
    found, problem = records.shadow(other)
    assert found is None
    assert problem is not None
    assert "another production envelope" in problem


class ShadowRecords(MemoryRecords):
    shadow: Envelope | None = None

    def request(self, request_id: str, scope: str | None) -> RequestRecord:
        env = self._mine(request_id, scope)
        return RequestRecord(env, [self.result], Inclusion(True, ["leaf 0"], []), Hold("k", "v", False, None),
                             self.shadow)  # fmt: skip


def _page(tmp_path: Path, shadow: Envelope | None) -> str:
    env, result = forked_result()
    key, entry = new_operator_key("viewer", None, ["viewer"])
    write_key_file(tmp_path / "keys.json", [entry])
    records = ShadowRecords(env, result)
    records.shadow = shadow
    console = Console(records, AccessLog(MemoryLedger()), SessionStore(idle_s=60, max_s=600), tmp_path / "keys.json")  # type: ignore[arg-type]
    with TestClient(build_console_app(console), base_url="http://127.0.0.1") as client:
        log_in(client, key)
        page = client.get(f"/requests/{env.request_id}")
        assert page.status_code == 200
        return page.text


def test_the_request_page_shows_the_pair_and_escapes_the_candidate(tmp_path: Path) -> None:
    prod, _ = forked_result()
    text = _page(tmp_path, shadow_of(prod))
    assert 'id="shadow"' in text
    assert "fork at token 1" in text
    assert '<pre class="forked" id="text-shadow-candidate">' in text
    assert "&lt;script&gt;alert(&#39;shadow&#39;)&lt;/script&gt;" in text
    assert HOSTILE not in text
    assert "onerror=alert(1)>" not in text  # the candidate URL, escaped too
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert '<table class="rows diffs" id="shadow-diffs">' in text
    assert "<td>dtype</td><td>bfloat16</td><td>float32</td>" in text
    assert 'id="shadow-topk-1"' in text
    assert 'id="fig-shadow"' in text
    error = _page(tmp_path, shadow_of(prod, error=True))
    assert 'id="shadow-error"' in error
    assert HOSTILE not in error
    assert 'id="no-shadow"' in _page(tmp_path, None)
