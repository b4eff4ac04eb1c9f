"""Token ids as text, with the tokenizer the envelope says it was recorded with, or not at all.

A chat envelope keeps the prompt's token ids (what the model saw), not its rendered text, and a step's top-k
candidates keep ids. To show them as text the console decodes them with a tokenizer from a model directory
(the replayer's ``model_dir``), and only for an envelope whose ``artifacts.tokenizer_sha256`` is that
directory's (`infra.model.manifest.tokenizer_sha256_of`, computed once at start): text decoded with another
tokenizer would be a plausible lie. Otherwise the page shows ids only and says why.

The ``tokenizers`` library reads ``tokenizer.json`` (no model, no torch); it is imported in `load` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from infra.model.manifest import tokenizer_sha256_of

MAX_DECODED_IDS = 32_768


@dataclass(frozen=True)
class TokenDecoder:
    tokenizer_sha256: str
    _tokenizer: Any

    @classmethod
    def load(cls, model_dir: Path) -> TokenDecoder | None:
        """The decoder of `model_dir`'s ``tokenizer.json``, or None when there is none (or ``tokenizers`` is
        not installed)."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            return None
        return cls(tokenizer_sha256_of(model_dir), Tokenizer.from_file(str(path)))

    def decode(self, ids: tuple[int, ...] | list[int]) -> str:
        return str(self._tokenizer.decode(list(ids[:MAX_DECODED_IDS]), skip_special_tokens=False))

    def spell(self, token_id: int) -> str:
        return self.decode([token_id])


def decoder_for(decoder: TokenDecoder | None, tokenizer_sha256: str | None) -> TokenDecoder | None:
    """`decoder` when it is the tokenizer the record names, else None."""
    if decoder is None or tokenizer_sha256 is None or decoder.tokenizer_sha256 != tokenizer_sha256:
        return None
    return decoder
