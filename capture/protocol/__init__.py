"""The OpenAI protocol as the capture sidecar reads and rewrites it (pure: no IO, no clock).

One module per endpoint, as vLLM's ``entrypoints/openai`` keeps one protocol module per endpoint, and the
parts both endpoints share:

- `chat` / `completions`: what is particular to ``/v1/chat/completions`` and ``/v1/completions``: the
  logprobs each asks for and answers with, where a choice's text is, and (completions) the echoed prompt.
- `responses` / `messages`: ``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic Messages):
  their own request fields, typed SSE events and answer shapes, and what their server cannot return.
- `endpoints`: one `EndpointProtocol` per endpoint (`ENDPOINTS`): wherever the endpoints differ, the request
  flow asks it (its path, the audit fields it asks for, how its answers and stream events are read and stripped,
  its output bound, how its prompt is tokenized) instead of comparing names.
- `audit_fields`: `prepare` adds the audit fields to the upstream request (token ids, logprobs at the audit k,
  an injected seed); `strip` takes what the client did not ask for back out of each response object.
- `sampling`: the sampling contract read from a request, upstream's defaults made explicit.
- `credentials`: what looks like a credential (field names in any style), kept out of the contract and
  scrubbed from the upstream error messages an envelope records.
- `output`: `OutputCollector`, what upstream produced per choice, collected from a whole body or SSE chunks.
- `token_text`: how upstream spells a token (``token_id:N``) and the text kept for it.
- `sse`: the framing of a streamed answer (server-sent events).

May import `schemas` (and pydantic); nothing else of the sidecar's: not its IO (`capture.request.edge`,
`capture.request.upstream`, the spool) nor `capture.audit`. The request flow (`capture.request.proxy`,
`capture.request.non_streaming`, `capture.request.streaming`) calls this package, never the other way round.
"""

from schemas.envelope import Endpoint

__all__ = ["Endpoint"]
