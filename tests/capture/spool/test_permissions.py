"""The spool's files are the owner's alone (0600 in a 0700 directory), whatever the umask (issue #18, finding 7)."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from capture.spool import Spool
from tests.factories import envelope


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The widest umask there is (0): whatever the spool's files end up as is what the spool asked for."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


@pytest.mark.usefixtures("open_umask")
async def test_spool_directory_is_0700_and_every_file_0600(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=1 << 24, segment_bytes=2048)
    await spool.open()
    for i in range(8):  # enough to roll segments
        await spool.append(envelope(request_id=f"perm-{i}"))
    await spool.ack([e.seq for e in await spool.pending(3)])
    await spool.close()
    await spool.open()  # reopening rewrites the ack log (tmp + rename) and starts a fresh segment
    await spool.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    files = modes(directory)
    assert {"LOCK", "acks.log"} <= set(files)
    assert sum(name.endswith(".seg") for name in files) >= 2
    assert files == dict.fromkeys(files, 0o600)


@pytest.mark.usefixtures("open_umask")
async def test_files_an_older_version_left_readable_are_made_private(tmp_path: Path) -> None:
    directory = tmp_path / "spool"
    spool = Spool(directory, max_bytes=1 << 24)
    await spool.open()
    await spool.append(envelope(request_id="old-0"))
    await spool.close()
    directory.chmod(0o755)
    for path in directory.iterdir():
        path.chmod(0o644)
    await spool.open()
    await spool.close()
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert set(modes(directory).values()) == {0o600}


async def test_a_narrow_umask_cannot_lock_the_owner_out(tmp_path: Path) -> None:
    """Under umask 0277 ``open(..., 0o600)`` creates read-only files; reopening the ack log would then fail."""
    old = os.umask(0o277)
    try:
        spool = Spool(tmp_path / "spool", max_bytes=1 << 24)
        await spool.open()
        await spool.append(envelope(request_id="narrow-0"))
        await spool.ack([e.seq for e in await spool.pending(1)])
        await spool.close()
        await spool.open()
        assert spool.depth == 0
        await spool.close()
    finally:
        os.umask(old)
    assert set(modes(tmp_path / "spool").values()) == {0o600}
