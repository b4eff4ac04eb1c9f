"""A recorded prompt's text, decoded from its token ids with the tokenizer the envelope names.

The sidecar records a prompt as token ids (what the model saw), not as the client's messages, so a chat
request's envelope holds no text. `reprolane audit show` decodes the ids for a person, but only with the tokenizer
the envelope was recorded with: the model directory's manifest (`schemas.manifest`, written by ``reprolane model
fetch``) must carry the envelope's ``tokenizer_sha256``, and the directory's ``tokenizer.json`` must be the file
that manifest lists. Anything else (no model directory, another tokenizer, a file that changed, no ``tokenizers``
package) is `DecodedPrompt.reason`, never a guess: a decode with the wrong vocabulary would read plausibly.

``tokenizers`` (the Rust tokenizer library transformers uses, without torch) is imported only when decoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from schemas import ContractError, Envelope, sha256_hex
from schemas.manifest import MANIFEST_NAME, decode_manifest

TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class DecodedPrompt:
    """The text of each prompt (the first, then `Envelope.more_prompts`), or why there is none."""

    texts: tuple[str, ...] = ()
    reason: str | None = None


def decode_prompts(envelope: Envelope, model_dir: Path | None) -> DecodedPrompt:
    """Decode the envelope's prompt token ids with the recorded tokenizer found in `model_dir` (module docstring)."""
    if envelope.prompt is None:
        return DecodedPrompt(reason="no prompt was recorded")
    wanted = envelope.artifacts.tokenizer_sha256
    if wanted is None:
        return DecodedPrompt(reason="the envelope names no tokenizer")
    if model_dir is None:
        return DecodedPrompt(reason="no model directory is configured (REPROLANE_REPLAYER_MODEL_DIR)")
    try:
        manifest = decode_manifest((model_dir / MANIFEST_NAME).read_bytes())
        data = (model_dir / TOKENIZER_FILE).read_bytes()
    except (OSError, ContractError) as exc:
        return DecodedPrompt(reason=f"{model_dir} has no readable manifest and {TOKENIZER_FILE}: {exc}")
    if manifest.tokenizer_sha256 != wanted:
        return DecodedPrompt(reason=f"the tokenizer in {model_dir} is not the recorded one ({wanted[:12]}…)")
    if manifest.files.get(TOKENIZER_FILE) != sha256_hex(data):
        return DecodedPrompt(reason=f"{model_dir / TOKENIZER_FILE} differs from its manifest")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return DecodedPrompt(reason="the tokenizers package is not installed")
    tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    prompts = (envelope.prompt, *(envelope.more_prompts or ()))
    return DecodedPrompt(texts=tuple(tokenizer.decode(list(p.token_ids), skip_special_tokens=False) for p in prompts))
