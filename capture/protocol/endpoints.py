"""One object per endpoint: where the four captured endpoints differ, the sidecar asks the endpoint's
`EndpointProtocol` (``ENDPOINTS[endpoint]``) and never compares endpoint names.

Two families, as vLLM serves them:

- **choices** (``/v1/chat/completions``, ``/v1/completions``): the OpenAI answer with ``choices``, streamed as bare
  ``data:`` events, an error as a document with ``error`` and no ``choices``. The collector reads the choices
  itself, asking the endpoint's module (`capture.protocol.chat`, `capture.protocol.completions`) where a choice's
  text, logprobs and tool calls are (`ChoiceReader`).
- **typed** (``/v1/responses``, ``/v1/messages``): their own request fields and answer shapes, streamed as typed
  events (``event: ...`` before each ``data:``); their modules read the answer (``collect``), name an error
  (``error_of``), give the sampling fields in the chat spelling (``contract_body``) and say what their server
  cannot return (``limits``).

A new endpoint is one module and one entry in `ENDPOINTS` (and its name in `schemas.envelope.Endpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

from capture.protocol import chat, completions, messages, responses
from capture.protocol.sse import split_data, split_typed_data
from schemas.envelope import Endpoint
from schemas.envelope_codec import StepRow

Json = dict[str, Any]
Asked = tuple[bool, bool, int | None]
"""What `EndpointProtocol.ask` answers: the client asked for the token ids itself, it asked for logprobs itself
(it then gets them), the k of logprobs the envelope records (None: none recorded)."""


class ChoiceReader(Protocol):
    """Where a choice of a choices-family answer keeps its parts (the module `capture.protocol.chat` or
    `capture.protocol.completions`)."""

    def choice_text(self, choice: Json) -> Any: ...

    def add_steps(self, steps: list[StepRow], lp: Json) -> None: ...

    def add_tool_calls(self, calls: dict[int, dict[str, str]], choice: Json) -> None: ...


@dataclass(frozen=True, slots=True)
class EndpointProtocol:
    """What the sidecar needs to know of one endpoint (see the module docstring for the two families)."""

    name: Endpoint
    path: str
    ask: Callable[[Json, Json, int], Asked]
    """Add the audit fields to the upstream body (second argument) for the client's body (first) at an audit k."""
    max_tokens: Callable[[Json], Any]
    """The output bound the request sets, as upstream reads it (None: upstream's default applies)."""
    tokenize_doc: Callable[[Json], Json | None]
    """The ``/tokenize`` document that renders the request's prompt as upstream does (None: it cannot)."""
    error_of: Callable[[Json], Any] | None = None
    """Typed family: upstream's error in one answer object or stream event, or None. (A choices-family error is a
    document with ``error`` and no ``choices``, whatever its value: `read_event`.)"""
    injects_seed: bool = True
    """A sampled request without a seed may get one (policy); Messages forwards no field of ours."""
    raw_prompts: bool = False
    """The request sends prompts, not messages (completions: a text, token ids, or several of either; choice i
    answers prompt i // n), and may ask them back in the answer (``echo``)."""
    choices: ChoiceReader | None = None
    """Choices family: where a choice keeps its text, logprobs and tool calls. None: a typed endpoint."""
    collect: Callable[[Any, Json], None] | None = None
    """Typed family: record one answer object or event into an `capture.protocol.output.OutputCollector`."""
    contract_body: Callable[[Json], Json] | None = None
    """Typed family: the upstream body in the chat spelling `capture.protocol.sampling` reads."""
    strip: Callable[..., Json] | None = None
    """Typed family: one answer object without the token ids and logprobs the client did not ask for."""
    limits: tuple[str, ...] = ()
    """What the endpoint's server cannot return (`schemas.Envelope.capture_limits`)."""
    tokenizes_answer: bool = False
    """The answer carries no token ids: the sidecar tokenizes its text (Messages)."""
    unrendered: str | None = None
    """The capture limit an envelope records when the prompt's ids were neither returned nor rendered here."""

    def __post_init__(self) -> None:
        if (self.choices is None) == (self.collect is None):
            raise ValueError(f"{self.name}: an endpoint's answer is read either by choices or by its own collect")

    @property
    def typed(self) -> bool:
        """Its own request fields, answer shapes and typed stream events (Responses, Messages)."""
        return self.choices is None

    def split_event(self, event: bytes) -> tuple[bytes, bytes, bytes] | None:
        """(prefix, data, ending) of a stream event that carries one JSON document, spelled as upstream spelled it;
        None for any other event (`capture.protocol.sse`)."""
        return split_typed_data(event) if self.typed else split_data(event)

    def read_event(self, collector: Any, obj: Json) -> tuple[bool, Any]:
        """Record one streamed answer object into `collector`; whether upstream reported an error in it, and what it
        said. A choices-family error document is no answer and records nothing; a typed event is recorded either
        way (a failed response still holds what was partial)."""
        if self.choices is not None:
            if "error" in obj and "choices" not in obj:
                return True, obj["error"]
            collector.add(obj)
            return False, None
        said = None if self.error_of is None else self.error_of(obj)
        collector.add(obj)
        return said is not None, said


def _choices_ask(ask_logprobs: Callable[[Json, Json, int], tuple[bool, Any]]) -> Callable[[Json, Json, int], Asked]:
    """`EndpointProtocol.ask` of a choices endpoint: its token ids (``return_token_ids``), then its logprobs."""

    def ask(body: Json, up: Json, audit_k: int) -> Asked:
        client_token_ids = bool(body.get("return_token_ids"))
        up["return_token_ids"] = True
        client_logprobs, recorded_k = ask_logprobs(body, up, audit_k)
        return client_token_ids, client_logprobs, recorded_k if isinstance(recorded_k, int) else None

    return ask


def _chat_spelled_max_tokens(body: Json) -> Any:
    """A typed endpoint's bound, read from `EndpointProtocol.contract_body`'s chat spelling."""
    return body.get("max_tokens")


def _prompt_doc(body: Json) -> Json | None:
    """The ``/tokenize`` document of a text prompt (None for token ids, several prompts or none)."""
    prompt = body.get("prompt")
    return {"prompt": prompt} if isinstance(prompt, str) else None


ENDPOINTS: Final[dict[Endpoint, EndpointProtocol]] = {
    "chat.completions": EndpointProtocol(
        name="chat.completions",
        path=chat.PATH,
        ask=_choices_ask(chat.ask_logprobs),
        max_tokens=chat.max_tokens,
        tokenize_doc=chat.tokenize_doc,
        choices=chat,
    ),
    "completions": EndpointProtocol(
        name="completions",
        path=completions.PATH,
        ask=_choices_ask(completions.ask_logprobs),
        max_tokens=completions.max_tokens,
        tokenize_doc=_prompt_doc,
        raw_prompts=True,
        choices=completions,
    ),
    "responses": EndpointProtocol(
        name="responses",
        path=responses.PATH,
        ask=responses.ask,
        max_tokens=_chat_spelled_max_tokens,
        tokenize_doc=_prompt_doc,  # its prompt is ``input``: not rendered here, its ids come from upstream
        error_of=responses.error_of,
        collect=responses.collect,
        contract_body=responses.contract_body,
        strip=responses.strip,
        limits=responses.LIMITS,
    ),
    "messages": EndpointProtocol(
        name="messages",
        path=messages.PATH,
        ask=messages.ask,
        max_tokens=_chat_spelled_max_tokens,
        tokenize_doc=messages.tokenize_doc,
        error_of=messages.error_of,
        injects_seed=False,
        collect=messages.collect,
        contract_body=messages.contract_body,
        strip=messages.strip,
        limits=messages.LIMITS,
        tokenizes_answer=True,
        unrendered=messages.NOT_RENDERED,
    ),
}
