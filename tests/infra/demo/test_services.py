"""The demo's long-running services: each is started as the command tree spells it (``reprolane serve ...``), never
by a hidden old spelling kept for one release, so removing those spellings cannot break the demo."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from infra.cli.commands import TREE, Group
from infra.demo import services
from tests.infra.stack.test_env import info


def visible(args: Sequence[str]) -> bool:
    """Whether `args` begin with a command ``--help`` lists (a path of the tree, no hidden name on it)."""
    node: Any = TREE
    for word in args:
        if not isinstance(node, Group):
            return True
        if word not in node.children:
            return False
        node = node.children[word]
    return not isinstance(node, Group)


def test_every_service_the_demo_starts_is_a_visible_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: dict[str, list[str]] = {}

    def record(name: str, args: Sequence[str], *rest: Any) -> None:
        spawned[name] = list(args)

    monkeypatch.setattr(services, "_spawn", record)
    stack = info(tmp_path)
    log = tmp_path / "log"
    services.start_console(stack, services.write_console_logins(tmp_path / "logins"), port=1, log=log)
    services.start_capture(stack, port=1, spool_dir=tmp_path, sample_rate=1.0, flag_tenants=(),
                           api_keys_path=tmp_path / "keys", ready_key="k", log=log)  # fmt: skip
    services.start_schedule_shipper(stack, metrics_port=1, log=log)
    services.start_replayer(stack, group_id="g", metrics_port=1, log=log)
    services.start_checkpointer(stack, every_s=1.0, metrics_port=1, log=log)
    services.start_archiver(stack, group_id="g", flush_s=1.0, log=log)
    assert len(spawned) == 6, spawned
    hidden = {name: args[:2] for name, args in spawned.items() if not visible(args)}
    assert not hidden, f"started by a spelling --help does not list: {hidden}"
    assert all(args[0] == "serve" for args in spawned.values()), spawned
