"""Machine output: with ``--json``, stdout carries exactly one JSON document and everything else goes to stderr.

A command that loads a lane runs vLLM (or torch, transformers) in this process, and those write to stdout on
their own: vLLM's logger is a handler on ``sys.stdout`` made when vLLM is first imported, its engine prints,
and C extensions and threads write to file descriptor 1 directly. So redirecting Python's ``sys.stdout`` is not
enough, and neither is filtering lines afterwards. `machine_output` points descriptor 1 itself at stderr (and
``sys.stdout`` at ``sys.stderr``, so a handler made meanwhile is bound to stderr for good) for the whole command,
and hands the command one writer on a duplicate of the original stdout: the only way to that descriptor.

    with machine_output(as_json) as document:
        result = replay(...)          # engine logs, prints, C writes: all on stderr
        document(result_json)         # the one thing on stdout

Without ``--json`` (`enabled` False) nothing moves and the writer is `typer.echo`. Under a test runner whose
``sys.stdout`` is not a file descriptor (typer's ``CliRunner``), only the Python streams are swapped. A command
whose text report is one document too (``replay request``, ``replay workflow``) uses it in text mode as well: a
person reading the report must not find it under an engine's log.

Engine processes of their own (the matrix's and ``explain``'s cells, vLLM's engine core) do not share this
process's descriptors' fate once started elsewhere, and vLLM configures its log handler on ``sys.stdout`` at every
engine start unless ``VLLM_LOGGING_STREAM`` says otherwise. So the command line also calls
`engine_logs_to_stderr` before any command runs: every engine it starts, here or in a child, logs to stderr.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, MutableMapping
from typing import TextIO

import typer

Document = Callable[[str], None]

#: vLLM's log stream, read when an engine starts (`vllm.logger`); its default is ``ext://sys.stdout``.
VLLM_LOGGING_STREAM = "VLLM_LOGGING_STREAM"


def engine_logs_to_stderr(environ: MutableMapping[str, str]) -> None:
    """Point vLLM's log handler at stderr for every engine started from now on, in this process or a child,
    unless the user chose a stream (`VLLM_LOGGING_STREAM` set) or a logging config of their own
    (``VLLM_LOGGING_CONFIG_PATH``, which vLLM then applies instead)."""
    environ.setdefault(VLLM_LOGGING_STREAM, "ext://sys.stderr")


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both an OSError and a ValueError
        return None


@contextlib.contextmanager
def machine_output(enabled: bool) -> Iterator[Document]:
    """Within: descriptor 1 and ``sys.stdout`` lead to stderr; the yielded writer prints one document on the
    original stdout (a newline is added). Restored on exit, in every case."""
    if not enabled:
        yield lambda text: typer.echo(text)
        return
    stdout, stderr = sys.stdout, sys.stderr
    stdout.flush()
    fd = _fileno(stdout)
    saved = os.dup(fd) if fd is not None and fd == 1 else None
    if saved is not None:
        os.dup2(_fileno(stderr) or 2, 1)
    written = False

    def document(text: str) -> None:
        nonlocal written
        if written:
            raise RuntimeError("a --json command prints exactly one document")
        written = True
        data = (text if text.endswith("\n") else text + "\n").encode("utf-8")
        if saved is None:
            stdout.write(data.decode("utf-8"))
            stdout.flush()
            return
        view = memoryview(data)
        while view:
            view = view[os.write(saved, view) :]

    sys.stdout = stderr
    try:
        yield document
    finally:
        sys.stdout = stdout
        with contextlib.suppress(OSError, ValueError):
            stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)
