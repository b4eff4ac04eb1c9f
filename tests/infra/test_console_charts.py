"""The overview's charts say what the data says (`infra.console.charts`): a rate drawn as a rate, labelled with its
counts, never beside a volume bar that dwarfs it; an empty chart says in words that there is nothing to show."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from infra.console import charts


def figure(embedded: str) -> dict[str, Any]:
    doc = json.loads(embedded)
    assert isinstance(doc, dict)
    return doc


def an_hour(replays: int, diverged: int, hour: int = 9) -> dict[str, Any]:
    return {
        "hour": datetime(2026, 12, 1, hour, tzinfo=UTC),
        "model": "qwen",
        "runtime_sha256": "ab" * 32,
        "replays": replays,
        "diverged": diverged,
        "divergence_rate": diverged / replays,
    }


def test_an_hour_of_data_draws_the_rate_visibly_with_its_counts_and_no_volume_bar() -> None:
    fig = figure(charts.divergence_rate_chart([an_hour(412, 0)]))
    traces = fig["data"]
    assert [t["type"] for t in traces] == ["scatter"]  # no "replays" bar on a second axis
    (rate,) = traces
    assert rate["y"] == [0.0]
    assert rate["text"] == ["0 of 412 diverged"]  # the rate's counts, on the point
    assert set(rate["mode"].split("+")) >= {"markers", "text"}
    assert rate["marker"]["size"] >= 8
    layout = fig["layout"]
    assert "yaxis2" not in layout
    low, high = layout["yaxis"]["range"]
    assert low < 0 < 1 < high  # a rate of 0 (or 1) is drawn inside the frame, not on its edge
    assert layout["yaxis"]["tickformat"] == ".0%"


def test_the_rate_of_each_runtime_is_its_own_line_with_its_own_counts() -> None:
    other = {**an_hour(10, 5, hour=10), "runtime_sha256": "cd" * 32}
    fig = figure(charts.divergence_rate_chart([an_hour(4, 1), an_hour(8, 2, hour=10), other]))
    by_name = {t["name"]: t for t in fig["data"]}
    assert len(by_name) == 2
    mine = by_name[f"qwen · runtime {'ab' * 6}"]
    assert mine["x"] == ["2026-12-01 09:00", "2026-12-01 10:00"]
    assert mine["y"] == [0.25, 0.25]
    assert mine["text"] == ["1 of 4 diverged", "2 of 8 diverged"]
    assert by_name[f"qwen · runtime {'cd' * 6}"]["text"] == ["5 of 10 diverged"]


def note_of(fig: dict[str, Any]) -> str:
    (annotation,) = fig["layout"]["annotations"]
    assert fig["layout"]["xaxis"]["visible"] is False
    assert fig["layout"]["yaxis"]["visible"] is False
    assert fig["data"] == []
    return str(annotation["text"])


def test_empty_charts_say_there_is_nothing_to_show_and_draw_no_axes() -> None:
    assert note_of(figure(charts.divergence_rate_chart([]))) == charts.NO_REPLAYS
    assert note_of(figure(charts.position_histogram([], 0))) == charts.NO_REPLAYS
    none_forked = "no divergences: none of the 7 replays forked at a token"
    assert note_of(figure(charts.position_histogram([], 7))) == none_forked
    assert note_of(figure(charts.lag_histogram([]))) == charts.NO_REPLAYS
    assert "no release-gate runs" in note_of(figure(charts.gate_chart([])))
    assert note_of(figure(charts.verified_chart([]))) == charts.NO_TRAFFIC
    unverified = {"hour": datetime(2026, 12, 1, 9, tzinfo=UTC), "envelopes": 3, "verified": 0, "lag_p50": None,
                  "lag_p95": None}  # fmt: skip
    assert note_of(figure(charts.lag_chart([unverified]))) == charts.NO_REPLAYS


def test_the_verified_share_is_a_rate_with_its_counts_and_the_lag_is_drawn_over_time() -> None:
    rows = [
        {"hour": datetime(2026, 12, 1, 9, tzinfo=UTC), "envelopes": 40, "verified": 40, "lag_p50": 2.0, "lag_p95": 9.5},
        {"hour": datetime(2026, 12, 1, 10, tzinfo=UTC), "envelopes": 8, "verified": 2, "lag_p50": 3.0, "lag_p95": 4.0},
    ]
    (share,) = figure(charts.verified_chart(rows))["data"]
    assert share["y"] == [1.0, 0.25]
    assert share["text"] == ["40 of 40 verified", "2 of 8 verified"]
    lag = figure(charts.lag_chart(rows))
    assert [(t["name"], t["y"]) for t in lag["data"]] == [("median", [2.0, 3.0]), ("95th percentile", [9.5, 4.0])]
    assert lag["layout"]["yaxis"]["rangemode"] == "tozero"


def test_a_first_divergence_histogram_counts_from_zero() -> None:
    fig = figure(charts.position_histogram([(3, 2), (7, 1)], 12))
    (bars,) = fig["data"]
    assert (bars["x"], bars["y"]) == ([3, 7], [2, 1])
    assert fig["layout"]["xaxis"]["rangemode"] == "nonnegative"
    assert fig["layout"]["yaxis"]["rangemode"] == "nonnegative"
    assert fig["layout"]["xaxis"]["dtick"] == 1
