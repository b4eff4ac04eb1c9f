"""A random LoRA adapter for the served model, built locally (no download): what the LoRA tests serve and replay.

`build_random_adapter` wraps the model with ``peft`` (rank 8 on the attention's query and value projections, as a
small real adapter would be), draws every ``lora_B`` matrix from a seeded normal distribution (peft starts them at
zero, which would leave the model's outputs unchanged and prove nothing) and saves it with ``save_pretrained``: the
directory vLLM's ``--lora-modules NAME=PATH`` and a lane's ``lora_modules`` take. Two seeds give two adapters whose
outputs differ; one seed gives the same weights.

Heavy imports (torch, transformers, peft) happen only inside the function; peft comes with the dev extra.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

#: The projections a test adapter adapts (LLaMA-style attention, as SmolLM2's).
TARGET_MODULES: Final = ("q_proj", "v_proj")


def build_random_adapter(model_dir: Path, out: Path, *, seed: int, rank: int = 8, scale: float = 0.05) -> Path:
    """Save a LoRA adapter of ``model_dir`` with seeded random ``lora_B`` weights (std ``scale``) into ``out``."""
    import torch  # noqa: TID251 - heavy, and only this function needs it
    from peft import LoraConfig, get_peft_model  # noqa: TID251
    from transformers import AutoModelForCausalLM  # noqa: TID251

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(TARGET_MODULES), lora_dropout=0.0)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, weight in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:  # A too: peft's default init draws it from the global RNG
                weight.copy_(torch.randn(weight.shape, generator=generator) * scale)
    peft_model.save_pretrained(str(out))
    return out
