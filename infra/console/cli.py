"""``reprolane serve console [--host H] [--port P]``: build the console from the settings and serve it with uvicorn.

The console's own settings are `infra.console.settings.ConsoleSettings` (``REPROLANE_CONSOLE_*``); what it reads
is configured with each source's own settings (audit, archiver, replayer), which a running local stack fills in.
"Download evidence" signs each bundle's manifest with the audit signing key (``REPROLANE_AUDIT_SIGNING_KEY``, as
``reprolane audit evidence export`` does); without one the console still serves every page and says where to export.
"""

from __future__ import annotations

from typing import Annotated

import typer

from capture.audit.access_log import AccessLog
from capture.audit.errors import SigningKeyError
from capture.audit.lake.settings import LakeSettings
from capture.audit.lake.store import Lake
from capture.audit.operators import OperatorSettings
from capture.audit.settings import AuditSettings
from capture.audit.signing_keys import signing_key, verifying_key
from capture.audit.store import AuditStore
from infra import paths
from infra.console.app import Console, build_console_app
from infra.console.records import EvidenceSigner, Records
from infra.console.replay_now import ReplayPublisher
from infra.console.sessions import SessionStore
from infra.console.settings import ConsoleSettings
from infra.console.tokens import TokenDecoder
from infra.stack.env import apply_to_process
from replayer.settings import ReplayerSettings
from replayer.store import EnvelopeStore


def build_console(
    settings: ConsoleSettings,
    audit: AuditSettings,
    lake: LakeSettings | None,
    replayer: ReplayerSettings,
    operators: OperatorSettings,
) -> Console:
    """The console's parts from the settings of each source (no network call is made here)."""
    store = AuditStore.from_settings(audit)
    try:
        public_key: bytes | None = verifying_key(audit)
    except SigningKeyError:
        public_key = None  # the request page says inclusion cannot be checked, and why
    signer = None
    if audit.signing_key:  # a bad key stops the console here (SigningKeyError), not at the first download
        signer = EvidenceSigner(signing_key(audit), audit.log_origin)
    records = Records(
        EnvelopeStore.from_settings(replayer),
        store,
        Lake.from_settings(lake) if lake is not None else None,
        public_key=public_key,
        gate_reports_dir=settings.gate_reports_dir,
        signer=signer,
    )
    publisher = None
    if settings.replay_keys_path is not None and settings.replay_key_id is not None:
        publisher = ReplayPublisher.from_files(
            replayer, settings.replay_keys_path, settings.replay_key_id, settings.replay_timeout_s
        )
    return Console(
        records,
        AccessLog(store, retention_days=operators.access_log_retention_days),
        SessionStore(idle_s=settings.session_idle_s, max_s=settings.session_max_s),
        operators.keys_path,
        secure_cookie=settings.secure_cookie,
        replay=publisher,
        search_limit=settings.search_limit,
        decoder=TokenDecoder.load(replayer.model_dir or paths.model_dir()),
    )


def console_command(
    host: Annotated[str | None, typer.Option("--host", help="bind address (default 127.0.0.1)")] = None,
    port: Annotated[int | None, typer.Option("--port", help="port (default 8700)")] = None,
) -> None:
    """Serve the auditors' web console (search, requests, replays, holds, overview).

    Example: reprolane serve console --host 127.0.0.1 --port 8700
    """
    import uvicorn

    apply_to_process()
    overrides = {k: v for k, v in {"host": host, "port": port}.items() if v is not None}
    settings = ConsoleSettings(**overrides)  # type: ignore[arg-type]
    operators = OperatorSettings()
    console = build_console(settings, AuditSettings(), LakeSettings(), ReplayerSettings(), operators)
    if operators.keys_path is None:
        typer.echo("reprolane console: no REPROLANE_OPERATOR_KEYS_PATH: nobody can log in", err=True)
    typer.echo(f"reprolane console: http://{settings.host}:{settings.port}/", err=True)
    uvicorn.run(build_console_app(console), host=settings.host, port=settings.port, log_level="warning")
