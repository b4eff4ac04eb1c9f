"""The console's parts without a stack: operator keys, sessions, forms, the replay view, chart embedding, and the
gate (login, roles, tenant scope, CSRF, the access log) through Starlette's test client over in-memory records.

The browser tests on the real stack (tests/infra/test_console_browser_stack.py) prove the same gate end to end;
these fail fast and name the part that broke."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest
from starlette.testclient import TestClient

from capture.audit.access_log import AccessLog
from capture.audit.operators import OPERATOR_KEYS
from capture.ledger.errors import KeyFileError, LedgerStoreError
from capture.ledger.key_file import new_key, write_key_file
from infra.console import charts, forms
from infra.console.app import Console, build_console_app
from infra.console.operators import Operator, OperatorKeys
from infra.console.records import Filters, Hold, Inclusion, NotVisible, RequestRecord, Row, SearchPage
from infra.console.replay_now import ReplayNowError
from infra.console.request_view import replay_view
from infra.console.sessions import SessionStore
from replayer.compare import compare
from replayer.settings import Thresholds
from schemas import DivergenceEvent, ReplayedOutput, ReplayResult
from schemas.access_log import decode_access_record
from schemas.layout import hold_decisions_prefix
from tests import factories
from tests.replayer.support import LANE_FINGERPRINT, flip


def new_operator_key(key_id: str, tenant: str | None, roles: list[str]) -> tuple[str, dict[str, Any]]:
    return new_key(OPERATOR_KEYS, key_id, tenant, roles)


def test_a_key_proves_itself_and_nothing_else_does(tmp_path: Path) -> None:
    """The console proves keys with the operator store of `reprolane keys operator` (`capture.ledger.key_file`)."""
    key, entry = new_operator_key("auditor", "acme", ["viewer"])
    path = tmp_path / "keys.json"
    write_key_file(path, [entry])
    keys = OperatorKeys.load(path)
    assert keys.prove(key) == Operator("auditor", "acme", frozenset({"viewer"}))
    assert keys.prove(key[:-1] + ("A" if key[-1] != "A" else "B")) is None
    assert keys.prove("rlo_auditor_") is None
    assert keys.prove("rlk_auditor_x") is None
    assert keys.prove("rlo_" + "x" * 300) is None
    assert keys.still(Operator("auditor", "acme", frozenset({"viewer"})))
    assert not keys.still(Operator("auditor", "acme", frozenset({"viewer", "hold-admin"})))
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match="REPROLANE_OPERATOR_KEYS_PATH"):
        OperatorKeys.load(path)


def test_a_hold_admin_may_view_and_a_viewer_may_not_hold() -> None:
    admin = Operator("a", None, frozenset({"hold-admin"}))
    viewer = Operator("v", "acme", frozenset({"viewer"}))
    assert admin.may("viewer")
    assert admin.may("hold-admin")
    assert not viewer.may("hold-admin")
    assert viewer.sees("acme")
    assert not viewer.sees("other")
    assert admin.sees("other")


def test_sessions_end_when_idle_or_old_and_are_bounded() -> None:
    now = [0.0]
    store = SessionStore(idle_s=10, max_s=25, max_sessions=2, clock=lambda: now[0])
    op = Operator("a", None, frozenset({"viewer"}))
    sid, _ = store.open(op)
    now[0] = 9
    assert store.get(sid) is not None
    now[0] = 18
    assert store.get(sid) is not None  # seen at 9: not idle yet
    now[0] = 26
    assert store.get(sid) is None  # older than max_s
    first, _ = store.open(op)
    store.open(op)
    store.open(op)
    assert store.get(first) is None  # the oldest was dropped
    assert store.get(None) is None
    assert store.get("x" * 500) is None


def test_forms_refuse_what_is_not_an_id_a_verdict_or_a_time() -> None:
    f = forms.filters({"request_id": " rl-1 ", "verdict": "diverged", "since": "2026-12-01", "runtime": "ABCD12"})
    assert f.request_id == "rl-1"
    assert f.runtime == "abcd12"
    assert f.since is not None
    assert f.since.tzinfo is not None
    for bad, field_name in (
        ({"request_id": "a b"}, "request_id"),
        ({"tenant": "'; DROP"}, "tenant"),
        ({"verdict": "maybe"}, "verdict"),
        ({"since": "yesterday"}, "since"),
        ({"since": "2026-12-02", "until": "2026-12-01"}, "until"),
        ({"runtime": "x y"}, "runtime"),
        ({"workflow_id": "w" * 300}, "workflow_id"),
    ):
        with pytest.raises(forms.FormError, match=f"^{field_name}"):
            forms.filters(bad)


def forked_result(at: int = 1) -> tuple[Any, ReplayResult]:
    env = factories.envelope()
    choice = env.outcome.choices[0]
    recorded = ReplayedOutput(token_ids=choice.token_ids, text=choice.text, logprobs=choice.logprobs)
    replayed = flip(recorded, at)
    result = compare(choice, replayed, Thresholds(), env.target_level)
    event = DivergenceEvent(
        request_id=env.request_id, envelope_id=env.envelope_id(), lane="fake", lane_fingerprint=LANE_FINGERPRINT,
        lane_fingerprint_sha256=LANE_FINGERPRINT.sha256(), verdict=result.verdict, levels_held=result.levels_held,
        target_level=env.target_level, target_met=result.target_met, first_divergence=result.first_divergence,
        token_match_rate=result.token_match_rate, recorded_length=result.recorded_length,
        replayed_length=result.replayed_length, length_diff=result.length_diff, cause_hint=result.cause_hint,
        replayed_at=factories.FIXED_TIME, replay_ms=1.0,
    )  # fmt: skip
    return env, ReplayResult(event=event, replayed=replayed)


def test_the_replay_view_marks_the_fork_and_sets_both_top_k_side_by_side() -> None:
    env, result = forked_result(at=1)
    view = replay_view(env, result, spell=lambda i: f"<{i}>")
    assert view.fork == 1
    assert view.recorded is not None
    assert view.replayed is not None
    steps = env.outcome.choices[0].logprobs
    assert view.recorded.before == steps[0].token
    assert view.recorded.at == steps[1].token
    assert view.replayed.at == steps[1].top[1].token
    assert [t.title for t in view.tables] == ["the step before the fork", "at the fork"]
    at = view.tables[1]
    assert at.rows[0].recorded.endswith(f"({steps[1].top[0].token_id})")
    assert at.rows[0].replayed.endswith(f"({steps[1].top[1].token_id})")
    assert view.positions == [0, 1]


def test_chart_json_cannot_end_its_script_block() -> None:
    embedded = charts.embed(json.dumps({"name": "</script><script>alert(1)</script>&"}))
    assert "<" not in embedded
    assert ">" not in embedded
    assert json.loads(embedded)["name"] == "</script><script>alert(1)</script>&"
    assert charts.plotly_js().name == "plotly.min.js"


# -- the gate, over in-memory records --------------------------------------------------------------------------


@dataclass
class MemoryLedger:
    """`capture.ledger.store.LedgerStore`'s put_new, in memory; `fail` makes every write fail."""

    objects: dict[str, bytes] = field(default_factory=dict)
    fail: bool = False
    error = LedgerStoreError

    def put_new(self, key: str, body: bytes, retain_until: Any = None) -> bool:
        if self.fail:
            raise LedgerStoreError("s3 put: down")
        if key in self.objects:
            return False
        self.objects[key] = body
        return True

    def records(self) -> list[Any]:
        return [decode_access_record(b) for b in self.objects.values()]


@dataclass
class MemoryRecords:
    """The one request of `forked_result` (tenant acme-insurance), holdable."""

    env: Any
    result: ReplayResult
    held: bool = False
    signer: Any = None
    matches: int = 0  # how many rows a search matches
    asked: list[tuple[int, int]] = field(default_factory=list)  # (page, per_page) of each search
    store: Any = None  # the envelope store "replay now" reads the result from (`StubReplay` does not)

    def _mine(self, request_id: str, scope: str | None) -> Any:
        if request_id != self.env.request_id or (scope is not None and scope != self.env.tenant):
            raise NotVisible(request_id)
        return self.env

    def request(self, request_id: str, scope: str | None) -> RequestRecord:
        env = self._mine(request_id, scope)
        return RequestRecord(env, [self.result], Inclusion(True, ["leaf 0"], []), Hold("k", "v", self.held, None))

    def envelope(self, request_id: str, scope: str | None) -> Any:
        return self._mine(request_id, scope)

    def set_hold(self, envelope: Any, on: bool) -> None:
        self.held = on

    def search(self, filters: Filters, scope: str | None, page: int, per_page: int) -> SearchPage:
        self.asked.append((page, per_page))
        env = self.env
        start = (page - 1) * per_page
        rows = [Row(f"rl-{i}", f"client-{i}", env.tenant, env.captured_at, env.model, None, None, "")
                for i in range(start, min(start + per_page, self.matches))]  # fmt: skip
        return SearchPage(rows, self.matches, page, per_page, "lake")

    def evidence(self, envelope: Any) -> bytes:
        return b"PK\x05\x06" + envelope.request_id.encode()


@pytest.fixture
def gate(tmp_path: Path) -> Any:
    env, result = forked_result()
    keys, entries = {}, []
    for name, tenant, roles in (("viewer", None, ["viewer"]), ("admin", None, ["hold-admin"]),
                                ("other", "other-tenant", ["hold-admin"]), ("keys", None, ["key-admin"])):  # fmt: skip
        keys[name], entry = new_operator_key(name, tenant, roles)
        entries.append(entry)
    write_key_file(tmp_path / "keys.json", entries)
    ledger = MemoryLedger()
    records = MemoryRecords(env, result)
    console = Console(records, AccessLog(ledger), SessionStore(idle_s=60, max_s=600), tmp_path / "keys.json")  # type: ignore[arg-type]
    return console, keys, ledger, records


def log_in(client: TestClient, key: str) -> Any:
    form = client.get("/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', form.text)
    assert csrf is not None
    return client.post("/login", data={"csrf": csrf.group(1), "token": key}, follow_redirects=False)


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None
    return found.group(1)


#: A hold form as a hold-admin fills it in: a case number, a reason, the box ticked.
HOLD = {"action": "add", "case": "LIT-2026-0142", "reason": "litigation hold, counsel's letter", "confirm": "yes"}


def login_for(path: str) -> str:
    """Where the gate sends a browser without a session that asked for `path`: the login, which returns there."""
    return "/login?" + urlencode({"next": path})


def test_the_gate(gate: Any) -> None:
    console, keys, ledger, records = gate
    rid = records.env.request_id
    app = build_console_app(console)
    with TestClient(app, base_url="http://127.0.0.1") as anon:
        assert anon.get(f"/requests/{rid}", follow_redirects=False).headers["location"] == login_for(f"/requests/{rid}")
        assert anon.post(f"/requests/{rid}/hold", data={"action": "add"}).status_code == 401
        evidence = f"/requests/{rid}/evidence"
        assert anon.get(evidence, follow_redirects=False).headers["location"] == login_for(evidence)
        assert log_in(anon, "rlo_viewer_nope").status_code == 401
        assert anon.post("/login", data={"token": keys["viewer"]}).status_code == 403  # no login CSRF token
        assert log_in(anon, keys["keys"]).status_code == 401  # neither viewer nor hold-admin
    with TestClient(app, base_url="http://127.0.0.1") as viewer:
        ok = log_in(viewer, keys["viewer"])
        assert ok.status_code == 303
        cookie = ok.headers["set-cookie"]
        assert "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "samesite=strict" in cookie.lower()
        page = viewer.get(f"/requests/{rid}")
        assert page.status_code == 200
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert '<mark class="fork"' in page.text
        refused = viewer.post(f"/requests/{rid}/hold", data={**HOLD, "csrf": csrf_of(page.text)})
        assert refused.status_code == 403
        assert not records.held
        bundle = viewer.get(f"/requests/{rid}/evidence")
        assert bundle.status_code == 200
        assert bundle.headers["content-type"] == "application/zip"
        assert bundle.headers["content-disposition"] == f'attachment; filename="evidence-{rid}.zip"'
        assert bundle.content == b"PK\x05\x06" + rid.encode()
    with TestClient(app, base_url="http://127.0.0.1") as admin:
        log_in(admin, keys["admin"])
        page = admin.get(f"/requests/{rid}")
        assert admin.post(f"/requests/{rid}/hold", data={"action": "add"}).status_code == 403  # no CSRF token
        assert admin.post(f"/requests/{rid}/hold", data={"action": "add", "csrf": "x" * 43}).status_code == 403
        assert not records.held
        placed = admin.post(f"/requests/{rid}/hold", data={**HOLD, "csrf": csrf_of(page.text)}, follow_redirects=False)
        assert placed.status_code == 303
        assert records.held
        assert admin.post(f"/requests/{rid}/hold", content=b"a=" + b"x" * 20_000).status_code == 413
        assert admin.post(f"/requests/{rid}/hold", content=b"&".join([b"a=1"] * 40)).status_code == 400
        ledger.fail = True  # the access log cannot be written: nothing is done
        lift = {**HOLD, "action": "remove", "csrf": csrf_of(page.text)}
        assert admin.post(f"/requests/{rid}/hold", data=lift).status_code == 503
        assert records.held
        ledger.fail = False
    with TestClient(app, base_url="http://127.0.0.1") as other:
        log_in(other, keys["other"])
        assert other.get(f"/requests/{rid}").status_code == 404
        assert other.get(f"/requests/{rid}/evidence").status_code == 404  # another tenant's: no bundle
        assert other.get("/requests/rl-does-not-exist").status_code == 404
    with TestClient(app, base_url="http://127.0.0.1") as survivor:
        log_in(survivor, keys["viewer"])
        assert survivor.get(f"/requests/{rid}").status_code == 200
        write_key_file(console.keys_path, [])  # every key revoked: a live session ends on its next request
        ended = survivor.get(f"/requests/{rid}", follow_redirects=False)
        assert ended.headers["location"] == login_for(f"/requests/{rid}")
        assert log_in(survivor, keys["viewer"]).status_code == 401

    log = ledger.records()
    decisions = {(r.action, r.actor_key_id, r.result) for r in log}
    assert ("view.request", None, "refused") in decisions
    assert ("login", None, "refused") in decisions
    assert ("login", "keys", "refused") in decisions
    assert ("hold.add", "viewer", "refused") in decisions
    assert ("hold.add", "admin", "allowed") in decisions
    assert ("view.request", "other", "refused") in decisions
    assert ("evidence.download", "viewer", "allowed") in decisions
    assert ("evidence.download", "other", "refused") in decisions
    assert ("view.request", "admin", "allowed") in decisions  # a hold-admin may view (`role_grants`)
    assert all(r.peer == "testclient" for r in log)  # the console keeps the client's address
    assert any(r.reason == "missing or wrong CSRF token" and r.actor_key_id == "admin" for r in log)
    assert not any(r.action == "hold.remove" and r.result == "allowed" for r in log)
    assert any(r.reason == "the session's key was revoked" for r in log)


# -- deep links, holds, search pages ---------------------------------------------------------------------------


def login_with(client: TestClient, key: str, location: str) -> Any:
    """Follow the gate's redirect `location` to the login form and log in from it (its hidden fields kept)."""
    form = client.get(location)
    assert form.status_code == 200
    data = {"csrf": csrf_of(form.text), "token": key}
    kept = re.search(r'name="next" value="([^"]+)"', form.text)
    if kept is not None:
        data["next"] = html.unescape(kept.group(1))
    return client.post("/login", data=data, follow_redirects=False)


def test_a_deep_link_is_kept_through_the_login(gate: Any) -> None:
    console, keys, _, records = gate
    app = build_console_app(console)
    for asked in (f"/requests/{records.env.request_id}", "/search?tenant=acme-insurance&verdict=diverged&page=2"):
        with TestClient(app, base_url="http://127.0.0.1") as client:
            to_login = client.get(asked, follow_redirects=False)
            assert to_login.headers["location"] == login_for(asked)
            done = login_with(client, keys["viewer"], to_login.headers["location"])
            assert done.status_code == 303
            assert done.headers["location"] == asked  # back where the link pointed, not /search
    foreign_ones = ("//evil.example/x", "https://evil.example/", "/\\evil.example", "/login", "/logout",
                    "javascript:alert(1)", "/requests/x\r\nSet-Cookie: a=b", "/search#x", "/" + "a" * 3000)  # fmt: skip
    for foreign in foreign_ones:
        with TestClient(app, base_url="http://127.0.0.1") as client:
            form = client.get("/login", params={"next": foreign})
            assert 'name="next"' not in form.text
            done = client.post("/login", data={"csrf": csrf_of(form.text), "token": keys["viewer"], "next": foreign},
                               follow_redirects=False)  # fmt: skip
            assert done.headers["location"] == "/search"


def test_a_hold_takes_a_reason_or_case_and_a_confirmation_and_a_reload_does_not_post_again(gate: Any) -> None:
    console, keys, ledger, records = gate
    rid = records.env.request_id
    app = build_console_app(console)
    with TestClient(app, base_url="http://127.0.0.1") as admin:
        log_in(admin, keys["admin"])
        csrf = csrf_of(admin.get(f"/requests/{rid}").text)
        for change, why in (
            ({"reason": " ", "case": ""}, "needs a reason or a case number"),
            ({"confirm": ""}, "confirm"),
            ({"case": "<b>x</b>"}, "case"),
            ({"reason": "x" * 501}, "reason"),
            ({"reason": "a\x00b"}, "reason"),
            ({"action": "toggle"}, "action"),
        ):
            refused = admin.post(f"/requests/{rid}/hold", data={**HOLD, **change, "csrf": csrf})
            assert refused.status_code == 400, change
            assert why in refused.text
            assert not records.held
        placed = admin.post(f"/requests/{rid}/hold", data={**HOLD, "csrf": csrf}, follow_redirects=False)
        assert placed.status_code == 303
        assert placed.headers["location"] == f"/requests/{rid}?done=hold-placed#legal-hold"
        assert records.held
        for _ in range(2):  # the page and its reload: GETs, the hold is not posted again
            shown = admin.get(placed.headers["location"])
            assert shown.status_code == 200
            assert '<p class="notice" id="notice">legal hold placed</p>' in shown.text
        assert 'id="notice"' not in admin.get(f"/requests/{rid}?done=%3Cscript%3E").text  # only fixed texts
    filed = [k for k in ledger.objects if k.startswith(hold_decisions_prefix(records.env.envelope_id()))]
    logged = [decode_access_record(b) for k, b in ledger.objects.items() if k not in filed]
    holds = [r for r in logged if r.action == "hold.add" and r.result == "allowed"]
    assert len(holds) == 1
    assert (holds[0].case, holds[0].note) == (HOLD["case"], HOLD["reason"])
    assert len(filed) == 1  # the decision, filed under the envelope it holds: the record page reads it back
    assert decode_access_record(ledger.objects[filed[0]]) == holds[0]


def test_search_pages_link_to_each_other_and_say_how_many_match(gate: Any) -> None:
    console, keys, _, records = gate
    records.matches = 120
    console.search_limit = 50
    app = build_console_app(console)
    with TestClient(app, base_url="http://127.0.0.1") as viewer:
        log_in(viewer, keys["viewer"])
        assert 'id="results"' not in viewer.get("/search").text  # the bare page waits for a search
        empty = viewer.get("/search?request_id=&tenant=&verdict=")  # submitted with nothing filled in
        assert "120 requests match (no filter: every request you may see, newest first)" in empty.text
        assert "showing 1\N{EN DASH}50" in empty.text
        first = viewer.get("/search?tenant=acme-insurance&verdict=diverged")
        assert "120 requests match; showing 1\N{EN DASH}50, page 1 of 3" in first.text
        assert 'href="/search?tenant=acme-insurance&amp;verdict=diverged&amp;page=2" id="page-next"' in first.text
        assert 'id="page-prev"' not in first.text
        last = viewer.get("/search?tenant=acme-insurance&verdict=diverged&page=3")
        assert "showing 101\N{EN DASH}120, page 3 of 3" in last.text
        assert 'id="page-next"' not in last.text
        assert last.text.count("<tr>") == 1 + 20  # the header and the page's rows
        assert "<td>client-107</td>" in last.text  # the client request id column
        assert viewer.get("/search?page=0").status_code == 400
        assert viewer.get("/search?page=abc").status_code == 400
        assert viewer.get("/search?page=99999999999").status_code == 400
    assert records.asked[-1] == (3, 50)


@dataclass
class StubReplay:
    """`infra.console.replay_now.ReplayPublisher`'s surface: answers, or says why not (`why`)."""

    why: str | None = None
    group_id: str = "reprolane-replayer"
    asked: list[str] = field(default_factory=list)

    def replay(self, envelope: Any, store: Any) -> str:
        self.asked.append(envelope.request_id)
        if self.why is not None:
            raise ReplayNowError(self.why)
        return "replayed by the replayer service (group g): bitwise on lane schedule, target token met"


def reason(page: str, element_id: str) -> str:
    """The text of the element `element_id` (a reason shown on the page, not in an attribute)."""
    found = re.search(rf'<p class="[a-z]+" id="{element_id}">(.*?)</p>', page, re.S)
    assert found is not None, element_id
    return re.sub(r"<[^>]+>", "", found.group(1))


def test_an_action_that_cannot_run_says_why_on_the_page(gate: Any) -> None:
    """Issue 30: without a replay-request key "replay now" is off and without the audit signing key "download
    evidence" is off, each with its reason as page text (not a tooltip); with a key, the click says what the
    replayer service answered, or why it did not."""
    console, keys, _, records = gate
    rid = records.env.request_id
    with TestClient(build_console_app(console), base_url="http://127.0.0.1") as viewer:
        log_in(viewer, keys["viewer"])
        page = viewer.get(f"/requests/{rid}").text
        assert reason(page, "replay-reason").startswith("Replay now is off: this console holds no replay-request key")
        assert "REPROLANE_CONSOLE_REPLAY_KEYS_PATH" in reason(page, "replay-reason")
        assert reason(page, "evidence-hint").startswith("Download evidence is off: this console holds no audit")
        assert re.search(r'<button type="button" id="download-evidence" disabled>', page)
        assert "title=" not in re.sub(r".*<h2>Actions</h2>", "", page, flags=re.S).split("</section>")[0]
        refused = viewer.post(f"/requests/{rid}/replay", data={"csrf": csrf_of(page)})
        assert refused.status_code == 409
        assert "not replayed: this console holds no replay-request key" in refused.text

        console.replay = StubReplay(why="no replayer service is running (no recent heartbeat of group g on t)")
        page = viewer.get(f"/requests/{rid}").text
        assert "waits for its verdict" in reason(page, "replay-reason")
        answered = viewer.post(f"/requests/{rid}/replay", data={"csrf": csrf_of(page)})
        assert answered.status_code == 200
        assert "not replayed: no replayer service is running" in answered.text
        console.replay = StubReplay()
        answered = viewer.post(f"/requests/{rid}/replay", data={"csrf": csrf_of(page)})
        assert "replayed by the replayer service (group g): bitwise" in answered.text
        assert console.replay.asked == [rid]
