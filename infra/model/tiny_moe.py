"""A tiny mixture-of-experts model, built locally with random weights (no download): what the MoE schedule-lane
test serves and replays (issue 32).

`build_tiny_moe` saves a two-layer Mixtral (a family vLLM serves, on the CPU through its fused-MoE kernel) with four
experts, two routed per token, in bfloat16, with the tokenizer and chat template of the model whose directory it
is given, so prompts render as they do for that model. The weights are seeded: one seed gives the same model.

Heavy imports (torch, transformers) happen only inside the function.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Final

#: The files taken from the tokenizer's model directory.
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def build_tiny_moe(tokenizer_dir: Path, out: Path, *, seed: int = 0) -> Path:
    """Save a random two-layer, four-expert Mixtral with ``tokenizer_dir``'s tokenizer into ``out``."""
    import torch  # noqa: TID251 - heavy, and only this function needs it
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM  # noqa: TID251

    vocab = len(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    model: Any = MixtralForCausalLM(config)  # type: ignore[no-untyped-call]
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    return out
