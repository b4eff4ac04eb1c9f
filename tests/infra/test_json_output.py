"""Machine output: every command with a ``--json`` option prints exactly one JSON document on stdout.

The commands are found by walking the real root app (`infra.cli.build_app`), so a command that gains ``--json``
cannot escape: `test_every_json_command_has_a_run_here` fails until it has an entry in `RUNS`. Each entry is run
for real (marked ``stack``): the real ``reprolane`` in a process of its own against the session's stack, its
stdout handed to `json.loads` whole. The lane commands run the in-process vLLM engine (``replay request`` on
``--lane vllm``, ``explain``, ``matrix``), whose logging and prints went to stdout before: they must show on
stderr, and stdout must still parse.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer

from infra.cli import build_app
from infra.demo_services import clean_environment, reprolane_argv
from infra.state import StackInfo
from schemas import Envelope, WorkflowRef
from tests.replayer.support import S3Target, record_from_stack, seed_envelope

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


def json_commands() -> dict[tuple[str, ...], bool]:
    """Every command of the root app that has a ``--json`` option: its path -> whether ``--json`` is a flag
    (else it takes a value: ``-`` asks for the document on stdout)."""
    found: dict[tuple[str, ...], bool] = {}

    def walk(command: Any, path: tuple[str, ...], ctx: Any) -> None:
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                walk(command.get_command(ctx, name), (*path, name), ctx)
            return
        for param in command.params:
            if "--json" in getattr(param, "opts", ()):
                found[path] = bool(getattr(param, "is_flag", False))

    root = typer.main.get_command(build_app())
    walk(root, (), typer.Context(root))
    return found


@dataclass(frozen=True)
class Recorded:
    """What the runs need: a recorded envelope (a workflow's step 0) stored in the stack's S3, and as a file."""

    envelope: Envelope
    jsonl: Path


Run = Callable[[Recorded], list[str]]

#: How each ``--json`` command is run for real (its arguments after ``reprolane``).
RUNS: dict[tuple[str, ...], Run] = {
    ("show",): lambda r: ["show", r.envelope.request_id, "--json"],
    ("replay", "request"): lambda r: ["replay", "request", r.envelope.request_id, "--json", "--via", "local",
                                      "--lane", "vllm"],
    ("replay", "workflow"): lambda r: ["replay", "workflow", _workflow(r.envelope), "--tenant", r.envelope.tenant,
                                       "--json", "--lane", "remote"],
    ("explain",): lambda r: ["explain", r.envelope.request_id, "--envelopes", str(r.jsonl), "--variations", "alone",
                             "--json"],
    ("matrix",): lambda r: ["matrix", "--envelopes", str(r.jsonl), "--cells", "order", "--max-tokens", "4",
                            "--json", "-"],
    ("query",): lambda r: ["query", "SELECT 1 AS one", "--json"],
    ("fingerprint", "history"): lambda r: ["fingerprint", "history", "--deployment", f"json-{r.envelope.request_id}",
                                           "--json"],
}  # fmt: skip

#: The commands whose run loads the in-process vLLM engine: its logs must be on stderr.
ENGINE_RUNS = {("replay", "request"), ("explain",), ("matrix",)}


def _workflow(envelope: Envelope) -> str:
    assert envelope.workflow is not None
    return envelope.workflow.workflow_id


def test_every_json_command_has_a_run_here() -> None:
    found = json_commands()
    assert set(found) == set(RUNS), "a command with --json needs an entry in RUNS (and one JSON document on stdout)"
    assert {path for path, is_flag in found.items() if not is_flag} == {("matrix",)}  # --json FILE, or - for stdout


@pytest.fixture(scope="module")
def recorded(stack: StackInfo, tmp_path_factory: pytest.TempPathFactory) -> Recorded:
    envelope = record_from_stack(stack, "json-output-001", MESSAGES, max_tokens=6, target_level="token")
    envelope = envelope.model_copy(update={"workflow": WorkflowRef(workflow_id=f"wf-{envelope.envelope_id()[:12]}",
                                                                   step=0)})  # fmt: skip
    s3 = S3Target.from_stack(stack)
    seed_envelope(s3.client(), s3.bucket, envelope)
    jsonl = tmp_path_factory.mktemp("json-output") / "envelopes.jsonl"
    jsonl.write_bytes(envelope.canonical() + b"\n")
    return Recorded(envelope, jsonl)


@pytest.mark.stack
@pytest.mark.parametrize("path", sorted(RUNS), ids=" ".join)
def test_a_json_command_prints_one_document_on_stdout(
    path: tuple[str, ...], recorded: Recorded, stack: StackInfo
) -> None:
    args = RUNS[path](recorded)
    proc = subprocess.run(
        [*reprolane_argv(), *args], env=clean_environment(stack.run_dir), capture_output=True, text=True,
        timeout=900, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode in (0, 1), f"{' '.join(args)}: exit {proc.returncode}: {proc.stderr[-3000:]}"
    document = json.loads(proc.stdout)  # the whole of stdout is one document
    assert document, proc.stdout
    if path == ("show",):
        assert proc.stdout.rstrip("\n").encode() == recorded.envelope.canonical()  # the stored bytes themselves
    if path in ENGINE_RUNS:
        assert "vllm" in proc.stderr.lower(), "the engine's own logging should be there, on stderr"
