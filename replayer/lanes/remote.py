"""The remote lane: a deterministic OpenAI-compatible vLLM server somewhere else (e.g. a GPU replay host).

A replay is one ``POST /v1/completions`` whose ``prompt`` is the recorded token id list (vLLM accepts token ids
as a prompt, so no tokenizer or chat template runs again), with the whole sampling contract, the seed (per the
seed scope), ``logprobs=k``, ``return_token_ids`` and ``return_tokens_as_token_ids``
(`replayer.lanes.vllm_params.completion_body`): each alternative then arrives as ``"token_id:123"``, so top-k
lists carry ids.

The lane cannot see the server's configuration: its fingerprint holds what the server reports (``/version``,
the ``system_fingerprint`` of a one-token probe at start) and leaves the rest unknown (``None``), which
`schemas.diff_fingerprints` treats as "not evidence of a change". Run the server itself as a fixed schedule
(``--max-num-seqs 1``, no prefix caching, batch invariance on GPUs) for it to be a replay lane.

IO errors are translated here: unreachable or 5xx -> `LaneUnavailableError`; 4xx -> `NotReplayableError`
carrying the server's message.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from replayer.errors import LaneUnavailableError, NotReplayableError
from replayer.lanes.adapters import refuse
from replayer.lanes.base import GenRequest
from replayer.lanes.vllm_params import completion_body
from replayer.settings import ReplayerSettings
from schemas import ReplayedOutput, RuntimeFingerprint, StepLogprobs, TopCandidate

TIMEOUT_S = 120.0
_ID_PREFIX = "token_id:"


def _token_id(token: str) -> int | None:
    if token.startswith(_ID_PREFIX):
        try:
            return int(token[len(_ID_PREFIX) :])
        except ValueError:
            return None
    return None


def steps_from_completion(choice: dict[str, Any], token_ids: Sequence[int], k: int) -> tuple[StepLogprobs, ...] | None:
    """The legacy completions ``logprobs`` object -> `StepLogprobs` (top-k sorted by logprob, at most k)."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    tokens: list[str] = lp.get("tokens") or []
    chosen: list[float | None] = lp.get("token_logprobs") or []
    tops: list[dict[str, float] | None] = lp.get("top_logprobs") or [None] * len(tokens)
    if not (len(tokens) == len(chosen) == len(tops) == len(token_ids)):
        raise LaneUnavailableError(
            f"remote lane: logprobs cover {len(tokens)} steps but the server returned {len(token_ids)} token ids"
        )
    steps = []
    for i, (tid, tok, c_lp, top) in enumerate(zip(token_ids, tokens, chosen, tops, strict=True)):
        if c_lp is None:
            raise LaneUnavailableError(f"remote lane: the server returned no logprob for generated token {i}")
        ranked = sorted((top or {}).items(), key=lambda kv: -kv[1])[:k]
        cands = tuple(
            TopCandidate(token=t, token_id=_token_id(t), logprob=float(v), rank=r)
            for r, (t, v) in enumerate(ranked, start=1)
        )
        steps.append(StepLogprobs(token_id=int(tid), token=tok, logprob=float(c_lp), top=cands))
    return tuple(steps)


class RemoteLane:
    """A remote deterministic vLLM server behind ``settings.remote_url``."""

    name = "remote"

    def __init__(self, settings: ReplayerSettings, *, client: httpx.Client | None = None) -> None:
        if not settings.remote_url:
            raise LaneUnavailableError("the remote lane needs REPROLANE_REPLAYER_REMOTE_URL")
        self._model = settings.served_model_name
        self._client = client or httpx.Client(base_url=settings.remote_url.rstrip("/"), timeout=TIMEOUT_S)
        version = self._get("/version").get("version")
        probe = self._post_completion(
            {"model": self._model, "prompt": [0], "max_tokens": 1, "temperature": 0.0, "stream": False}
        )
        self._fingerprint = RuntimeFingerprint(
            engine="vllm",
            engine_version=str(version) if version is not None else None,
            system_fingerprint=probe.get("system_fingerprint"),
        )

    def _get(self, path: str) -> dict[str, Any]:
        try:
            resp = self._client.get(path)
        except httpx.HTTPError as exc:
            raise LaneUnavailableError(f"remote lane unreachable ({path}): {exc}") from exc
        if resp.status_code >= 400:
            raise LaneUnavailableError(f"remote lane: {path} answered {resp.status_code}")
        data: dict[str, Any] = resp.json()
        return data

    def _post_completion(self, body: dict[str, Any]) -> dict[str, Any]:
        try:
            resp = self._client.post("/v1/completions", json=body)
        except httpx.HTTPError as exc:
            raise LaneUnavailableError(f"remote lane unreachable: {exc}") from exc
        if resp.status_code >= 500:
            raise LaneUnavailableError(f"remote lane: server error {resp.status_code}: {resp.text[:300]}")
        if resp.status_code >= 400:
            try:
                message = resp.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = resp.text[:300]
            raise NotReplayableError(f"remote lane rejected the replay ({resp.status_code}): {message}")
        data: dict[str, Any] = resp.json()
        return data

    def fingerprint(self) -> RuntimeFingerprint:
        return self._fingerprint

    def replay(self, request: GenRequest) -> ReplayedOutput:
        refuse(request.adapter, self.name)  # the server's copy of an adapter cannot be checked from here
        data = self._post_completion(completion_body(self._model, request))
        try:
            choice = data["choices"][0]
            token_ids = tuple(int(t) for t in choice["token_ids"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise LaneUnavailableError(f"remote lane: response without choices[0].token_ids ({exc})") from exc
        return ReplayedOutput(
            token_ids=token_ids,
            text=choice.get("text") or "",
            logprobs=steps_from_completion(choice, token_ids, request.top_k_logprobs),
            finish_reason=choice.get("finish_reason"),
        )

    def close(self) -> None:
        self._client.close()
