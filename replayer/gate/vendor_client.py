"""`HttpSampler`: sends a golden `VendorCase` to an OpenAI-compatible upstream, without a seed, and records the
version identifiers the answer carries (resolved ``model``, ``system_fingerprint``, version-like headers).

IO errors are translated here: unreachable, timeout, non-2xx or a body without text -> `GateInputError` (the
statistical gate counts such a sample as missing: similarity 0, every assertion failed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from replayer.errors import GateInputError
from replayer.gate.statistical import VERSION_HEADERS, Sample, VendorCase

_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}
_DROPPED = ("seed", "stream", "stream_options", "n", "logprobs", "top_logprobs", "return_token_ids")


def versions_of(data: dict[str, Any], headers: httpx.Headers, names: Sequence[str]) -> dict[str, str]:
    """Version identifiers of one answer: body ``model`` / ``system_fingerprint`` and the named headers."""
    out: dict[str, str] = {}
    if isinstance(data.get("model"), str):
        out["model"] = data["model"]
    if isinstance(data.get("system_fingerprint"), str):
        out["system_fingerprint"] = data["system_fingerprint"]
    for name in names:
        if (value := headers.get(name)) is not None:
            out[f"header:{name.lower()}"] = value
    return out


def text_of(endpoint: str, data: dict[str, Any]) -> str:
    choice = data["choices"][0]
    if endpoint == "chat.completions":
        content = choice["message"].get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class HttpSampler:
    """One blocking client per gate run; ``model`` overrides the recorded alias (e.g. a candidate model name)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        model: str | None = None,
        version_headers: Sequence[str] = VERSION_HEADERS,
        timeout_s: float = 120.0,
        client: httpx.Client | None = None,
    ) -> None:
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.Client(
            base_url=base_url.rstrip("/").removesuffix("/v1"), timeout=timeout_s, headers=headers
        )
        self._model = model
        self._names = tuple(h.lower() for h in version_headers)

    def body(self, case: VendorCase) -> dict[str, Any]:
        body = {k: v for k, v in case.body.items() if k not in _DROPPED}
        body.update(stream=False, n=1)
        if self._model:
            body["model"] = self._model
        return body

    def sample(self, case: VendorCase) -> Sample:
        try:
            resp = self._client.post(_PATHS[case.endpoint], json=self.body(case))
        except httpx.HTTPError as exc:
            raise GateInputError(f"{case.request_id}: upstream unreachable: {exc}") from exc
        if resp.status_code >= 400:
            raise GateInputError(f"{case.request_id}: upstream answered {resp.status_code}: {resp.text[:200]}")
        try:
            data = resp.json()
            text = text_of(case.endpoint, data)
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
            raise GateInputError(f"{case.request_id}: upstream answer without choices[0] text ({exc})") from exc
        return Sample(text=text, versions=versions_of(data, resp.headers, self._names))

    def close(self) -> None:
        self._client.close()
