"""The evidence bundle's summary page (``summary.html``): what the bundle shows, for a person, offline.

One self-contained HTML file: inline style, no script, no external resource, every value escaped (a prompt, a
tenant or a replayed text is data, never markup). It is a reading aid: it is covered by the signed manifest, but
what proves anything is ``reprolane audit evidence verify`` (or any C2SP tool on ``proof.tlog-proof``), and the page
says how to run it.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from schemas import ContractError
from schemas.envelope import CapturedOutput
from schemas.replay import decode_replay_result
from schemas.sealed import is_sealed_result

_STYLE = (
    "body{font-family:system-ui,sans-serif;max-width:60em;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;"
    "text-align:left;vertical-align:top}th{background:#f3f3f3}code,pre{font-family:ui-monospace,monospace;"
    "font-size:.9em;word-break:break-all;white-space:pre-wrap}.bad{color:#a00}.ok{color:#070}"
)


def _e(value: object) -> str:
    return html.escape("" if value is None else str(value))


def _rows(pairs: list[tuple[str, object]]) -> str:
    return "".join(f"<tr><th>{_e(k)}</th><td><code>{_e(v)}</code></td></tr>" for k, v in pairs)


def _record_section(facts: dict[str, Any]) -> str:
    env = facts.get("envelope")
    if env is None:
        return (
            "<h2>Record</h2><p>This tenant's records are sealed (AES-256-GCM under the tenant's key): the bundle "
            "holds the ciphertext exactly as stored, which is what the log commits to. Prompt, output and "
            f"fingerprints are inside it. Key id <code>{_e(facts.get('key_id'))}</code>.</p>"
        )
    parts = [("model", env.model), ("sampling", env.sampling.model_dump_json() if env.sampling else None)]
    out = ""
    if env.prompt is not None:
        parts.append(("prompt token ids", " ".join(map(str, env.prompt.token_ids))))
        if env.prompt.text:
            out += f"<h3>Prompt</h3><pre>{_e(env.prompt.text)}</pre>"
    if isinstance(env.outcome, CapturedOutput) and env.outcome.choices:
        choice = env.outcome.choices[0]
        parts.append(("output token ids", " ".join(map(str, choice.token_ids))))
        out += f"<h3>Output</h3><pre>{_e(choice.text)}</pre>"
    return f"<h2>Record</h2><table>{_rows(parts)}</table>{out}"


def _replays_section(replays: dict[str, bytes]) -> str:
    if not replays:
        return "<h2>Replays</h2><p>None stored for this record at export time.</p>"
    rows = []
    for result_id, body in sorted(replays.items()):
        if is_sealed_result(body):
            rows.append(f"<tr><td><code>{_e(result_id[:16])}</code></td><td colspan=5>sealed</td></tr>")
            continue
        try:
            event = decode_replay_result(body).event
        except ContractError:
            rows.append(f"<tr><td><code>{_e(result_id[:16])}</code></td><td colspan=5>unreadable</td></tr>")
            continue
        fork = event.first_divergence.position if event.first_divergence else "-"
        cls = "ok" if event.target_met else "bad"
        rows.append(
            f"<tr><td><code>{_e(result_id[:16])}</code></td><td>{_e(event.lane)}</td>"
            f"<td class={cls}>{_e(event.verdict)} (target {_e(event.target_level)})</td><td>{_e(fork)}</td>"
            f"<td>{_e(event.cause_hint)}</td><td>{_e(event.replayed_at.isoformat())}</td></tr>"
        )
    titles = ("result", "lane", "verdict", "first divergence", "cause", "replayed")
    head = "<tr>" + "".join(f"<th>{t}</th>" for t in titles) + "</tr>"
    return f"<h2>Replays</h2><table>{head}{''.join(rows)}</table>"


@dataclass(frozen=True)
class LogPlace:
    """Where a bundle's record stands in the signed log, and the key that signed the checkpoint: the head of the
    summary page, and what ``reprolane audit evidence export`` answers."""

    request_id: str
    envelope_id: str
    origin: str
    leaf_index: int
    tree_size: int
    root_hash: str
    vkey: str
    fingerprint: str


def render_summary(
    place: LogPlace,
    *,
    facts: dict[str, Any],
    replays: dict[str, bytes],
    fingerprints: dict[str, Any],
    retention: dict[str, Any],
    exported_at: str,
) -> str:
    workflow = facts.get("workflow") or {}
    record = [
        ("request id", place.request_id),
        ("envelope id", place.envelope_id),
        ("tenant", facts.get("tenant")),
        ("captured at", facts.get("captured_at")),
        ("workflow", f"{workflow.get('workflow_id')} step {workflow.get('step')}" if workflow else None),
    ]
    log = [
        ("log (checkpoint origin)", place.origin),
        ("leaf index", place.leaf_index),
        ("signed tree size", place.tree_size),
        ("signed root (hex)", place.root_hash),
        ("audit key (C2SP vkey)", place.vkey),
        ("audit key fingerprint", place.fingerprint),
    ]
    fps = [
        ("runtime sha256", fingerprints.get("runtime_sha256")),
        ("runtime", fingerprints.get("runtime")),
        ("artifacts", fingerprints.get("artifacts")),
    ]
    lanes = [(f"lane of {r[:16]}", doc.get("lane_fingerprint_sha256")) for r, doc in fingerprints["replays"].items()]
    hold = [
        ("legal hold", "ON" if retention.get("legal_hold") else "off"),
        ("retain until", retention.get("retain_until") or "no retention set"),
        ("object", retention.get("object_key")),
        ("version", retention.get("version_id")),
    ]
    verify = (
        f"reprolane audit evidence verify BUNDLE.zip --key-fingerprint {place.fingerprint}\n"
        "# or with the key itself (PEM, base64 or the vkey above): --key PUBKEY\n"
        "# any c2sp.org/tlog-proof verifier: proof.tlog-proof, the vkey above, and the leaf data in its extra line"
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>Evidence: {_e(place.request_id)}</title><style>{_STYLE}</style></head><body>"
        f"<h1>Evidence bundle of request <code>{_e(place.request_id)}</code></h1>"
        f"<p>Exported {_e(exported_at)}. This page is a summary; the proof is the bundle's signed files.</p>"
        f"<table>{_rows(record)}</table>"
        f"<h2>Inclusion in the signed log</h2><table>{_rows(log)}</table>"
        f"{_record_section(facts)}{_replays_section(replays)}"
        f"<h2>Fingerprints</h2><table>{_rows(fps + lanes)}</table>"
        f"<h2>Holds and retention (as S3 reported at export)</h2><table>{_rows(hold)}</table>"
        f"<h2>How to verify, offline</h2><pre>{_e(verify)}</pre>"
        "</body></html>\n"
    )
