"""The console's search over the lake (`infra.console.records.Records.search`, Parquet on a local filesystem, the
archiver's own writer): counts and pages, the client request id shown and searched without a tenant, an empty
search listing the newest requests; and the search form's edge (`infra.console.forms`)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import pytest

from capture.audit.lake.archiver import Archiver
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from infra.console import forms
from infra.console.records import Filters, Records
from tests.factories import FIXED_TIME, envelope

SETTINGS = LakeSettings(flush_rows=1000, flush_seconds=3600)


@pytest.fixture
async def records(tmp_path: Path) -> Records:
    """A lake of 7 requests of acme (client ids order-0..6, the newest last) and 2 of globex, one of which
    reuses acme's client id order-3 (a client id is its tenant's label)."""
    lake = Lake(pafs.LocalFileSystem(), str(tmp_path), "lake")
    archiver = Archiver(SETTINGS, lake)
    at = [FIXED_TIME + timedelta(minutes=i) for i in range(7)]
    envelopes = [
        envelope(request_id=f"rl-acme-{i}", client_request_id=f"order-{i}", workflow=None, captured_at=at[i])
        for i in range(7)
    ]
    envelopes += [
        envelope(request_id="rl-globex-0", tenant="globex", client_request_id="order-3", workflow=None),
        envelope(request_id="rl-globex-1", tenant="globex", client_request_id=None, workflow=None),
    ]
    for env in envelopes:
        assert archiver.add(SETTINGS.envelope_topic, env.canonical())
    await archiver.flush()
    # the lake's rows only: nothing here may reach the store or the audit bucket
    return Records(store=None, audit=None, lake=lake, public_key=None)  # type: ignore[arg-type]


def ids(found: Any) -> list[str]:
    return [r.request_id for r in found.rows]


def test_pages_of_a_tenant_newest_first_with_the_count(records: Records) -> None:
    first = records.search(Filters(tenant="acme-insurance"), None, page=1, per_page=3)
    assert (first.total, first.pages, first.first, first.last) == (7, 3, 1, 3)
    assert ids(first) == ["rl-acme-6", "rl-acme-5", "rl-acme-4"]
    assert [r.client_request_id for r in first.rows] == ["order-6", "order-5", "order-4"]
    assert first.source == "lake"
    last = records.search(Filters(tenant="acme-insurance"), None, page=3, per_page=3)
    assert ids(last) == ["rl-acme-0"]
    assert (last.total, last.first, last.last) == (7, 7, 7)
    past = records.search(Filters(tenant="acme-insurance"), None, page=9, per_page=3)
    assert (past.rows, past.total, past.pages) == ([], 7, 3)  # the count comes from its own query


def test_an_empty_search_lists_every_request_in_scope(records: Records) -> None:
    everyone = records.search(Filters(), None, page=1, per_page=50)
    assert everyone.total == 9
    scoped = records.search(Filters(), "globex", page=1, per_page=50)
    assert sorted(ids(scoped)) == ["rl-globex-0", "rl-globex-1"]


def test_a_client_request_id_without_a_tenant_is_searched_in_the_lake_across_tenants(records: Records) -> None:
    found = records.search(Filters(client_request_id="order-3"), None, page=1, per_page=50)
    assert sorted((r.tenant, r.request_id) for r in found.rows) == [
        ("acme-insurance", "rl-acme-3"),
        ("globex", "rl-globex-0"),
    ]
    other = records.search(Filters(client_request_id="order-3", tenant="globex"), "acme-insurance", 1, 50)
    assert (other.rows, other.total) == ([], 0)  # another tenant's, asked by a scoped key: nothing, not even a count


def test_the_search_form_edge() -> None:
    assert forms.page({}) == 1
    assert forms.page({"page": "3"}) == 3
    for bad in ("0", "-1", "1.5", "x", str(forms.MAX_PAGE + 1), "9" * 40):
        with pytest.raises(forms.FormError, match=r"^page"):
            forms.page({"page": bad})
    assert not forms.searched({})
    assert forms.searched({"tenant": ""})
    assert forms.searched({"page": "2"})
    query = forms.search_query({"tenant": " acme ", "verdict": "diverged", "junk": "x", "request_id": ""}, 2)
    assert query == "tenant=acme&verdict=diverged&page=2"  # the form's own fields only, the page replaced


def test_a_login_returns_only_to_a_page_of_this_console() -> None:
    for good in ("/search", "/search?tenant=a&page=2", "/requests/rl-1", "/workflows/w?tenant=t", "/overview"):
        assert forms.next_path(good) == good
    bad_ones = (None, "", "//evil.example", "https://evil.example/search", "/\\evil", "/login", "/logout", "search",
                "/search#top", "/requests/é", "/search?x=\n", "/" + "a" * 3000, "/static/console.js")  # fmt: skip
    for bad in bad_ones:
        assert forms.next_path(bad) is None, bad
