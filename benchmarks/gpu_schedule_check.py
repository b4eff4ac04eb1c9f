"""Shape-only replay on CUDA: does a request's output depend on its batch companions' *content*, or only on shapes?

Issue #22's design (docs/SCHEDULE_REPLAY.md) rests on one property of the kernels: a request's numbers are a
function of the batch's shapes (how many rows, how long each, where the target sits), not of what the other rows
hold, so a replay can put random filler tokens where other tenants' requests were. vLLM CPU shows it; this is the
prepared check for a GPU host, where vLLM is not installed, with transformers (the same cuBLAS GEMMs and the same
kind of attention kernels that vLLM's dense models use; a paged-attention engine adds its own shape rules,
listed in docs/SCHEDULE_REPLAY.md).

For each prompt of the workload as the target, greedy, a fixed number of steps for every row (so every row has
the same length at every step: the shapes are the same whatever is generated):

  batched   the target among the other prompts (left-padded, one batch), its per-step logits
  fillers   the same batch with every other row replaced by random token ids of the same length (same mask):
            the claim is that the target's logits are bitwise those of `batched`
  alone     the target alone: the control, expected to differ (batch shape changed), so the check has teeth

Printed as markdown and written as JSON (`--out`). Runs on the CPU too (``--device cpu``) to try it out.

  python3 benchmarks/gpu_schedule_check.py --model-dir /tmp/smollm2-bf16 --dtype bfloat16 --out $OUT/shapes.json

The model folder comes from `gpu_lane_check.py unpack` (it travels packed: see that script).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ROOT / "infra" / "workload" / "prompts.json"


def _prompts(tokenizer: Any, limit: int) -> list[list[int]]:
    doc = json.loads(WORKLOAD.read_text(encoding="utf-8"))
    out: list[list[int]] = []
    for item in doc["prompts"][:limit]:
        messages = [{"role": "system", "content": doc["system"]}, {"role": "user", "content": item["text"]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def _greedy_logits(model: Any, rows: list[list[int]], steps: int, device: str) -> list[Any]:
    """Per row, the logits of each of `steps` greedy steps (left padding, one batch, KV cache)."""
    import torch

    width = max(len(r) for r in rows)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows], device=device)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    per_row: list[list[Any]] = [[] for _ in rows]
    past = None
    with torch.inference_mode():
        for _ in range(steps):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            step_ids = ids if past is None else ids[:, -1:]
            step_pos = positions if past is None else positions[:, -1:]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=step_pos, past_key_values=past)
            past = out.past_key_values
            logits = out.logits[:, -1, :].float()
            for i in range(len(rows)):
                per_row[i].append(logits[i].cpu())
            nxt = logits.argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=1)
    return [torch.stack(r) for r in per_row]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).to(args.device).eval()
    prompts = _prompts(tokenizer, args.limit)
    gen = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    t0 = time.perf_counter()
    batched = _greedy_logits(model, prompts, args.steps, args.device)
    rows: list[dict[str, Any]] = []
    for target, ids in enumerate(prompts):
        fillers = [
            ids if i == target else torch.randint(10, vocab, (len(p),), generator=gen).tolist()
            for i, p in enumerate(prompts)
        ]
        assert all(f != p for i, (f, p) in enumerate(zip(fillers, prompts, strict=True)) if i != target)
        with_fillers = _greedy_logits(model, fillers, args.steps, args.device)[target]
        alone = _greedy_logits(model, [ids], args.steps, args.device)[0]
        ref = batched[target]
        rows.append(
            {
                "target": target,
                "prompt_tokens": len(ids),
                "fillers_bitwise": bool(torch.equal(with_fillers, ref)),
                "fillers_max_abs_diff": float((with_fillers - ref).abs().max()),
                "alone_bitwise": bool(torch.equal(alone, ref)),
                "alone_max_abs_diff": float((alone - ref).abs().max()),
            }
        )
    return {
        "device": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "dtype": args.dtype,
        "prompts": len(prompts),
        "steps": args.steps,
        "seconds": round(time.perf_counter() - t0, 1),
        "fillers_bitwise": sum(r["fillers_bitwise"] for r in rows),
        "alone_bitwise": sum(r["alone_bitwise"] for r in rows),
        "rows": rows,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--limit", type=int, default=12)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    result = run(args)
    n = result["prompts"]
    print(f"| {result['device']} {result['dtype']} | fillers bitwise | alone bitwise |")
    print("| --- | --- | --- |")
    shapes = f"{n} targets x {result['steps']} steps"
    print(f"| {shapes} | {result['fillers_bitwise']}/{n} | {result['alone_bitwise']}/{n} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1), encoding="utf-8")
    sys.exit(0 if result["fillers_bitwise"] == n else 1)


if __name__ == "__main__":
    main()
