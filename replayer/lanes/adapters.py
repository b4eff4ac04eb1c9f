"""LoRA adapters on replay: the adapter a recorded request ran with, and the local copies a lane may load.

A request whose ``model`` named an adapter upstream served records the adapter's name and the digest of every file
of its directory (`schemas.ArtifactHashes`, hashed by the sidecar with `infra.clients.digest.directory_sha256`).
`replayer.replay` hands it to the lane as `Adapter` (`replayer.lanes.base.GenRequest.adapter`); a lane that loads
adapters asks `LocalAdapters.resolve` for its own copy (``settings.lora_modules``: name -> local directory), which
hashes that directory the same way and refuses, naming the field, when

- the lane has no adapter of that name (``artifacts.adapter_name``),
- its copy cannot be hashed, or its digest is not the recorded one (``artifacts.adapter_sha256``),
- its rank is above the lane's ``max_lora_rank`` (the engine could not load it).

The directory is hashed at every replay that names it (an adapter is small beside the model: a few MB for a
rank-8 adapter of a 135M model, tens of MB for a 7B one), and each digest gets its own engine id
(`LocalCopy.engine_id`), so an engine that cached an adapter's weights never serves them for a changed copy.

Lanes that cannot load adapters (remote, transformers, schedule) refuse a request that names one (`refuse`).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from infra.clients.digest import directory_sha256
from replayer.errors import NotReplayableError

__all__ = ["Adapter", "LocalAdapters", "LocalCopy", "refuse"]


@dataclass(frozen=True)
class Adapter:
    """The LoRA adapter a recorded request ran with: the name its ``model`` gave and the recorded digest."""

    name: str
    sha256: str


@dataclass(frozen=True)
class LocalCopy:
    """A lane's copy of an adapter, checked: its directory and the id its engine knows it by (one per digest)."""

    name: str
    path: Path
    engine_id: int


def refuse(adapter: Adapter | None, lane: str) -> None:
    """`NotReplayableError` for a request that ran with an adapter, on a lane that cannot load one."""
    if adapter is not None:
        raise NotReplayableError(
            f"artifacts.adapter_name: the request ran with LoRA adapter {adapter.name!r}, and the {lane} lane does "
            "not load adapters (replay it on the vllm lane with REPROLANE_REPLAYER_LORA_MODULES)"
        )


class LocalAdapters:
    """The adapters a lane may load (``lora_modules``: name -> directory), checked at each use (module docstring).
    Thread-safe."""

    def __init__(self, lora_modules: Mapping[str, Path], *, max_rank: int) -> None:
        self._dirs = {name: path.expanduser() for name, path in lora_modules.items()}
        self._max_rank = max_rank
        self._ids: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._dirs)

    def resolve(self, adapter: Adapter) -> LocalCopy:
        """The lane's copy of ``adapter`` when its digest is the recorded one; `NotReplayableError` otherwise."""
        path = self._dirs.get(adapter.name)
        if path is None:
            known = ", ".join(sorted(self._dirs)) or "none"
            raise NotReplayableError(
                f"artifacts.adapter_name: the request ran with LoRA adapter {adapter.name!r}, which this lane does "
                f"not have (its adapters: {known}; REPROLANE_REPLAYER_LORA_MODULES)"
            )
        try:
            local = directory_sha256(path)
            rank = json.loads((path / "adapter_config.json").read_bytes()).get("r")
        except (OSError, ValueError, AttributeError) as exc:
            raise NotReplayableError(
                f"artifacts.adapter_sha256: this lane's copy of adapter {adapter.name!r} ({path}) cannot be read: {exc}"
            ) from exc
        if local != adapter.sha256:
            raise NotReplayableError(
                f"artifacts.adapter_sha256: this lane's adapter {adapter.name!r} ({path}) is not the recorded one "
                f"({local[:12]}… here, {adapter.sha256[:12]}… recorded)"
            )
        if not isinstance(rank, int) or rank > self._max_rank:
            raise NotReplayableError(
                f"artifacts.adapter_name: adapter {adapter.name!r} has rank {rank!r}, above this lane's "
                f"max_lora_rank {self._max_rank} (REPROLANE_REPLAYER_MAX_LORA_RANK)"
            )
        with self._lock:
            engine_id = self._ids.setdefault((adapter.name, local), len(self._ids) + 1)
        return LocalCopy(adapter.name, path, engine_id)
