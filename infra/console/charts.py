"""The console's charts: plotly figures built in Python, drawn in the browser by the plotly.js the package ships.

Each function returns a figure as JSON text that a page embeds in a ``<script type="application/json">``
block (data, never executed) and ``static/console.js`` hands to ``Plotly.newPlot``. The browser loads
``plotly.min.js`` from the console itself (`plotly_js`: the file inside the installed ``plotly`` package), so
the pages need no network and no CDN, and nothing is vendored into this repository.

`embed` escapes ``<``, ``>`` and ``&`` as JSON unicode escapes: a token text or a model name that holds
``</script>`` cannot end the block (inside JSON those characters only ever occur in strings).

Honest charts: a rate is drawn as a rate (its own axis, in percent, each point labelled with the counts it is
made of: "0 of 12 diverged"), never beside a bar of volumes on a second axis that outgrows it and reads like an
alarm; an axis that counts starts at zero; a chart without data says so in words in the middle of the frame
(`empty`) instead of drawing plotly's default axes around nothing.
"""

from __future__ import annotations

from collections import defaultdict
from importlib import resources
from pathlib import Path
from typing import Any

from infra.errors import InfraError

_LAYOUT: dict[str, Any] = {
    "margin": {"l": 60, "r": 20, "t": 40, "b": 50},
    "height": 320,
    "template": "plotly_white",
}


def plotly_js() -> Path:
    """The plotly.min.js of the installed plotly package (`InfraError` when plotly is not installed)."""
    try:
        path = Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))
    except ModuleNotFoundError as exc:
        raise InfraError("the console's charts need plotly: pip install 'reprolane[console]'") from exc
    if not path.is_file():
        raise InfraError(f"plotly is installed but {path} is missing")
    return path


def embed(figure_json: str) -> str:
    return figure_json.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def _figure(data: list[Any], **layout: Any) -> str:
    import plotly.graph_objects as go

    fig = go.Figure(data=data, layout={**_LAYOUT, **layout})
    return embed(str(fig.to_json()))


_NOTE: dict[str, Any] = {
    "showarrow": False, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5, "font": {"size": 15, "color": "#555"},
}  # fmt: skip


def empty(title: str, note: str) -> str:
    """A chart with nothing to show: its title and `note` in words, no axes, no traces."""
    return _figure(
        [],
        title=title,
        xaxis={"visible": False},
        yaxis={"visible": False},
        annotations=[_NOTE | {"text": note}],
        height=200,
    )


def logprob_diff_chart(positions: list[int], diffs: list[float], fork: int | None) -> str:
    import plotly.graph_objects as go

    shapes = []
    if fork is not None:
        shapes.append({"type": "line", "x0": fork, "x1": fork, "yref": "paper", "y0": 0, "y1": 1,
                       "line": {"color": "#c0392b", "dash": "dash"}})  # fmt: skip
    return _figure(
        [go.Bar(x=positions, y=diffs, name="recorded - replayed logprob", marker={"color": "#2c7fb8"})],
        title="logprob difference per generated token (dashed: the fork; after it the tokens differ)",
        xaxis={"title": "generated token position", "dtick": 1 if len(positions) <= 40 else None},
        yaxis={"title": "Δ logprob"},
        shapes=shapes,
    )


RATE_TITLE = "divergence rate per hour, by model and runtime fingerprint (label: diverged of replayed)"
NO_REPLAYS = "no replays in the lake yet: nothing to chart"


def divergence_rate_chart(rows: list[dict[str, Any]]) -> str:
    """The divergence rate per hour, one line per (model, runtime fingerprint); each point labelled with the
    counts it is made of (``diverged`` of ``replays``), so a rate of 0 over 500 replays reads as what it is."""
    import plotly.graph_objects as go

    if not rows:
        return empty(RATE_TITLE, NO_REPLAYS)
    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        series[f"{row['model']} · runtime {str(row['runtime_sha256'] or '?')[:12]}"].append(row)
    data: list[Any] = []
    for name, points in sorted(series.items()):
        counts = [f"{p['diverged']} of {p['replays']} diverged" for p in points]
        data.append(
            go.Scatter(
                x=[p["hour"].strftime("%Y-%m-%d %H:00") for p in points],
                y=[p["divergence_rate"] for p in points],
                name=name,
                mode="lines+markers+text",
                text=counts,
                textposition="top center",
                marker={"size": 10},
                hovertemplate="%{x}: %{y:.1%} (%{text})<extra>%{fullData.name}</extra>",
            )
        )
    return _figure(
        data,
        title=RATE_TITLE,
        xaxis={"type": "category", "title": "hour of the replay (UTC)"},
        yaxis={"title": "divergence rate", "range": [-0.05, 1.1], "tickformat": ".0%", "zeroline": True},
        legend={"orientation": "h", "y": -0.3},
        height=380,
    )


def position_histogram(positions: list[tuple[int, int]], replays: int) -> str:
    """How many replays first diverged at each generated token position (`replays`: how many there were in all,
    for the note when none diverged)."""
    import plotly.graph_objects as go

    title = "first-divergence position"
    if not positions:
        note = NO_REPLAYS if replays == 0 else f"no divergences: none of the {replays} replays forked at a token"
        return empty(title, note)
    return _figure(
        [go.Bar(x=[p for p, _ in positions], y=[n for _, n in positions], marker={"color": "#d95f0e"})],
        title=title,
        xaxis={
            "title": "generated token position of the fork",
            "rangemode": "nonnegative",
            "dtick": 1 if max(p for p, _ in positions) <= 40 else None,
        },
        yaxis={"title": "replays", "rangemode": "nonnegative"},
    )


def lag_histogram(lags_s: list[float]) -> str:
    import plotly.graph_objects as go

    title = "replay lag (replayed at - captured at)"
    if not lags_s:
        return empty(title, NO_REPLAYS)
    return _figure(
        [go.Histogram(x=lags_s, nbinsx=30, marker={"color": "#31a354"})],
        title=title,
        xaxis={"title": "seconds", "rangemode": "nonnegative"},
        yaxis={"title": "replays", "rangemode": "nonnegative"},
    )


VERIFIED_TITLE = "traffic verified, per hour of capture"
LAG_TITLE = "verification lag, per hour of capture (replayed at - captured at)"
NO_TRAFFIC = "no verifiable envelope in the lake yet"


def verified_chart(rows: list[dict[str, Any]]) -> str:
    """The share of verifiable traffic that has a replay result, per hour of capture; each point labelled with the
    counts it is made of (``verified`` of ``envelopes``)."""
    import plotly.graph_objects as go

    if not rows:
        return empty(VERIFIED_TITLE, NO_TRAFFIC)
    return _figure(
        [
            go.Scatter(
                x=[r["hour"].strftime("%Y-%m-%d %H:00") for r in rows],
                y=[int(r["verified"]) / int(r["envelopes"]) for r in rows],
                mode="lines+markers+text",
                text=[f"{r['verified']} of {r['envelopes']} verified" for r in rows],
                textposition="top center",
                marker={"size": 10, "color": "#31a354"},
                hovertemplate="%{x}: %{y:.1%} (%{text})<extra></extra>",
            )
        ],
        title=VERIFIED_TITLE,
        xaxis={"type": "category", "title": "hour of capture (UTC)"},
        yaxis={"title": "verified share", "range": [-0.05, 1.1], "tickformat": ".0%", "zeroline": True},
    )


def lag_chart(rows: list[dict[str, Any]]) -> str:
    """The verification lag over time: median and 95th percentile per hour of capture, of the verified envelopes."""
    import plotly.graph_objects as go

    points = [r for r in rows if r["lag_p50"] is not None]
    if not points:
        return empty(LAG_TITLE, NO_REPLAYS)
    hours = [r["hour"].strftime("%Y-%m-%d %H:00") for r in points]
    return _figure(
        [
            go.Scatter(x=hours, y=[r["lag_p50"] for r in points], name="median", mode="lines+markers"),
            go.Scatter(x=hours, y=[r["lag_p95"] for r in points], name="95th percentile", mode="lines+markers"),
        ],
        title=LAG_TITLE,
        xaxis={"type": "category", "title": "hour of capture (UTC)"},
        yaxis={"title": "seconds", "rangemode": "tozero"},
        legend={"orientation": "h", "y": -0.3},
    )


def gate_chart(runs: list[tuple[str, float, bool]]) -> str:
    """Pass rate per release-gate run (oldest left), green when the gate passed."""
    import plotly.graph_objects as go

    if not runs:
        return empty("release-gate runs", "no release-gate runs to show")

    return _figure(
        [
            go.Bar(
                x=[r[0] for r in runs],
                y=[r[1] for r in runs],
                marker={"color": ["#31a354" if r[2] else "#c0392b" for r in runs]},
            )
        ],
        title="release-gate runs: pass rate (green: passed)",
        xaxis={"type": "category", "title": "run (finished, UTC)"},
        yaxis={"title": "pass rate", "range": [0, 1.05], "tickformat": ".0%"},
    )
