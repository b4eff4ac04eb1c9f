"""The columns of a list of step records (one choice's per-token logprobs) in a compact envelope.

Per list of n steps: the candidate counts, the chosen ids, the chosen token's reference (``j`` + 1 when candidate
``j`` has its id and logprob, else 0), its token's state (0 none, 1 stored, 2 the referenced candidate's), the
stored chosen tokens and the unreferenced chosen logprobs; then over all candidates: tokens, ids (those of
referenced candidates left out: they are the chosen id; 0 none, ``id + 1``, or a negative id as it is),
logprobs and ranks (0 none, else zigzag of ``rank - (j + 1)`` + 1: zero for the usual 1, 2, 3, ...). Decoded as
the rows `schemas.envelope_codec.steps_canonical_text` writes. Pure: no IO.
"""

from __future__ import annotations

import struct
from typing import Any, Final

from schemas.compact_columns import MAX_VALUES, FrameReader, pack_floats, pack_ints, pack_strings
from schemas.envelope_codec import StepRow, TopRow
from schemas.errors import ContractError

_STEP_KEYS: Final = frozenset({"logprob", "token", "token_id", "top"})
_CAND_KEYS: Final = frozenset({"logprob", "rank", "token", "token_id"})


def is_steps(value: Any) -> bool:
    """A non-empty list of step records exactly as a validated envelope dumps them (module docstring)."""
    if type(value) is not list or not value:
        return False
    for step in value:
        if type(step) is not dict or not (step.keys() <= _STEP_KEYS) or len(step) < 3:
            return False
        if type(step.get("token_id")) is not int or type(step.get("logprob")) is not float:
            return False
        if type(step.get("top")) is not list or ("token" in step and type(step["token"]) is not str):
            return False
        for cand in step["top"]:
            if type(cand) is not dict or not (cand.keys() <= _CAND_KEYS) or not ({"logprob", "token"} <= cand.keys()):
                return False
            if type(cand["logprob"]) is not float or type(cand["token"]) is not str:
                return False
            for name in ("rank", "token_id"):
                if name in cand and type(cand[name]) is not int:
                    return False
    return True


def encode_steps(steps: list[dict[str, Any]]) -> list[bytes]:
    """The columns of a list of step records (`is_steps`)."""
    counts, chosen_ids, refs, states, chosen_tokens, chosen_lps = [], [], [], [], [], []
    cand_tokens, cand_ids, cand_lps, cand_ranks = [], [], [], []
    for step in steps:
        top, tid, lp, token = step["top"], step["token_id"], step["logprob"], step.get("token")
        counts.append(len(top))
        chosen_ids.append(tid)
        ref = 0
        for j, cand in enumerate(top):
            if cand.get("token_id") == tid and type(cand.get("token_id")) is int and _same_float(cand["logprob"], lp):
                ref = j + 1
                break
        refs.append(ref)
        if ref == 0:
            chosen_lps.append(lp)
        if token is None:
            states.append(0)
        elif ref and top[ref - 1]["token"] == token:
            states.append(2)
        else:
            states.append(1)
            chosen_tokens.append(token)
        for j, cand in enumerate(top):
            cand_tokens.append(cand["token"])
            cand_lps.append(cand["logprob"])
            rank = cand.get("rank")
            cand_ranks.append(0 if rank is None else _zigzag(rank - (j + 1)) + 1)
            if j + 1 != ref:
                cid = cand.get("token_id")
                cand_ids.append(0 if cid is None else cid + 1 if cid >= 0 else cid)
    return [
        pack_ints(counts),
        pack_ints(chosen_ids),
        pack_ints(refs),
        pack_ints(states),
        *pack_strings(chosen_tokens),
        pack_floats(chosen_lps),
        *pack_strings(cand_tokens),
        pack_ints(cand_ids),
        pack_floats(cand_lps),
        pack_ints(cand_ranks),
    ]


def _same_float(a: float, b: float) -> bool:
    return a == b and struct.pack("<d", a) == struct.pack("<d", b)  # -0.0 and 0.0 differ in text


def _zigzag(n: int) -> int:
    return 2 * n if n >= 0 else -2 * n - 1


def _unzigzag(n: int) -> int:
    return n // 2 if n % 2 == 0 else -(n + 1) // 2


def decode_steps(reader: FrameReader, n: int) -> list[StepRow]:
    """The rows of `n` step records (`encode_steps` in reverse), every count and reference checked."""
    counts = reader.ints(n)
    chosen_ids = reader.ints(n)
    refs = reader.ints(n)
    states = reader.ints(n)
    if any(c < 0 for c in counts) or sum(counts) > MAX_VALUES:
        raise ContractError("compact envelope: a step count is out of range")
    if any(not 0 <= r <= c for r, c in zip(refs, counts, strict=True)) or any(s not in (0, 1, 2) for s in states):
        raise ContractError("compact envelope: a step reference is out of range")
    if any(s == 2 and not r for s, r in zip(states, refs, strict=True)):
        raise ContractError("compact envelope: a step's token refers to no candidate")
    chosen_tokens = iter(reader.strings(states.count(1)))
    chosen_lps = iter(reader.floats(refs.count(0)))
    total = sum(counts)
    cand_tokens = reader.strings(total)
    cand_ids = iter(reader.ints(total - sum(1 for r in refs if r)))
    cand_lps = reader.floats(total)
    cand_ranks = reader.ints(total)
    rows: list[StepRow] = []
    at = 0
    for count, tid, ref, state in zip(counts, chosen_ids, refs, states, strict=True):
        top: list[TopRow] = []
        for j in range(count):
            if j + 1 == ref:
                cid: int | None = tid
            else:
                code = next(cand_ids)
                cid = None if code == 0 else code - 1 if code > 0 else code
            rank_code = cand_ranks[at]
            rank = None if rank_code == 0 else _unzigzag(rank_code - 1) + j + 1
            top.append(TopRow(cand_lps[at], rank, cand_tokens[at], cid))
            at += 1
        lp = cand_lps[at - count + ref - 1] if ref else next(chosen_lps)
        token = None if state == 0 else next(chosen_tokens) if state == 1 else cand_tokens[at - count + ref - 1]
        rows.append(StepRow(lp, token, tid, top))
    return rows


def steps_dicts(rows: list[StepRow]) -> list[dict[str, Any]]:
    """Rows as the JSON-mode dicts they stand for (the generic path, for what msgspec may not write)."""
    out = []
    for row in rows:
        top = [
            {k: v for k, v in zip(TopRow.__struct_fields__, (c.logprob, c.rank, c.token, c.token_id), strict=True)
             if v is not None}
            for c in row.top
        ]  # fmt: skip
        step = {"logprob": row.logprob, "token": row.token, "token_id": row.token_id, "top": top}
        out.append({k: v for k, v in step.items() if v is not None})
    return out
