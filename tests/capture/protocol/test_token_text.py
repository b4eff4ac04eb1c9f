"""How upstream spells tokens (``token_id:N``), the spelling cache, and text made storable."""

from __future__ import annotations

import pytest

import capture.protocol.token_text as token_text
from capture.protocol.output import OutputCollector
from capture.protocol.token_text import clean_text
from schemas.envelope_codec import TopRow


def test_lone_surrogates_are_replaced_so_the_envelope_stays_encodable() -> None:
    """JSON may carry "\\ud800"; UTF-8 cannot. The recorded text replaces it instead of losing the envelope."""
    assert clean_text("ok \ud800 end") == "ok ? end"
    assert clean_text("café") == "café"
    assert clean_text("plain") == "plain"


def test_token_id_spellings_are_parsed_and_only_short_ones_are_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upstream's token strings are cached by text: a long one (a broken or hostile upstream) must not be, and
    the cache stays bounded."""
    token_text.SPELLINGS.clear()
    assert token_text.id_spelling("token_id:42") == (42, list(b"token_id:42"))
    assert token_text.id_spelling("token_id:x") is None
    assert token_text.id_spelling("The") is None
    assert list(token_text.SPELLINGS) == ["token_id:42"]
    huge = "token_id:" + "7" * 10_000
    assert token_text.id_spelling(huge) is None
    col = OutputCollector("chat.completions")
    col.add(
        {
            "choices": [
                {
                    "index": 0,
                    "token_ids": [7],
                    "logprobs": {
                        "content": [
                            {
                                "token": "token_id:7",
                                "logprob": -0.5,
                                "bytes": [97],
                                "top_logprobs": [{"token": huge, "logprob": -0.5, "bytes": [97]}],
                            }
                        ]
                    },
                }
            ]
        }
    )
    assert list(token_text.SPELLINGS) == ["token_id:42", "token_id:7"]  # the long one is not kept
    monkeypatch.setattr(token_text, "_MAX_SPELLINGS", 3)
    for n in range(10):
        assert token_text.id_spelling(f"token_id:{n}") == (n, list(f"token_id:{n}".encode()))
        assert len(token_text.SPELLINGS) <= 3
    step = col.choices[0].steps[0]
    assert step.token == "a"
    assert step.top == [TopRow(-0.5, 1, huge, None)]  # kept as text, as any text that is not a token id
