"""The canonical-encoding rule, pinned with literal bytes."""

from __future__ import annotations

import math

import pytest

from schemas import ContractError
from schemas.canonical import canonical_json


def test_rule_literal_vector() -> None:
    data = {"b": [1, 2.5, -0.0001, 1e-07], "a": {"z": "café", "y": None, "x": True}}
    assert canonical_json(data) == '{"a":{"x":true,"y":null,"z":"café"},"b":[1,2.5,-0.0001,1e-07]}'.encode()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_refused(bad: float) -> None:
    with pytest.raises(ContractError, match="canonical"):
        canonical_json({"x": bad})
