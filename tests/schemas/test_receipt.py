"""`schemas.receipt`: a receipt's text reads back to what was written, and text that is not one is refused with
the line named (a receipt is a file from anyone)."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime

import pytest

from schemas.errors import ContractError
from schemas.receipt import Receipt, ReceiptLine, parse_receipt

LINE = ReceiptLine("a" * 64, "rl-0123", "reproduced", 12, "b" * 64)
RECEIPT = Receipt(datetime(2026, 12, 7, 8, 30, tzinfo=UTC), (LINE, dataclasses.replace(LINE, verdict="not-reproduced")))


def test_a_receipt_reads_back_as_written() -> None:
    text = RECEIPT.text()
    assert text.splitlines()[:2] == ["reprolane.reexecution-receipt/1", "at 2026-12-07T08:30:00+00:00"]
    assert parse_receipt(text) == RECEIPT


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (RECEIPT.text().replace("receipt/1", "receipt/2"), "first line"),
        (RECEIPT.text().replace("+00:00", ""), "no zone"),
        (RECEIPT.text().replace("at 2026", "on 2026"), "line 2"),
        (RECEIPT.text().replace(" 12 ", " twelve ", 1), "line 3"),
        (RECEIPT.text().replace("not-reproduced", "maybe"), "line 4"),
        (RECEIPT.text().rstrip("\n"), "lines"),
        ("reprolane.reexecution-receipt/1\nat 2026-12-07T08:30:00+00:00\n", "lines"),
    ],
)
def test_text_that_is_not_a_receipt_is_refused_by_line(text: str, needle: str) -> None:
    with pytest.raises(ContractError, match=needle):
        parse_receipt(text)
