"""What infra's commands share, each written once: the stack's run directory and the model cache options, and
the reading of a fingerprint file given as an argument.

``reprolane stack ...`` and ``reprolane demo`` take ``--run-dir``; ``reprolane model ...`` and ``stack up`` take
``--cache-dir``. Both default to the environment, then to a folder of the current directory or the home
(`infra.paths`). ``fingerprint diff`` and ``gate`` read fingerprint JSON files: one that does not read or decode
is bad input (``typer.BadParameter``: exit 2, by `infra.cli`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from infra import paths
from schemas import ContractError, EnvironmentFingerprint, decode_environment
from schemas.known_good import DEPLOYMENT_PATTERN

RunDirOpt = Annotated[
    Path | None,
    typer.Option(
        "--run-dir", help=f"the stack's state, logs and data (default ${paths.RUN_DIR_ENV} or ./.reprolane/stack)"
    ),
]
CacheDirOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", help=f"model cache root (default ${paths.CACHE_DIR_ENV} or ~/.cache/reprolane)"),
]


def read_fingerprint(path: Path, what: str) -> EnvironmentFingerprint:
    """The environment fingerprint in the JSON file `path`; `what` names it in the error (``baseline``, ...)."""
    try:
        return decode_environment(path.read_bytes())
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {what} {path}: {exc.strerror}") from exc
    except ContractError as exc:
        raise typer.BadParameter(f"{what} {path}: {exc}") from exc


def deployment_name(value: str) -> str:
    """``--deployment`` of ``gate`` and ``fingerprint history``: a name that may stand in an object key."""
    if not re.match(DEPLOYMENT_PATTERN, value):
        raise typer.BadParameter(f"--deployment must match {DEPLOYMENT_PATTERN}, not {value!r}")
    return value
