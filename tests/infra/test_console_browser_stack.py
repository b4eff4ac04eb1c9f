"""``reprolane serve console`` in a real browser (Playwright driving Debian's Chromium) against the real stack.

The world (`tests.infra.console_world`): the demo's small workload captured through the real sidecar and vLLM,
one request forked on replay, a signed checkpoint, the lake, and the console in a child process. The browser
logs in, searches the diverged request, sees the fork marked and both top-k tables, places and lifts a legal
hold as hold-admin and is refused as a viewer, downloads the request's evidence bundle and verifies it with the
real ``reprolane audit evidence verify`` against the pinned key fingerprint; an unauthenticated browser, a key of
another tenant and a POST without the CSRF token are refused, and every decision is in the one access log
(`schemas.access_log.AccessRecord` under ``audit/access/``, the CLI's log too) in the bucket.

Set ``REPROLANE_CONSOLE_SCREENSHOTS=docs/console`` to write each page's screenshot there (the README shows them).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from schemas.access_log import AccessRecord, decode_access_record
from schemas.layout import access_log_day_prefix
from schemas.note import key_fingerprint
from tests.cli_process import reprolane
from tests.infra.console_world import FORK_AT, SEARCH_PAGE, SIGNING_KEY, World, build_world, public_of, stop

pytestmark = pytest.mark.stack

CHROMIUM = "/usr/bin/chromium"
SHOTS_ENV = "REPROLANE_CONSOLE_SCREENSHOTS"


@pytest.fixture(scope="module")
def world(stack: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = build_world(stack, tmp_path_factory.mktemp("console"))
    try:
        yield w
    finally:
        stop(w)


@pytest.fixture(scope="module")
def browser(world: World) -> Iterator[Any]:
    """Chromium; after `world`, whose set-up runs asyncio loops: Playwright's sync API holds the thread's loop
    while it runs (so the one Kafka read below runs in a thread of its own)."""
    from playwright.sync_api import sync_playwright

    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium (apt-get install chromium)")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def shot(page: Any, name: str, tmp: Path) -> None:
    path = tmp / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    target = os.environ.get(SHOTS_ENV)
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(target) / f"{name}.png")


def login(browser: Any, world: World, who: str) -> Any:
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.goto(world.url + "/login")
    page.fill("#token", world.keys[who])
    page.click("#login")
    page.wait_for_url(world.url + "/search")
    return page


def fill_hold(page: Any, case: str, reason: str) -> None:
    """Fill in the record page's hold form: a case number and/or a reason, the confirmation ticked."""
    page.fill("#hold-case", case)
    page.fill("#hold-reason", reason)
    page.check("#hold-confirm")


def spelled(world: World, token_id: int) -> str:
    """A token's text by the model's own tokenizer (what the page must show for an id kept without text)."""
    from tokenizers import Tokenizer

    assert world.stack.model_dir is not None
    text = Tokenizer.from_file(str(world.stack.model_dir / "tokenizer.json")).decode([token_id])
    assert text
    return str(text)


def access_records(world: World) -> list[AccessRecord]:
    audit = world.audit()
    day = datetime.now(UTC).strftime("%Y-%m-%d")
    out = []
    for key, _ in audit.list_keys(access_log_day_prefix(day)):
        body = audit.get(key)
        assert body is not None
        out.append(decode_access_record(body))
    return out


def test_login_search_and_the_fork_with_both_top_k_tables(browser: Any, world: World) -> None:
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.goto(world.url + "/login")
    shot(page, "login", world.tmp)
    page.fill("#token", "rlo_auditor_not-the-secret")
    page.click("#login")
    assert "not in the key store" in page.inner_text("#login-error")

    page = login(browser, world, "viewer")
    rid = world.diverged.request_id
    page.fill("input[name=request_id]", rid)
    page.click("#search")
    rows = page.locator("#results tbody tr")
    assert rows.count() == 1
    assert "diverged" in rows.first.inner_text()
    shot(page, "search", world.tmp)

    # the lake's search: tenant, verdict, runtime fingerprint and time range (the archiver's Parquet, via DuckDB)
    env = world.diverged
    since = env.captured_at.astimezone(UTC).replace(second=0, microsecond=0).strftime("%Y-%m-%dT%H:%M")
    lake = browser.new_context().new_page()
    lake.context.add_cookies(page.context.cookies())
    query = f"tenant={env.tenant}&verdict=diverged&runtime={env.runtime.sha256()[:10]}&since={since}"
    lake.goto(f"{world.url}/search?{query}")
    found = lake.locator("#results tbody tr td:first-child").all_inner_texts()
    assert found == [rid]
    lake.goto(f"{world.url}/search?tenant={env.tenant}&verdict=bitwise")
    assert rid not in lake.locator("#results").inner_text()

    page.click(f"#results a:text('{rid}')")
    page.wait_for_url(f"{world.url}/requests/{rid}")
    assert page.inner_text("#request-id") == rid
    assert page.inner_text("#tenant") == world.diverged.tenant
    result = world.results[rid]
    first = result.event.first_divergence
    assert first is not None
    assert first.position == FORK_AT
    # the fork is marked in the recorded and in the replayed text: each side's own token at the fork
    assert world.diverged.outcome.kind == "output"
    recorded_steps = world.diverged.outcome.choices[0].logprobs
    assert recorded_steps is not None
    assert page.inner_text("#text-recorded-1 mark.fork") == recorded_steps[FORK_AT].token
    replayed_id = result.replayed.token_ids[FORK_AT]
    assert replayed_id != world.diverged.outcome.choices[0].token_ids[FORK_AT]
    assert page.inner_text("#text-replayed-1 mark.fork") == spelled(world, replayed_id)
    # both top-k tables: the step before the fork and the fork, recorded and replayed side by side
    before, at = page.locator(f"#topk-1-{FORK_AT - 1}"), page.locator(f"#topk-2-{FORK_AT}")
    assert "the step before the fork" in before.locator("caption").inner_text()
    assert "at the fork" in at.locator("caption").inner_text()
    at_rows = at.locator("tbody tr")
    assert at_rows.count() == len(first.at.recorded_top)
    row1 = at_rows.first.inner_text()
    assert str(first.at.recorded_top[0].token_id) in row1
    assert str(first.at.replayed_top[0].token_id) in row1
    # ids the capture kept without text are spelled with the recorded tokenizer (its sha256 checked)
    assert repr(recorded_steps[FORK_AT].token) in row1
    assert world.prompts[rid] in page.inner_text("#prompt-text")
    assert result.event.cause_hint in page.inner_text("#cause-1")
    page.wait_for_selector("#chart-replay-1 .main-svg")  # plotly drew the per-token logprob difference
    assert page.inner_text("#inclusion").startswith("included")
    shot(page, "request", world.tmp)

    wf = world.workflow[0].workflow
    assert wf is not None
    page.goto(f"{world.url}/workflows/{wf.workflow_id}?tenant={world.workflow[0].tenant}")
    assert page.locator("#steps tbody tr").count() == len(world.workflow)
    assert f"first divergent step: {world.workflow[1].workflow.step if world.workflow[1].workflow else '?'}" in (
        page.inner_text("#first-divergent")
    )
    shot(page, "workflow", world.tmp)

    page.goto(world.url + "/overview")
    for chart in ("verified", "lag_over_time", "rate", "positions", "lag", "gates"):
        page.wait_for_selector(f"#chart-{chart} .main-svg")
    share = re.fullmatch(
        r"(\d+) of (\d+) verifiable envelopes verified \(.*\)\.", page.inner_text("#overview-verified")
    )
    assert share is not None, page.inner_text("#overview-verified")
    assert 0 < int(share[1]) <= int(share[2])  # the world's replayed envelopes, out of its traffic
    labels = page.locator("#chart-verified .textpoint").all_text_contents()
    assert labels
    assert all(re.fullmatch(r"\d+ of \d+ verified", t) for t in labels), labels
    verdicts = page.locator("#gate-runs tbody tr td:nth-child(5)").all_inner_texts()
    assert sorted(verdicts) == ["FAIL", "PASS"]
    shot(page, "overview", world.tmp)


def test_holds_as_hold_admin_and_refused_as_viewer(browser: Any, world: World) -> None:
    rid = world.identical.request_id
    audit = world.audit()
    from schemas.layout import envelope_key

    key = envelope_key(world.identical.envelope_id(), world.identical.tenant, world.identical.captured_at)
    version = audit.current_version(key)
    assert version is not None

    viewer = login(browser, world, "viewer")
    viewer.goto(f"{world.url}/requests/{rid}")
    assert viewer.inner_text("#hold-status") == "off"
    fill_hold(viewer, "LIT-1", "")
    viewer.click("#hold-toggle")
    assert "lacks the 'hold-admin' role" in viewer.inner_text("#message")
    assert not audit.legal_hold(key, version)

    admin = login(browser, world, "admin")
    admin.goto(f"{world.url}/requests/{rid}")
    fill_hold(admin, "", "preserve for the audit")
    admin.click("#hold-toggle")
    assert admin.inner_text("#notice") == "legal hold placed"
    assert admin.inner_text("#hold-status").startswith("ON")
    assert audit.legal_hold(key, version)
    shot(admin, "request-held", world.tmp)
    fill_hold(admin, "", "audit done")
    admin.click("#hold-toggle")
    assert admin.inner_text("#notice") == "legal hold lifted"
    assert admin.inner_text("#hold-status") == "off"
    assert not audit.legal_hold(key, version)

    records = access_records(world)
    mine = [r for r in records if r.target == rid and r.action in ("hold.add", "hold.remove")]
    assert any(r.actor_key_id == "auditor" and r.result == "refused" and r.action == "hold.add" for r in mine)
    assert any(r.actor_key_id == "holds" and r.result == "allowed" and r.action == "hold.add" for r in mine)
    assert any(r.actor_key_id == "holds" and r.result == "allowed" and r.action == "hold.remove" for r in mine)


def test_download_evidence_and_verify_it_offline_with_the_cli(browser: Any, world: World) -> None:
    rid = world.diverged.request_id
    pinned = key_fingerprint(public_of(SIGNING_KEY))  # the published fingerprint, not one taken from the bundle
    page = login(browser, world, "viewer")
    page.goto(f"{world.url}/requests/{rid}")
    assert pinned in page.inner_text("#evidence-hint")
    with page.expect_download() as info:
        page.click("#download-evidence")
    download = info.value
    assert download.suggested_filename == f"evidence-{rid}.zip"
    bundle = world.tmp / download.suggested_filename
    download.save_as(str(bundle))

    env = {k: v for k, v in os.environ.items() if not k.startswith("REPROLANE_")}  # no settings, no stack
    verify = reprolane("audit", "evidence", "verify", str(bundle), "--key-fingerprint", pinned, env=env, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout.startswith("verified")
    assert rid in verify.stdout

    scoped = login(browser, world, "scoped")  # another tenant's key: no bundle, the same 404 as no record
    cookies = {c["name"]: c["value"] for c in scoped.context.cookies()}
    assert httpx.get(f"{world.url}/requests/{rid}/evidence", cookies=cookies).status_code == 404
    anon = httpx.get(f"{world.url}/requests/{rid}/evidence", follow_redirects=False)
    assert anon.headers["location"] == "/login?" + urlencode({"next": f"/requests/{rid}/evidence"})

    records = [r for r in access_records(world) if r.action == "evidence.download" and r.target == rid]
    assert any(r.actor_key_id == "auditor" and r.result == "allowed" and r.tenant == world.diverged.tenant
               and r.peer == "127.0.0.1" for r in records)  # fmt: skip
    assert any(r.actor_key_id == "scoped" and r.result == "refused" for r in records)
    assert any(r.actor_key_id is None and r.result == "refused" for r in records)


def test_unauthenticated_and_cross_tenant_access_is_refused(browser: Any, world: World) -> None:
    rid = world.diverged.request_id
    page = browser.new_context().new_page()
    page.goto(f"{world.url}/requests/{rid}")
    assert page.url.startswith(world.url + "/login?next=")  # no session: the login page, nothing of the record
    assert httpx.post(f"{world.url}/requests/{rid}/hold", data={"action": "add"}).status_code == 401

    scoped = login(browser, world, "scoped")  # a hold-admin of another tenant
    response = scoped.goto(f"{world.url}/requests/{rid}")
    assert response is not None
    assert response.status == 404
    assert rid in scoped.inner_text("#message")
    assert "you may see" in scoped.inner_text("#message")
    scoped.goto(f"{world.url}/search?request_id={rid}")
    assert scoped.locator("#results tbody tr").inner_text() == "nothing found"
    wf = world.workflow[0]
    if wf.tenant != world.scoped_tenant:
        assert wf.workflow is not None
        response = scoped.goto(f"{world.url}/workflows/{wf.workflow.workflow_id}?tenant={wf.tenant}")
        assert response is not None
        assert response.status == 404

    records = access_records(world)
    assert any(r.action == "view.request" and r.target == rid and r.actor_key_id is None and r.result == "refused"
               for r in records)  # fmt: skip
    assert any(r.action == "view.request" and r.target == rid and r.actor_key_id == "scoped" and r.result == "refused"
               for r in records)  # fmt: skip


def test_a_post_without_the_csrf_token_is_refused(browser: Any, world: World) -> None:
    rid = world.identical.request_id
    admin = login(browser, world, "admin")
    cookies = {c["name"]: c["value"] for c in admin.context.cookies()}
    with httpx.Client(base_url=world.url, cookies=cookies) as client:
        assert client.get(f"/requests/{rid}").status_code == 200  # the session is good
        for data in ({"action": "add"}, {"action": "add", "csrf": "forged"}):
            refused = client.post(f"/requests/{rid}/hold", data=data)
            assert refused.status_code == 403
            assert "CSRF" in refused.text
    audit = world.audit()
    from schemas.layout import envelope_key

    key = envelope_key(world.identical.envelope_id(), world.identical.tenant, world.identical.captured_at)
    version = audit.current_version(key)
    assert version is not None
    assert not audit.legal_hold(key, version)
    assert any(r.action == "hold.add" and r.reason == "missing or wrong CSRF token" for r in access_records(world))


def test_replay_now_says_on_the_page_why_nothing_was_replayed(browser: Any, world: World) -> None:
    """The world runs no replayer service: "replay now" asks nobody and says so in words (issue 30); the demo's
    console, whose replayer runs, is answered (tests/infra/demo/test_run.py)."""
    rid = world.diverged.request_id
    page = login(browser, world, "viewer")
    page.goto(f"{world.url}/requests/{rid}")
    assert "asks the running replayer service" in page.inner_text("#replay-reason")
    page.click("#replay-now")
    notice = page.inner_text("#notice")
    assert notice.startswith("not replayed: no replayer service is running"), notice


def result_ids(page: Any) -> list[str]:
    return [t for t in page.locator("#results tbody tr td:first-child").all_inner_texts() if t != "nothing found"]


def all_pages(page: Any) -> tuple[int, list[str]]:
    """The count the first page states, and every request id of every page, following "next" to the end."""
    found = re.match(r"^(\d+) requests? match", page.inner_text("#result-count"))
    assert found is not None, page.inner_text("#result-count")
    ids = result_ids(page)
    while page.locator("#page-next").count():
        assert len(result_ids(page)) == SEARCH_PAGE  # a full page before the last
        page.click("#page-next")
        ids += result_ids(page)
    return int(found.group(1)), ids


def test_an_auditor_follows_a_link_searches_pages_and_holds_with_a_reason(browser: Any, world: World) -> None:
    """The auditor's path on the console's details: a deep link opened without a session lands on the record
    after the login; the client's own request id finds its request (in the lake without a tenant, in the capture
    index with one) and is shown; counts and pages add up; a hold takes a case number and a reason, refuses
    to go without its confirmation, and its page survives a reload (no second hold, the history stays)."""
    env = world.diverged  # held by no other test of the module
    rid, client_id = env.request_id, env.client_request_id
    assert client_id is not None  # the demo's workload sends its own X-Request-Id
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.goto(f"{world.url}/requests/{rid}")
    assert page.url.startswith(f"{world.url}/login?next=")
    assert page.inner_text("#login-next") == f"after the login: /requests/{rid}"
    page.fill("#token", world.keys["admin"])
    page.click("#login")
    page.wait_for_url(f"{world.url}/requests/{rid}")  # where the link pointed, not the search page
    assert page.inner_text("#request-id") == rid

    page.goto(world.url + "/search")
    page.fill("input[name=client_request_id]", client_id)
    page.click("#search")
    assert result_ids(page) == [rid]
    assert client_id in page.locator("#results tbody tr").first.inner_text()
    assert page.inner_text("#result-count").startswith("1 request matches")
    assert "audit lake" in page.inner_text("#result-count")
    page.fill("input[name=tenant]", env.tenant)
    page.click("#search")
    assert result_ids(page) == [rid]
    assert "capture index" in page.inner_text("#result-count")
    shot(page, "search-client-id", world.tmp)

    page.goto(world.url + "/search")
    page.click("#search")  # nothing filled in: every request, newest first, in pages
    total, everyone = all_pages(page)
    assert total == len(everyone) == len(set(everyone)) > SEARCH_PAGE
    assert {rid, world.identical.request_id, *(s.request_id for s in world.workflow)} <= set(everyone)
    page.goto(world.url + "/search")
    page.fill("input[name=tenant]", env.tenant)
    page.click("#search")
    count, mine = all_pages(page)
    assert count == len(mine)
    assert rid in mine
    assert set(mine) < set(everyone)
    shot(page, "search-pages", world.tmp)

    audit = world.audit()
    from schemas.layout import envelope_key

    key = envelope_key(env.envelope_id(), env.tenant, env.captured_at)
    version = audit.current_version(key)
    assert version is not None
    page.goto(f"{world.url}/requests/{rid}")
    page.fill("#hold-case", "LIT-2026-0142")
    page.fill("#hold-reason", "counsel's letter of 1 Dec")
    page.click("#hold-toggle")  # not confirmed: the browser does not send the form
    assert page.url == f"{world.url}/requests/{rid}"
    assert not audit.legal_hold(key, version)
    page.check("#hold-confirm")
    page.click("#hold-toggle")
    page.wait_for_url(f"{world.url}/requests/{rid}?done=hold-placed#legal-hold")
    for _ in range(2):  # the page after the hold, and its reload: a GET, nothing posted again
        assert page.inner_text("#notice") == "legal hold placed"
        assert page.inner_text("#hold-status").startswith("ON")
        (row,) = page.locator("#hold-history tbody tr").all_inner_texts()
        assert "holds" in row
        assert "placed" in row
        assert "LIT-2026-0142" in row
        assert "counsel's letter of 1 Dec" in row
        page.reload()
    assert audit.legal_hold(key, version)
    shot(page, "request-hold-reason", world.tmp)
    placed = [r for r in access_records(world) if r.action == "hold.add" and r.target == rid and r.result == "allowed"]
    stated = [(r.actor_key_id, r.case, r.note) for r in placed]
    assert stated == [("holds", "LIT-2026-0142", "counsel's letter of 1 Dec")]

    page.fill("#hold-case", "LIT-2026-0142")
    page.check("#hold-confirm")
    page.click("#hold-toggle")
    page.wait_for_url(f"{world.url}/requests/{rid}?done=hold-lifted#legal-hold")
    assert page.inner_text("#hold-status") == "off"
    assert not audit.legal_hold(key, version)
    rows = page.locator("#hold-history tbody tr").all_inner_texts()
    assert ["lifted" in rows[0], "placed" in rows[1]] == [True, True]  # newest first

    page.goto(world.url + "/overview")
    page.wait_for_selector("#chart-rate .main-svg")
    labels = page.locator("#chart-rate .textpoint").all_text_contents()  # SVG: no innerText
    assert labels
    assert all(re.fullmatch(r"\d+ of \d+ diverged", t) for t in labels), labels  # the rate's counts, on its points
    assert "diverged" in page.inner_text("#overview-counts")
    shot(page, "overview-rate", world.tmp)
