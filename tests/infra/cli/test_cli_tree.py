"""The whole ``reprolane`` command tree, walked: one spelling per option concept, one kind per option name, and an
example in every command's help (issue 31).

The tree is the real root app (`infra.cli.root.build_app`), walked the way click runs it (each group's
``list_commands`` / ``get_command``, the root loading its commands on demand), so a command added anywhere is
checked without being listed here. A *command* is a leaf, or a group that runs by itself
(``invoke_without_command``: ``release fingerprint``, ``release gate``), whose options are its own. No server
is needed: nothing is invoked, the examples are only parsed.

The spellings chosen (`CONCEPTS`):

- a day is ``--day YYYY-MM-DD``, never ``--date``: it is a UTC calendar day (`schemas.layout.capture_day`, a
  Merkle log's day), and the code says "day" some four times as often as "date" (only the keys' Hive-style
  segment is ``date=``, a storage name); the three audit commands said ``--day``, the three lake ones ``--date``;
- an output file is ``-o/--output FILE`` (the common convention; ``audit evidence export`` had it), never ``--out``,
  and an option naming what it writes ends in ``-output`` (``keys operator --key-output``), never ``-out``;
  a report written beside stdout keeps its own name (``--report FILE.json``, ``matrix --html FILE``);
- a workload given as a file is ``--workload-file FILE``; ``--workload`` is a flag (``matrix``: the bundled set);
- a model folder is ``--model-dir DIR``; ``--model`` is a served model's name (``release gate --statistical``).

No old option spelling is kept as an alias: the project has not been released (0.1.0), and click cannot hide one
name of an option, so an alias would show in ``--help`` as a second spelling. Old *command* paths (the flat tree's
``reprolane show``, ``capture serve``, ...) answer for one release, unlisted (`infra.cli.commands.HIDDEN`). An old
option spelling gets click's hint,
``No such option: --date (Possible options: --day)``. `ALIASES` is where an alias would go, with its reason.
"""

from __future__ import annotations

import shlex
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from infra.cli.commands import HIDDEN, TREE
from infra.cli.root import build_app

#: Options allowed a second long name: (command path, the option's long names). Empty: see the module docstring.
ALIASES: frozenset[tuple[str, frozenset[str]]] = frozenset()


@dataclass(frozen=True)
class Concept:
    """One thing several commands take: its one spelling, its kind, and the spellings it replaced or rules out."""

    spelling: str
    kind: str  # "flag" | "value"
    not_spelled: frozenset[str]


CONCEPTS: dict[str, Concept] = {
    "a day (YYYY-MM-DD)": Concept("--day", "value", frozenset({"--date", "--on-day", "--partition"})),
    "an output file": Concept("--output", "value", frozenset({"--out", "--output-file", "--out-file"})),
    "a workload file": Concept("--workload-file", "value", frozenset({"--workload-path", "--prompts"})),
    "the bundled workload": Concept("--workload", "flag", frozenset()),
    "a model folder": Concept("--model-dir", "value", frozenset({"--model-path"})),
}

#: The line of a command's help that shows it run: a paragraph of its own, ``Example: reprolane PATH ...``.
EXAMPLE = "Example: "

#: Options typer adds itself; not ours to name.
TYPER_OPTIONS = frozenset({"--help", "--install-completion", "--show-completion"})


@dataclass(frozen=True)
class Option:
    command: str  # "audit checkpoint"
    long: tuple[str, ...]  # its long names, the on-switch's (``--once``), not ``--no-once``
    short: tuple[str, ...]
    kind: str  # "flag" | "value"


def _walk(command: Any, path: tuple[str, ...], ctx: typer.Context | None) -> Iterator[tuple[tuple[str, ...], Any]]:
    if not hasattr(command, "list_commands") or getattr(command, "invoke_without_command", False):
        if path:
            yield path, command
    if hasattr(command, "list_commands"):
        sub = typer.Context(command, info_name=path[-1] if path else "reprolane", parent=ctx)
        for name in command.list_commands(sub):
            yield from _walk(command.get_command(sub, name), (*path, name), sub)


@cache
def commands() -> dict[str, Any]:
    """Every command of the tree: ``"audit checkpoint"`` -> its click command."""
    root = typer.main.get_command(build_app())
    return {" ".join(path): command for path, command in _walk(root, (), None)}


@cache
def options() -> tuple[Option, ...]:
    found = []
    for name, command in commands().items():
        for param in command.params:
            if getattr(param, "param_type_name", None) != "option":
                continue
            opts = [o for o in param.opts if o not in TYPER_OPTIONS]
            if not opts:
                continue
            kind = "flag" if param.is_flag else "value"
            long = tuple(o for o in opts if o.startswith("--"))
            found.append(Option(name, long, tuple(o for o in opts if not o.startswith("--")), kind))
    return tuple(found)


def test_the_walk_finds_every_command() -> None:
    found = commands()
    for expected in ("audit checkpoint", "audit lake compact", "audit query", "release gate",
                     "release gate record-golden", "release fingerprint", "replay matrix", "audit evidence export",
                     "keys operator", "replay request", "serve capture", "serve checkpointer"):  # fmt: skip
        assert expected in found
    assert len(found) >= 40


def test_the_top_level_is_grouped_by_user_and_job() -> None:
    """`infra.cli.commands.TREE`: every long-running process under ``serve``, replays under ``replay``, the records
    under ``audit``, the gate and fingerprints under ``release``, every key a person mints under ``keys``."""
    assert list(TREE.children) == ["serve", "replay", "audit", "release", "keys", "stack", "model", "demo", "schemas"]
    found = commands()
    assert {n.split()[1] for n in found if n.startswith("serve ")} == {
        "capture", "schedules", "replayer", "archiver", "checkpointer", "console",
    }  # fmt: skip
    assert not [name for name in HIDDEN if name in found]  # the flat tree's names: unlisted


@pytest.mark.parametrize(
    "old", [["show"], ["capture", "serve"], ["keys", "list"], ["audit", "keygen"], ["gate", "record-golden"]]
)
def test_the_flat_trees_spellings_still_answer_unlisted(old: list[str]) -> None:
    result = CliRunner().invoke(build_app(), [*old, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage" in result.stdout


def test_each_concept_has_one_spelling() -> None:
    wrong = []
    for option in options():
        for concept, rule in CONCEPTS.items():
            for name in set(option.long) & rule.not_spelled:
                wrong.append(f"{option.command}: {name} is {concept}; spell it {rule.spelling}")
            if rule.spelling in option.long and option.kind != rule.kind:
                wrong.append(f"{option.command}: {rule.spelling} is {concept}, a {rule.kind}, not a {option.kind}")
        for name in option.long:
            if name.endswith("-out") and name != "--out":  # --out: an output file, above
                wrong.append(f"{option.command}: {name} writes a file; spell it {name}put (like --output)")
    assert not wrong, "\n".join(wrong)


def test_an_option_has_one_long_name() -> None:
    doubled = [
        f"{o.command}: {' / '.join(o.long)}"
        for o in options()
        if len(o.long) > 1 and (o.command, frozenset(o.long)) not in ALIASES
    ]
    assert not doubled, "one spelling per option (or an entry in ALIASES, with its reason):\n" + "\n".join(doubled)


def test_an_option_name_has_one_kind_everywhere() -> None:
    kinds: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for option in options():
        for name in (*option.long, *option.short):
            kinds[name][option.kind].append(option.command)
    mixed = [f"{name}: " + "; ".join(f"{k} in {', '.join(v)}" for k, v in by.items())
             for name, by in kinds.items() if len(by) > 1]  # fmt: skip
    assert not mixed, "an option name is a flag everywhere or takes a value everywhere:\n" + "\n".join(mixed)


def test_a_short_option_means_one_long_option() -> None:
    meaning: dict[str, set[tuple[str, ...]]] = defaultdict(set)
    for option in options():
        for short in option.short:
            meaning[short].add(option.long)
    assert {short: longs for short, longs in meaning.items() if len(longs) > 1} == {}


def _examples(command: Any) -> list[str]:
    lines = (command.help or "").splitlines()
    return [line.strip() for i, line in enumerate(lines)
            if line.strip().startswith(EXAMPLE) and (i == 0 or not lines[i - 1].strip())]  # fmt: skip


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_shows_one_example_that_parses(name: str) -> None:
    command = commands()[name]
    examples = _examples(command)
    assert len(examples) == 1, f"`reprolane {name} --help` shows one paragraph `{EXAMPLE}reprolane {name} ...`"
    argv = shlex.split(examples[0].removeprefix(EXAMPLE))
    prefix = ["reprolane", *name.split()]
    assert argv[: len(prefix)] == prefix, f"the example of `{name}` runs another command: {examples[0]}"
    # the real parser, callbacks included (nothing runs): an unknown option, a missing value or argument fails
    command.make_context(prefix[-1], argv[len(prefix) :])
