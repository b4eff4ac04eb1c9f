"""Where things live on disk, decided in one place.

Two roots, both overridable through the environment so CI and tests can isolate themselves:

* the model cache, shared by every checkout of the project on a machine (the conversion costs tens of
  seconds and half a gigabyte, so it is worth sharing): ``REPROLANE_CACHE_DIR``, default
  ``~/.cache/reprolane``;
* the stack run dir, private to one checkout (pids, logs, data of the servers): ``REPROLANE_RUN_DIR``,
  default ``./.reprolane/stack`` relative to the current directory (ignored by git).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

CACHE_DIR_ENV = "REPROLANE_CACHE_DIR"
RUN_DIR_ENV = "REPROLANE_RUN_DIR"

#: The name the model is served under and recorded with, everywhere (vLLM, envelopes, manifests).
MODEL_NAME = "smollm2-135m-instruct"


def _root(override: Path | None, env_var: str, default: Callable[[], Path]) -> Path:
    """``override``, else the environment variable ``env_var`` when set and not empty, else ``default()``; absolute.

    The default is a function so that it is looked up (home, current directory) only when it is used."""
    if override is not None:
        return override.expanduser().resolve()
    env = os.environ.get(env_var)
    if env:
        return Path(env).expanduser().resolve()
    return default().resolve()


def cache_dir(override: Path | None = None) -> Path:
    """Root of the model cache: ``override``, else ``$REPROLANE_CACHE_DIR``, else ``~/.cache/reprolane``."""
    return _root(override, CACHE_DIR_ENV, lambda: Path.home() / ".cache" / "reprolane")


def model_dir(cache: Path | None = None, name: str = MODEL_NAME) -> Path:
    """Directory of the converted model ``name`` inside the cache."""
    return cache_dir(cache) / "models" / name


def run_dir(override: Path | None = None) -> Path:
    """Root of the stack's runtime files: ``override``, else ``$REPROLANE_RUN_DIR``, else ``./.reprolane/stack``."""
    return _root(override, RUN_DIR_ENV, lambda: Path.cwd() / ".reprolane" / "stack")
