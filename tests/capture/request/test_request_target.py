"""The target the sidecar asks upstream for (`capture.request.edge.request_target`) and the URL it becomes
(`capture.request.upstream.Upstream.url`): always a path on upstream's own scheme, host and port."""

from __future__ import annotations

from typing import Any

import pytest

from capture.errors import CaptureError
from capture.request.edge import BadRequest, request_target
from capture.request.upstream import Upstream


def scope(raw: bytes, query: bytes = b"") -> dict[str, Any]:
    return {"path": raw.decode("latin-1"), "raw_path": raw, "query_string": query}


@pytest.mark.parametrize(
    ("raw", "query", "target"),
    [
        (b"/v1/models", b"", "/v1/models"),
        (b"/v1/models/org%2Fname", b"", "/v1/models/org%2Fname"),  # an escape stays as the client sent it
        (b"/a b\\c#d", b"", "/a%20b%5Cc%23d"),  # what could end or bend the path is escaped
        (b"/caf\xc3\xa9", b"x=1&y=%20z", "/caf%C3%A9?x=1&y=%20z"),
        (b"/x", b"q=a b#c", "/x?q=a%20b%23c"),
        (b"/v1/x..y/.z", b"", "/v1/x..y/.z"),  # dots inside a segment are not dot segments
    ],
)
def test_a_plain_path_is_forwarded_re_quoted(raw: bytes, query: bytes, target: str) -> None:
    assert request_target(scope(raw, query)) == target


@pytest.mark.parametrize(
    "raw",
    [
        b"%2F@10.0.0.5:9000/x",
        b"@10.0.0.5:9000/x",
        b"10.0.0.5:9000/x",
        b"http://10.0.0.5:9000/x",
        b"//10.0.0.5:9000/x",
        b"/%2F10.0.0.5:9000/x",
        b"/%5C10.0.0.5/x",
        b"/\\10.0.0.5/x",
        b"/..%2F..",
        b"/../x",
        b"/a/./b",
        b"/a/%2e%2E/b",
        b"/a\\..\\b",
        b"/x%zz",
        b"/x%4",
        b"",
    ],
)
def test_anything_else_is_a_400(raw: bytes) -> None:
    with pytest.raises(BadRequest) as refused:
        request_target(scope(raw))
    assert refused.value.status == 400


@pytest.mark.parametrize("base", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/prefix/", "https://[::1]/api"])
def test_the_url_is_upstream_s_own(base: str) -> None:
    upstream = Upstream(base, timeout_s=1.0)
    url = upstream.url("/v1/models?x=1")
    own = upstream.url("/")
    assert (url.scheme, url.host, url.port) == (own.scheme, own.host, own.port)
    assert url.raw_path.endswith("/v1/models")
    assert url.raw_path.startswith(own.raw_path.rstrip("/"))
    assert url.raw_query_string == "x=1"


@pytest.mark.parametrize(
    "target", ["%2F@10.0.0.5:9000/x", "@10.0.0.5/x", "//10.0.0.5/x", "/a b", "/a\\b", "/x#y", "http://10.0.0.5/x", ""]
)
def test_a_target_not_quoted_as_a_path_never_becomes_a_url(target: str) -> None:
    with pytest.raises(ValueError, match="upstream"):
        Upstream("http://127.0.0.1:8000", timeout_s=1.0).url(target)


def test_upstream_must_be_an_http_url() -> None:
    with pytest.raises(CaptureError, match="http"):
        Upstream("127.0.0.1:8000", timeout_s=1.0)
