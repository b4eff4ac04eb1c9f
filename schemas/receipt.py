"""A re-execution receipt: who re-executed which evidence bundles, when, on which runtime, and what came out.

``reprolane audit evidence reexecute ... --receipt FILE --receipt-key KEY --receipt-name NAME`` signs one with the
re-executor's own Ed25519 key, as a C2SP signed note (`schemas.note`), so that a second party holding the
re-executor's verifier key sees what was re-executed without trusting whoever hands the receipt over (any C2SP
note verifier checks the signature; ``reprolane audit evidence receipt`` also checks bundles against it). The
note's text, line by line::

    reprolane.reexecution-receipt/1
    at <ISO time, UTC>
    bundle <sha256 of the bundle file> <request id> reproduced|not-reproduced <tokens> <lane fingerprint sha256>

one ``bundle`` line per bundle, in the order re-executed. The lane fingerprint is this machine's runtime as the
replay lane fingerprinted it: the receipt says what computed the verdict, not only who signed it.

Pure: no IO.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal

from schemas.errors import ContractError

RECEIPT_FORMAT: Final = "reprolane.reexecution-receipt/1"
MAX_LINES: Final = 10_000
_LINE = re.compile(r"^bundle ([0-9a-f]{64}) ([!-~]{1,256}) (reproduced|not-reproduced) ([0-9]{1,9}) ([0-9a-f]{64})$")

Verdict = Literal["reproduced", "not-reproduced"]


@dataclass(frozen=True)
class ReceiptLine:
    bundle_sha256: str
    request_id: str
    verdict: Verdict
    tokens: int
    lane_fingerprint_sha256: str

    def text(self) -> str:
        return (
            f"bundle {self.bundle_sha256} {self.request_id} {self.verdict} {self.tokens} {self.lane_fingerprint_sha256}"
        )


@dataclass(frozen=True)
class Receipt:
    at: datetime
    lines: tuple[ReceiptLine, ...]

    def text(self) -> str:
        """The note text (ends in a newline)."""
        head = [RECEIPT_FORMAT, f"at {self.at.astimezone(UTC).isoformat()}"]
        return "\n".join([*head, *(line.text() for line in self.lines)]) + "\n"


def parse_receipt(text: str) -> Receipt:
    """The receipt a note's text holds; `ContractError` naming the line that is not one."""
    lines = text.split("\n")
    if lines[-1] != "" or len(lines) < 4 or len(lines) > MAX_LINES + 3:
        raise ContractError("not a re-execution receipt: too few or too many lines", ("receipt",))
    if lines[0] != RECEIPT_FORMAT:
        raise ContractError(f"not a re-execution receipt: the first line is not {RECEIPT_FORMAT}", ("receipt",))
    try:
        if not lines[1].startswith("at "):
            raise ValueError(lines[1][:40])
        at = datetime.fromisoformat(lines[1].removeprefix("at "))
    except ValueError as exc:
        raise ContractError(f"receipt line 2 is not 'at <ISO time>': {exc}", ("receipt", "at")) from exc
    if at.tzinfo is None:
        raise ContractError("receipt line 2: the time has no zone", ("receipt", "at"))
    parsed = []
    for n, line in enumerate(lines[2:-1], start=3):
        match = _LINE.match(line)
        if match is None:
            raise ContractError(f"receipt line {n} is not a bundle line", ("receipt", "bundle"))
        bundle, request_id, verdict, tokens, lane = match.groups()
        parsed.append(ReceiptLine(bundle, request_id, verdict, int(tokens), lane))  # type: ignore[arg-type]
    return Receipt(at, tuple(parsed))
