"""The matrix report three ways: a terminal table, JSON, and one self-contained HTML file with plots.

The HTML has no external reference (no script, stylesheet, font or image URL): the plots are PNGs rendered by
matplotlib (Agg backend, imported inside `render_html`) and embedded as base64 ``data:`` URIs. Plots: the
token-identical rate per cell (one bar chart), the first-divergence positions of each cell that ran (one
histogram per cell), and throughput per cell. Every cell is in the table, skipped ones with their reason.
"""

from __future__ import annotations

import base64
import html
import io
import statistics
from typing import Any

from replayer.matrix.results import CellResult, MatrixReport

_HEADERS = ("cell", "status", "n", "identical", "fork pos min/med/max", "max|dlp|", "tok/s", "p95 ms", "peak MB")


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def fork_summary(positions: tuple[int, ...]) -> str:
    if not positions:
        return "-"
    return f"{min(positions)}/{statistics.median(positions):g}/{max(positions)}"


def _row(cell: CellResult) -> tuple[str, ...]:
    if cell.status != "ran":
        return (cell.name, cell.status, "-", "-", "-", "-", "-", "-", _num(cell.peak_rss_mb, ".0f"))
    rate = "-" if cell.token_identical_rate is None else f"{cell.n_identical}/{cell.n} {cell.token_identical_rate:.0%}"
    return (
        cell.name + (" (baseline)" if cell.is_baseline else ""),
        "ran",
        str(cell.n),
        rate,
        fork_summary(cell.divergence_positions),
        _num(cell.max_abs_logprob_diff, ".3g"),
        _num(cell.tokens_per_s, ".1f"),
        _num(cell.p95_latency_ms, ".0f"),
        _num(cell.peak_rss_mb, ".0f"),
    )


def render_table(report: MatrixReport) -> str:
    """Plain-text table, one row per cell; reasons of skipped/failed cells and latency notes below it."""
    rows = [_HEADERS, *(_row(c) for c in report.cells)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADERS))]
    lines = [
        f"replay matrix: {report.n_inputs} request(s) from {report.source}; baseline = "
        + ("the recorded outputs" if report.baseline == "recorded" else "the one-at-a-time cell (batch.single)")
    ]
    for i, r in enumerate(rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    notes = [f"  {c.name}: {c.status}: {c.reason}" for c in report.cells if c.status != "ran"]
    notes += [
        f"  {c.name}: p95 is {c.latency_kind}"
        for c in report.cells
        if c.status == "ran" and c.latency_kind != "per request"
    ]
    if notes:
        lines += ["", "notes:", *notes]
    if report.rejected:
        lines += ["", "not replayable (left out):", *(f"  {rid}: {why}" for rid, why in report.rejected)]
    return "\n".join(lines)


def render_json(report: MatrixReport) -> str:
    return report.model_dump_json(indent=2)


# -- HTML ---------------------------------------------------------------------------------------------------------


def _png(fig: Any) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _img(b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}">'


def _plots(report: MatrixReport) -> list[tuple[str, str]]:
    """(title, base64 PNG) per plot."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    ran = [c for c in report.cells if c.status == "ran"]
    out: list[tuple[str, str]] = []
    names = [c.name for c in ran]
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(ran) + 2), 3.2))
    ax.bar(names, [c.token_identical_rate or 0.0 for c in ran], color="#4c72b0")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("token-identical rate")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    out.append(("Token-identical rate per cell", _png(fig)))
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(max(5.0, 0.7 * len(ran) + 2), 3.2))
    ax.bar(names, [c.tokens_per_s or 0.0 for c in ran], color="#55a868")
    ax.set_ylabel("generated tokens / s")
    plt.setp(ax.get_xticklabels(), rotation=45, ha="right")
    out.append(("Throughput per cell", _png(fig)))
    plt.close(fig)
    for c in ran:
        fig, ax = plt.subplots(figsize=(4.5, 2.4))
        if c.divergence_positions:
            top = max(c.divergence_positions)
            ax.hist(c.divergence_positions, bins=range(0, top + 2), color="#c44e52", align="left")
        else:
            ax.text(0.5, 0.5, "no divergence", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel("first divergence position (token)")
        ax.set_ylabel("requests")
        ax.set_title(c.name, fontsize=9)
        out.append((f"First-divergence positions: {c.name}", _png(fig)))
        plt.close(fig)
    return out


def _cell_rows(report: MatrixReport) -> str:
    rows = []
    for c in report.cells:
        vals = _row(c)
        note = c.reason if c.status != "ran" else (c.latency_kind or "")
        cls = "skip" if c.status == "skipped" else ("fail" if c.status == "failed" else "")
        cells = "".join(f"<td>{html.escape(v)}</td>" for v in vals)
        rows.append(
            f'<tr class="{cls}">{cells}<td>{html.escape(c.description)}</td><td>{html.escape(note or "")}</td></tr>'
        )
    head = "".join(f"<th>{html.escape(h)}</th>" for h in (*_HEADERS, "what", "note"))
    return f"<table><tr>{head}</tr>{''.join(rows)}</table>"


def _fork_rows(report: MatrixReport) -> str:
    rows = []
    for c in report.cells:
        for r in c.requests:
            if r.token_identical or r.first_divergence is None:
                continue

            def top(step: Any, side: str) -> str:
                if step is None:
                    return "-"
                cands = step.recorded_top if side == "rec" else step.replayed_top
                return ", ".join(f"{x.token_id}:{x.logprob:.3f}" for x in cands[:5]) or "-"

            vals = (
                c.name,
                r.request_id,
                str(r.first_divergence),
                top(r.before_fork, "rec"),
                top(r.before_fork, "rep"),
                top(r.at_fork, "rec"),
                top(r.at_fork, "rep"),
                _num(r.max_abs_logprob_diff, ".3g"),
                _num(r.max_rel_logprob_diff, ".3g"),
            )
            rows.append("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in vals) + "</tr>")
    if not rows:
        return "<p>No request diverged from its baseline.</p>"
    head = (
        "cell", "request", "fork at", "baseline top-k before fork", "cell top-k before fork",
        "baseline top-k at fork", "cell top-k at fork", "max|dlp|", "max rel",
    )  # fmt: skip
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


_CSS = (
    "body{font-family:sans-serif;margin:1.5em}table{border-collapse:collapse;font-size:13px}"
    "td,th{border:1px solid #ccc;padding:3px 6px;text-align:left}tr.skip{color:#777}tr.fail{color:#a00}"
    "img{margin:6px;border:1px solid #eee}"
)


def render_html(report: MatrixReport) -> str:
    """One self-contained HTML document (inline CSS, base64 PNG plots, no external URL)."""
    plots = _plots(report)
    base = "recorded outputs" if report.baseline == "recorded" else "the one-at-a-time cell (batch.single)"
    figs = "".join(
        f"<figure>{_img(b64, title)}<figcaption>{html.escape(title)}</figcaption></figure>" for title, b64 in plots
    )
    platform = html.escape(", ".join(f"{k}={v}" for k, v in report.platform.items()))
    return (
        '<!DOCTYPE html><html><head><meta charset="utf-8"><title>reprolane replay matrix</title>'
        f"<style>{_CSS}</style></head><body><h1>Replay matrix</h1>"
        f"<p>{report.n_inputs} request(s) from {html.escape(report.source)}; baseline: {html.escape(base)}; "
        f"created {html.escape(report.created_at.isoformat())}.</p><p>Platform: {platform}</p>"
        f"<h2>Cells</h2>{_cell_rows(report)}<h2>Plots</h2>{figs}"
        f"<h2>Forks (top-k at the step before the fork and at the fork)</h2>{_fork_rows(report)}"
        "</body></html>"
    )
