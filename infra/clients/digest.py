"""The one way a directory of artifacts is hashed: a file's sha256, a digest over a set of files, a directory's.

The model manifest (`infra.model.manifest`) summarises a model directory with these digests, and a LoRA adapter's
identity is the same digest over every file of its directory (`directory_sha256`): the capture sidecar computes it
for each adapter it is told upstream serves (`capture.request.runtime.load_adapters`), and a replay lane for the adapter
it is about to load (`replayer.lanes.base.LocalAdapters`). Written once here, the leaf both services may import,
so what the sidecar records and what a lane compares it with cannot drift apart.

A digest over a set of files is the sha256 of the lines ``"<name>\\t<sha256 of file>\\n"`` sorted by name
(`digest_files`): independent of file order and of the directory's location. Files are read in 1 MiB chunks.
Errors are the standard library's `OSError`; each caller translates it into its own package's error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Final

_CHUNK: Final = 1 << 20


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks (weights are hundreds of MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def digest_files(file_hashes: Mapping[str, str]) -> str:
    """Hex sha256 over sorted ``(name, sha256)`` pairs, one ``name\\tsha\\n`` line each."""
    lines = "".join(f"{name}\t{sha}\n" for name, sha in sorted(file_hashes.items()))
    return hashlib.sha256(lines.encode("utf-8")).hexdigest()


def hash_directory(path: Path, *, exclude: Collection[str] = ()) -> dict[str, str]:
    """sha256 of every regular file under ``path`` (relative POSIX names), files named in ``exclude`` left out."""
    hashes: dict[str, str] = {}
    for file in sorted(path.rglob("*")):
        if file.is_file() and file.name not in exclude:
            hashes[file.relative_to(path).as_posix()] = sha256_file(file)
    return hashes


def directory_sha256(path: Path) -> str:
    """The digest of every file of ``path`` (`digest_files` of `hash_directory`): a LoRA adapter's identity.
    A path that is not a directory, or an empty one, is an `OSError`: it holds no adapter, and its digest would
    name nothing."""
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a directory")
    files = hash_directory(path)
    if not files:
        raise FileNotFoundError(f"{path} holds no file")
    return digest_files(files)
