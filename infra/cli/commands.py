"""The ``reprolane`` command tree, written once: who runs what, grouped by user and job.

    serve    every long-running process: capture (the sidecar), schedules (the schedule shipper), replayer,
             archiver, checkpointer, console
    replay   an auditor's or a team's replays: request, workflow, explain, matrix
    audit    the records: show, verify, evidence, hold, expire, query, lake, checkpoint, reconcile
    release  a release engineer's gate and fingerprints: gate, fingerprint
    keys     every key a person mints: api (callers), operator (auditors), tenant (data keys), signing (the log)
    stack, model, demo, schemas: the local stack, the served model, the whole product in minutes, the contract

Each command lives in its feature's module (a function, or a command of a Typer app there); `SOURCES` names those
modules, `TREE` places their commands. Modules are imported only when their command runs (or ``--help`` describes
it), so ``reprolane serve capture`` does not carry the replayer, DuckDB and pyarrow in its memory.

To add a command: write it in its module, add its source to `SOURCES` if the module is new, and one line to
`TREE`. Its docstring ends with one example that starts with its path (``Example: reprolane audit show ID``); a
test walks the tree and fails on a command without one, or on an option spelled two ways.

`HIDDEN` keeps the spellings of the flat tree (``reprolane show``, ``reprolane capture serve``, ...) working, out of
``--help``, for one release.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final


@dataclass(frozen=True)
class Cmd:
    """A command from `SOURCES`: the source itself (a function, or a whole Typer app kept as a group), or one
    command of a Typer app (``sub``), taken alone."""

    source: str
    sub: str | None = None


@dataclass(frozen=True)
class Group:
    """A group of the tree: its help line, its commands in ``--help`` order, and old spellings it still answers."""

    help: str
    children: Mapping[str, Cmd | Group]
    hidden: Mapping[str, Cmd] = field(default_factory=dict)


#: Where each command is written: name -> (module, attribute). Tests replace a source by name
#: (`infra.cli.root.build_app`'s overrides: a Typer app built with injected factories), wherever the tree uses it.
SOURCES: Final[dict[str, tuple[str, str]]] = {
    "model": ("infra.model.cli", "model_app"),
    "stack": ("infra.stack.cli", "stack_app"),
    "demo": ("infra.demo.cli", "demo_command"),
    "fingerprint": ("infra.release.fingerprint_cli", "fingerprint_app"),
    "schemas": ("infra.cli.schemas_cli", "schemas_app"),
    "capture": ("capture.cli", "capture_app"),
    "replayer": ("replayer.cli", "replayer_app"),
    "replay": ("replayer.cli", "replay_app"),
    "show": ("replayer.cli", "show_command"),
    "explain": ("replayer.matrix.cli", "explain_command"),
    "matrix": ("replayer.matrix.cli", "matrix_command"),
    "gate": ("infra.release.gate_cli", "gate_app"),
    "verify": ("capture.audit.cli", "verify_command"),
    "hold": ("capture.audit.cli", "hold_app"),
    "expire": ("capture.audit.cli", "expire_command"),
    "audit": ("capture.audit.cli", "audit_app"),
    "evidence": ("infra.reexecution.cli", "evidence_app"),
    "archiver": ("capture.audit.lake.cli", "archiver_app"),
    "lake": ("capture.audit.lake.cli", "lake_app"),
    "query": ("capture.audit.lake.cli", "query_command"),
    "keys": ("capture.audit.lake.cli", "keys_app"),
    "operator": ("capture.audit.operator_cli", "operator_app"),
    "console": ("infra.console.cli", "console_command"),
}

#: The flat tree's top-level names, each still answering as it did (not listed by ``--help``).
HIDDEN: Final[Mapping[str, Cmd]] = {
    name: Cmd(name)
    for name in (
        "capture", "replayer", "show", "explain", "matrix", "gate", "verify", "hold", "expire", "evidence",
        "archiver", "lake", "query", "operator", "console", "fingerprint",
    )
}  # fmt: skip

TREE: Final = Group(
    "Audit capture and deterministic replay for LLM inference.",
    {
        "serve": Group(
            "Every long-running process: the sidecar, the schedule shipper, the replayer, the archiver, the "
            "checkpointer, the console.",
            {
                "capture": Cmd("capture", "serve"),
                "schedules": Cmd("capture", "schedules"),
                "replayer": Cmd("replayer", "serve"),
                "archiver": Cmd("archiver", "serve"),
                "checkpointer": Cmd("audit", "checkpointer"),
                "console": Cmd("console"),
            },
        ),
        "replay": Group(
            "Replay recorded requests and report divergence: one request, a workflow, why one diverged, a matrix.",
            {
                "request": Cmd("replay", "request"),
                "workflow": Cmd("replay", "workflow"),
                "explain": Cmd("explain"),
                "matrix": Cmd("matrix"),
            },
        ),
        "audit": Group(
            "The records: show, prove, export evidence, hold, expire, query the lake, sign the logs.",
            {
                "show": Cmd("show"),
                "verify": Cmd("verify"),
                "evidence": Cmd("evidence"),
                "hold": Cmd("hold"),
                "expire": Cmd("expire"),
                "query": Cmd("query"),
                "lake": Cmd("lake"),
                "checkpoint": Cmd("audit", "checkpoint"),
                "reconcile": Cmd("audit", "reconcile"),
            },
            hidden={"checkpointer": Cmd("audit", "checkpointer"), "keygen": Cmd("audit", "keygen")},
        ),
        "release": Group(
            "Release engineering: the gate that replays the golden set, the environment fingerprint.",
            {"gate": Cmd("gate"), "fingerprint": Cmd("fingerprint")},
        ),
        "keys": Group(
            "Keys a person mints: callers' API keys, operators' keys, tenants' data keys, the log's signing key.",
            {
                "api": Cmd("capture", "add-key"),
                "operator": Cmd("operator", "add-key"),
                "tenant": Cmd("keys"),
                "signing": Cmd("audit", "keygen"),
            },
            hidden={"list": Cmd("keys", "list"), "shred": Cmd("keys", "shred")},
        ),
        "stack": Cmd("stack"),
        "model": Cmd("model"),
        "demo": Cmd("demo"),
        "schemas": Cmd("schemas"),
    },
    hidden=HIDDEN,
)
