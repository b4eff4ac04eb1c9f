"""The errors ``infra`` raises: one small tree, so callers catch exactly what they can handle.

::

    InfraError                      anything infra could not do; the CLI prints it as one line, exit 1
    ├── ModelError                  the model cache
    │   ├── ModelFetchError         download or conversion failed (network, pip, transformers)
    │   └── ModelCacheError         a cache dir is missing, partial or corrupt: never use it
    ├── StackError                  the local stack of servers
    │   ├── PortUnavailableError    a port we need (or its gRPC companion) is taken
    │   ├── ServerStartError        a server exited or was not ready in time (message has its log tail)
    │   ├── ServerStopError         a process group survived SIGTERM and SIGKILL
    │   └── StackNotRunningError    no state file: ``reprolane stack up`` was never run in that dir
    └── DemoError                   ``reprolane demo`` could not finish (a service died, a wait timed out)

Errors from libraries below (botocore, subprocess, OSError) are translated where they happen, so a
caller never needs to import those libraries to handle a failure.
"""

from __future__ import annotations

from schemas.errors import ReprolaneError


class InfraError(ReprolaneError):
    """Base of every error raised by :mod:`infra`."""


class ModelError(InfraError):
    """Something is wrong with the model cache."""


class ModelFetchError(ModelError):
    """Downloading the wheel or converting the GGUF file failed."""


class ModelCacheError(ModelError):
    """A model directory failed verification: missing, partial, or a hash does not match."""


class StackError(InfraError):
    """Something is wrong with the local stack of servers."""


class PortUnavailableError(StackError):
    """A port a server must (re)use is held by another process."""


class ServerStartError(StackError):
    """A server exited during start-up or did not become ready before its deadline."""


class ServerStopError(StackError):
    """A server's process group was still alive after SIGTERM and SIGKILL."""


class StackNotRunningError(StackError):
    """There is no stack state in the run directory."""


class DemoError(InfraError):
    """``reprolane demo`` could not finish: a service it started died, or a wait ran out of time."""
