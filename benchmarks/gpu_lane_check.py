"""The transformers lane on CUDA: batch variance, deterministic mode, and a CPU-recorded replay on the GPU.

One prepared run for the device machine (an H200 lent for minutes; no vLLM there, no model, no internet).

  pack       the model's weights rounded to bfloat16 (what vLLM serves with ``dtype=bfloat16``) as two
             lzma-compressed byte planes, the low plane split into pieces: at most 64 MiB travel per device call
  unpack     the pieces back into a model folder (bf16 safetensors, config, tokenizer); checks each tensor's sha256
  reference  the transformers lane on the CPU (float32, deterministic): the workload prompts, greedy, top-5,
             written as JSON, the "capture" the GPU replays
  run        the measurements, printed as markdown and written as JSON:
             1. logits: one forward pass of a prompt in a batch of N identical copies against N = 1 (no
                padding, so only the kernels' batch-size dependence shows), bfloat16 and float32,
                ``torch.use_deterministic_algorithms`` off and on;
             2. generate: each prompt alone against all prompts in one left-padded ``generate`` call (the way
                transformers batches), and alone again, same dtypes and modes;
             3. lane: the product's `TransformersLane` replays every prompt twice (run-to-run), and against the
                CPU reference through `replayer.compare` (the verdict a real replay would give).

Commands (this machine, then the device; see BENCHMARKS.md, "The transformers lane on CUDA"):

  .venv/bin/python benchmarks/gpu_lane_check.py pack --out .gpu/pack
  .venv/bin/python benchmarks/gpu_lane_check.py unpack --pack .gpu/pack --out /tmp/smollm2-bf16
  .venv/bin/python benchmarks/gpu_lane_check.py reference --model-dir /tmp/smollm2-bf16 --out .gpu/pack/cpu.json
  python3 benchmarks/gpu_lane_check.py run --model-dir /tmp/m --reference .gpu/pack/cpu.json --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import lzma
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

# Read when the first cuBLAS handle is made: set before torch touches the GPU, in both modes, so that turning
# deterministic algorithms on is the only difference between them.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)
WORKLOAD = ROOT / "infra" / "workload" / "prompts.json"
COPIES = (1, 2, 3, 4, 8, 16, 32, 64)


# -- pack / unpack --------------------------------------------------------------------------------------------


def pack(model_dir: Path, out: Path, first_piece: int, piece: int) -> None:
    import numpy as np
    import torch
    from safetensors import safe_open

    out.mkdir(parents=True, exist_ok=True)
    index: list[dict[str, Any]] = []
    planes: list[Any] = []
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            bits = f.get_tensor(name).to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            index.append(
                {"name": name, "shape": list(bits.shape), "sha256": hashlib.sha256(bits.tobytes()).hexdigest()}
            )
            planes.append(bits.ravel())
    flat = np.concatenate(planes)
    (out / "hi.xz").write_bytes(lzma.compress((flat >> 8).astype(np.uint8).tobytes(), preset=6))
    low = lzma.compress((flat & 0xFF).astype(np.uint8).tobytes(), preset=0)  # mantissa bits: barely compressible
    bounds = [0, min(first_piece, len(low))]
    while bounds[-1] < len(low):
        bounds.append(min(bounds[-1] + piece, len(low)))
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        (out / f"lo.xz.{k:02d}").write_bytes(low[a:b])
    (out / "index.json").write_text(json.dumps({"dtype": "bfloat16", "tensors": index}), encoding="utf-8")
    for name in SMALL_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    for p in sorted(out.iterdir()):
        print(f"{p.stat().st_size:>12,}  {p.name}")


def unpack(pieces: list[Path], out: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    def find(name: str) -> Path:
        for d in pieces:
            if (d / name).is_file():
                return d / name
        raise SystemExit(f"unpack: {name} is in none of {[str(d) for d in pieces]}")

    index = json.loads(find("index.json").read_text(encoding="utf-8"))
    hi = np.frombuffer(lzma.decompress(find("hi.xz").read_bytes()), dtype=np.uint8)
    lows = sorted({p.name for d in pieces for p in d.glob("lo.xz.*")})
    lo = np.frombuffer(lzma.decompress(b"".join(find(n).read_bytes() for n in lows)), dtype=np.uint8)
    flat = (hi.astype(np.uint16) << 8) | lo
    tensors: dict[str, Any] = {}
    at = 0
    for entry in index["tensors"]:
        n = int(np.prod(entry["shape"])) if entry["shape"] else 1
        bits = flat[at : at + n].reshape(entry["shape"])
        at += n
        if hashlib.sha256(bits.tobytes()).hexdigest() != entry["sha256"]:
            raise SystemExit(f"unpack: tensor {entry['name']} does not match its sha256")
        tensors[entry["name"]] = torch.from_numpy(bits.view(np.int16).copy()).view(torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for name in SMALL_FILES:
        shutil.copy2(find(name), out / name)
    print(f"unpacked {len(tensors)} tensors ({at:,} bfloat16 values) into {out}")


# -- shared ---------------------------------------------------------------------------------------------------


def prompts(model_dir: Path, limit: int) -> tuple[list[str], list[tuple[int, ...]]]:
    from replayer.lanes.batch_engine import render_chat
    from replayer.matrix.inputs import load_prompt_file, spread

    workload = spread(load_prompt_file(WORKLOAD), limit)
    return list(workload.ids), render_chat(model_dir, workload.prompts, workload.system)


def lane_outputs(model_dir: Path, ids: list[tuple[int, ...]], max_tokens: int) -> tuple[Any, list[Any], float]:
    from replayer.lanes.base import GenRequest
    from replayer.lanes.transformers_lane import TransformersLane
    from replayer.settings import ReplayerSettings
    from schemas import SamplingContract

    lane = TransformersLane(ReplayerSettings(lane="transformers", model_dir=model_dir))
    greedy = SamplingContract(temperature=0.0, seed_scope="none", max_tokens=max_tokens, logprobs=5)
    lane.replay(GenRequest(ids[0][:4], greedy, max_tokens=1, top_k_logprobs=5))  # warm-up
    t0 = time.perf_counter()
    outs = [lane.replay(GenRequest(p, greedy, max_tokens=max_tokens, top_k_logprobs=5)) for p in ids]
    seconds = time.perf_counter() - t0
    return lane, outs, sum(len(o.token_ids) for o in outs) / seconds


def reference(model_dir: Path, out: Path, limit: int, max_tokens: int) -> None:
    names, ids = prompts(model_dir, limit)
    lane, outs, tps = lane_outputs(model_dir, ids, max_tokens)
    doc = {
        "fingerprint": lane.fingerprint().model_dump(mode="json"),
        "max_tokens": max_tokens,
        "items": [
            {"id": n, "prompt_token_ids": list(p), "output": o.model_dump(mode="json")}
            for n, p, o in zip(names, ids, outs, strict=True)
        ],
    }
    out.write_text(json.dumps(doc), encoding="utf-8")
    print(f"{len(outs)} replays on the CPU lane, {tps:.1f} tokens/s -> {out}")


# -- run: the measurements ------------------------------------------------------------------------------------


def load_model(model_dir: Path, dtype: str, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    return model.eval()


def copies_logits(model: Any, ids: tuple[int, ...], device: str) -> dict[str, float]:
    """max |logit difference| at the last position, N identical copies in one forward pass against N = 1."""
    import torch

    row = torch.tensor([list(ids)], device=device)
    with torch.inference_mode():
        base = model(row).logits[0, -1].float()
        out = {}
        for n in COPIES[1:]:
            logits = model(row.repeat(n, 1)).logits[:, -1].float()
            out[str(n)] = float((logits - base).abs().max())
    return out


def truncate(tokens: list[int], lps: list[float], eos: set[int]) -> tuple[list[int], list[float]]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1], lps[: i + 1]
    return tokens, lps


def generate(
    model: Any, batch: list[tuple[int, ...]], max_tokens: int, eos: set[int], pad: int, device: str
) -> list[tuple[list[int], list[float]]]:
    """Greedy generation of the prompts in one call (left-padded): per prompt, its tokens and their logprobs."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
            output_logits=True,
            return_dict_in_generate=True,
        )
        new = out.sequences[:, width:]
        lps = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)  # (batch, steps, vocab)
        chosen = lps.gather(2, new[:, : lps.shape[1], None])[..., 0]
    return [truncate(new[i].tolist(), chosen[i].tolist(), eos) for i in range(len(batch))]


def divergence(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> dict[str, Any]:
    (ta, la), (tb, lb) = a, b
    first = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
    if first is None and len(ta) != len(tb):
        first = min(len(ta), len(tb))
    common = first if first is not None else len(ta)
    diffs = [abs(x - y) for x, y in zip(la[:common], lb[:common], strict=False)]
    return {
        "tokens_equal": ta == tb,
        "bitwise": ta == tb and la == lb,
        "first_divergence": first,
        "max_abs_logprob_diff_before": max(diffs, default=0.0),
    }


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    forks = sorted(r["first_divergence"] for r in rows if r["first_divergence"] is not None)
    return {
        "n": len(rows),
        "tokens_equal": sum(r["tokens_equal"] for r in rows),
        "bitwise": sum(r["bitwise"] for r in rows),
        "fork_positions": forks,
        "max_abs_logprob_diff_before": max((r["max_abs_logprob_diff_before"] for r in rows), default=0.0),
    }


def batch_variance(model_dir: Path, ids: list[tuple[int, ...]], max_tokens: int, device: str) -> list[dict[str, Any]]:
    import torch

    cells = []
    for dtype in ("bfloat16", "float32"):
        model = load_model(model_dir, dtype, device)
        eos_cfg = model.generation_config.eos_token_id
        eos = {eos_cfg} if isinstance(eos_cfg, int) else set(eos_cfg or [])
        pad = model.generation_config.pad_token_id or min(eos)
        for deterministic in (False, True):
            torch.use_deterministic_algorithms(deterministic)
            t0 = time.perf_counter()
            alone = [generate(model, [p], max_tokens, eos, pad, device)[0] for p in ids]
            alone_s = time.perf_counter() - t0
            again = [generate(model, [p], max_tokens, eos, pad, device)[0] for p in ids]
            t0 = time.perf_counter()
            together = generate(model, ids, max_tokens, eos, pad, device)
            together_s = time.perf_counter() - t0
            together_again = generate(model, ids, max_tokens, eos, pad, device)
            logits = [copies_logits(model, p, device) for p in ids]
            cells.append(
                {
                    "dtype": dtype,
                    "deterministic": deterministic,
                    "alone_again": summarize([divergence(a, b) for a, b in zip(alone, again, strict=True)]),
                    "batched": summarize([divergence(a, b) for a, b in zip(alone, together, strict=True)]),
                    "batched_again": summarize(
                        [divergence(a, b) for a, b in zip(together, together_again, strict=True)]
                    ),
                    "copies_max_abs_logit_diff": {n: max(row[n] for row in logits) for n in logits[0]},
                    "tokens_per_s_alone": sum(len(t) for t, _ in alone) / alone_s,
                    "tokens_per_s_batched": sum(len(t) for t, _ in together) / together_s,
                }
            )
            print(json.dumps(cells[-1]), flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    torch.use_deterministic_algorithms(False)
    return cells


def lane_check(
    model_dir: Path, ids: list[tuple[int, ...]], max_tokens: int, ref: dict[str, Any] | None
) -> dict[str, Any]:
    from replayer.compare import compare
    from replayer.settings import Thresholds
    from schemas import Choice, ReplayedOutput, RuntimeFingerprint, diff_fingerprints

    lane, first, tps = lane_outputs(model_dir, ids, max_tokens)
    _, second, _ = lane_outputs(model_dir, ids, max_tokens)  # a second lane: a fresh model, same process
    pairs = [
        divergence(
            (list(a.token_ids), [s.logprob for s in a.logprobs or ()]),
            (list(b.token_ids), [s.logprob for s in b.logprobs or ()]),
        )
        for a, b in zip(first, second, strict=True)
    ]
    result: dict[str, Any] = {
        "fingerprint": lane.fingerprint().model_dump(mode="json"),
        "tokens_per_s": tps,
        "run_to_run": summarize(pairs),
    }
    if ref is not None:
        ref_fp = RuntimeFingerprint.model_validate(ref["fingerprint"])
        diffs = diff_fingerprints(ref_fp, lane.fingerprint())
        verdicts = []
        for item, out in zip(ref["items"], first, strict=True):
            if tuple(item["prompt_token_ids"]) != ids[len(verdicts)]:
                raise SystemExit("the reference was made from other prompts")
            rec = ReplayedOutput.model_validate(item["output"])
            recorded = Choice(
                index=0, token_ids=rec.token_ids, text=rec.text, finish_reason=rec.finish_reason, logprobs=rec.logprobs
            )
            c = compare(recorded, out, Thresholds(), "token", fingerprint_diffs=diffs)
            verdicts.append(
                {
                    "id": item["id"],
                    "levels_held": list(c.levels_held),
                    "verdict": c.verdict,
                    "first_divergence": c.first_divergence.position if c.first_divergence else None,
                    "max_abs_logprob_diff": c.max_abs_logprob_diff,
                    "cause_hint": c.cause_hint,
                }
            )
        result["against_cpu"] = {"fingerprint_diffs": [d.field for d in diffs], "items": verdicts}
    lane.close()
    return result


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        f"Device: {doc['device_name']}, torch {doc['torch']}, transformers {doc['transformers']}, "
        f"float32 matmul precision {doc['float32_matmul_precision']!r}, attention {doc['attention']!r}; "
        f"{doc['prompts']} prompts, {doc['max_tokens']} tokens, greedy.",
        "",
        "| dtype | deterministic | alone again: bitwise | batched again: bitwise | batched vs alone: tokens "
        "equal | fork positions | max abs logprob diff before fork | N identical copies: max abs logit diff vs "
        "N=1 | tokens/s alone / batched |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in doc["batch_variance"]:
        a, b, bb = c["alone_again"], c["batched"], c["batched_again"]
        copies = ", ".join(f"{n}: {v:.2g}" for n, v in c["copies_max_abs_logit_diff"].items())
        lines.append(
            f"| {c['dtype']} | {'on' if c['deterministic'] else 'off'} | {a['bitwise']}/{a['n']} | "
            f"{bb['bitwise']}/{bb['n']} | {b['tokens_equal']}/{b['n']} | {b['fork_positions'] or '-'} | "
            f"{b['max_abs_logprob_diff_before']:.3g} | {copies} | "
            f"{c['tokens_per_s_alone']:.0f} / {c['tokens_per_s_batched']:.0f} |"
        )
    lane = doc["lane"]
    r = lane["run_to_run"]
    lines += [
        "",
        f"TransformersLane (float32, deterministic, one sequence at a time): two lanes, run to run "
        f"{r['bitwise']}/{r['n']} bitwise, {r['tokens_equal']}/{r['n']} token-equal; "
        f"{lane['tokens_per_s']:.0f} tokens/s; "
        f"fingerprint: {lane['fingerprint']['device_name']}, CUDA {lane['fingerprint']['cuda_version']}, "
        f"cuBLAS {lane['fingerprint']['cublas_version']}, attention {lane['fingerprint']['attention_backend']}.",
    ]
    if "against_cpu" in lane:
        items = lane["against_cpu"]["items"]
        held = {lvl: sum(lvl in i["levels_held"] for i in items) for lvl in ("bitwise", "token", "numeric")}
        worst = max((i["max_abs_logprob_diff"] or 0.0 for i in items), default=0.0)
        forks = sorted(i["first_divergence"] for i in items if i["first_divergence"] is not None)
        lines.append(
            f"Replaying the CPU lane's outputs on the GPU lane (replayer.compare, fingerprint diffs "
            f"{lane['against_cpu']['fingerprint_diffs']}): bitwise {held['bitwise']}/{len(items)}, "
            f"token {held['token']}/{len(items)}, numeric {held['numeric']}/{len(items)}; fork positions "
            f"{forks or '-'}; max abs logprob diff {worst:.3g}."
        )
    return "\n".join(lines)


def run(model_dir: Path, ref_path: Path | None, out: Path, limit: int, max_tokens: int) -> None:
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = json.loads(ref_path.read_text(encoding="utf-8")) if ref_path else None
    names, ids = prompts(model_dir, limit)
    if ref is not None and len(ref["items"]) != len(ids):
        raise SystemExit(f"the reference has {len(ref['items'])} items, this run {len(ids)}: use the same --limit")
    t0 = time.perf_counter()
    cells = batch_variance(model_dir, ids, max_tokens, device)
    lane = lane_check(model_dir, ids, max_tokens, ref)
    doc = {
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "attention": lane["fingerprint"]["attention_backend"],
        "prompts": len(ids),
        "prompt_ids": names,
        "max_tokens": max_tokens,
        "seconds": time.perf_counter() - t0,
        "batch_variance": cells,
        "lane": lane,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(markdown(doc))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument(
        "--model-dir", type=Path, default=Path("~/.cache/reprolane/models/smollm2-135m-instruct").expanduser()
    )
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--first-piece-mb", type=float, default=5.0)
    p.add_argument("--piece-mb", type=float, default=62.0)
    p = sub.add_parser("unpack")
    p.add_argument("--pack", type=Path, action="append", required=True, help="a folder holding pieces (repeatable)")
    p.add_argument("--out", type=Path, required=True)
    for name in ("reference", "run"):
        p = sub.add_parser(name)
        p.add_argument("--model-dir", type=Path, required=True)
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--limit", type=int, default=12)
        p.add_argument("--max-tokens", type=int, default=32)
        if name == "run":
            p.add_argument("--reference", type=Path)
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.model_dir, args.out, int(args.first_piece_mb * 1e6), int(args.piece_mb * 1e6))
    elif args.cmd == "unpack":
        unpack(args.pack, args.out)
    elif args.cmd == "reference":
        reference(args.model_dir, args.out, args.limit, args.max_tokens)
    else:
        run(args.model_dir, args.reference, args.out, args.limit, args.max_tokens)


if __name__ == "__main__":
    main()
