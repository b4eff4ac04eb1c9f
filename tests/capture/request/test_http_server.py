"""`capture.request.http_server`: the server `serve capture` runs has its parser pinned (the same in the dev install
and the image: both install the package's dependencies), its connections and requests bounded and a deadline on
heads."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from capture.cli import build_settings
from capture.request.http_server import Admission, Parser, uvicorn_config

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(("parser", "base"), [("httptools", HttpToolsProtocol), ("h11", H11Protocol)])
def test_the_config_pins_the_parser_and_the_bounds(parser: Parser, base: type) -> None:
    settings = build_settings(
        upstream="http://127.0.0.1:9",
        http_parser=parser,
        max_concurrency=7,
        max_connections=9,
        max_anonymous_per_address=3,
    )
    config = uvicorn_config(object(), settings)
    assert isinstance(config.http, type)
    assert issubclass(config.http, base)
    assert config.limit_concurrency is None  # uvicorn's counts connections: the sidecar's own bounds instead
    admission = config.http.edge_admission
    assert isinstance(admission, Admission)
    assert admission.max_requests == 7
    assert (admission.table.max_connections, admission.table.max_anonymous_per_source) == (9, 3)


def test_httptools_is_the_default_and_a_dependency_of_the_package() -> None:
    assert build_settings(upstream="http://127.0.0.1:9").http_parser == "httptools"
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(d.replace(" ", "").startswith("uvicorn[standard]") for d in deps)  # brings httptools and uvloop
    dockerfile = (REPO / "infra" / "docker" / "Dockerfile.app").read_text()
    assert 'python -c "import infra.cli, httptools' in dockerfile  # the image fails to build without it
