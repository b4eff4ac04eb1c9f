"""The console's charts: plotly figures built in Python, drawn in the browser by the plotly.js the package ships.

Each function returns a figure as JSON text that a page embeds in a ``<script type="application/json">``
block (data, never executed) and ``static/console.js`` hands to ``Plotly.newPlot``. The browser loads
``plotly.min.js`` from the console itself (`plotly_js`: the file inside the installed ``plotly`` package), so
the pages need no network and no CDN, and nothing is vendored into this repository.

`embed` escapes ``<``, ``>`` and ``&`` as JSON unicode escapes: a token text or a model name that holds
``</script>`` cannot end the block (inside JSON those characters only ever occur in strings).
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


def divergence_rate_chart(rows: list[dict[str, Any]]) -> str:
    """Replays and divergence rate per hour, one line per (model, runtime fingerprint)."""
    import plotly.graph_objects as go

    series: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        series[f"{row['model']} · runtime {str(row['runtime_sha256'] or '?')[:12]}"].append(row)
    data: list[Any] = []
    for name, points in sorted(series.items()):
        hours = [p["hour"].strftime("%Y-%m-%d %H:00") for p in points]
        data.append(go.Scatter(x=hours, y=[p["divergence_rate"] for p in points], name=f"rate: {name}",
                               mode="lines+markers"))  # fmt: skip
        data.append(go.Bar(x=hours, y=[p["replays"] for p in points], name=f"replays: {name}", yaxis="y2",
                           opacity=0.35))  # fmt: skip
    return _figure(
        data,
        title="divergence rate and replays over time, by model and runtime fingerprint",
        xaxis={"type": "category", "title": "hour of the replay (UTC)"},
        yaxis={"title": "divergence rate", "range": [0, 1]},
        yaxis2={"title": "replays", "overlaying": "y", "side": "right"},
        legend={"orientation": "h", "y": -0.3},
        height=380,
    )


def position_histogram(positions: list[tuple[int, int]]) -> str:
    import plotly.graph_objects as go

    return _figure(
        [go.Bar(x=[p for p, _ in positions], y=[n for _, n in positions], marker={"color": "#d95f0e"})],
        title="first-divergence position",
        xaxis={"title": "generated token position of the fork", "dtick": 1 if len(positions) <= 40 else None},
        yaxis={"title": "replays"},
    )


def lag_histogram(lags_s: list[float]) -> str:
    import plotly.graph_objects as go

    return _figure(
        [go.Histogram(x=lags_s, nbinsx=30, marker={"color": "#31a354"})],
        title="replay lag (replayed at - captured at)",
        xaxis={"title": "seconds"},
        yaxis={"title": "replays"},
    )


def gate_chart(runs: list[tuple[str, float, bool]]) -> str:
    """Pass rate per release-gate run (oldest left), green when the gate passed."""
    import plotly.graph_objects as go

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
        yaxis={"title": "pass rate", "range": [0, 1]},
    )
