"""What every API surface shares: the canonical request and completion, HTTP errors, SSE."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from rl_agents.chat import ParsedCompletion
from rl_agents.session import Session, TurnRecord

if TYPE_CHECKING:
    from aiohttp import web

    from rl_core.interfaces import Tokenizer

__all__ = [
    "Backend",
    "ChatRequest",
    "Completion",
    "HTTPError",
    "number",
    "positive_int",
    "read_json",
    "refuse",
    "sse",
    "stop_strings",
    "stream_error",
    "text_of",
]


class HTTPError(Exception):
    """A request the server refuses: HTTP ``status``, a message saying what to fix, a short
    machine ``code`` and the request field at fault (``param``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


@dataclass(frozen=True, slots=True, kw_only=True)
class ChatRequest:
    """One completion request of any surface, in the server's canonical form."""

    messages: list[dict[str, Any]]
    """OpenAI chat messages (``system``/``user``/``assistant`` with ``tool_calls``/``tool``)."""
    tools: list[dict[str, Any]] | None = None
    """OpenAI chat tool definitions (``{"type": "function", "function": {...}}``)."""
    tools_enabled: bool = True
    """False when the client disabled tools (``tool_choice`` none): calls are not parsed."""
    max_tokens: int | None = None
    """The client's output limit (only lowers the session's ``max_new_tokens``)."""
    temperature: float | None = None
    """Client temperature (used only with ``AgentServer.Config.client_sampling``)."""
    top_p: float | None = None
    """Client top-p (same rule)."""
    seed: int | None = None
    """Client seed (same rule)."""
    user: str | None = None
    """A session id given in the body (the last fallback of :meth:`AgentServer.session_of`)."""
    adapter: str | None = None
    """The LoRA adapter the request's ``model`` names (``None``: the base policy)."""
    thinking: bool | None = None
    """Reasoning asked on (``True``) or off (``False``) by the client (Anthropic ``thinking``,
    OpenAI ``reasoning_effort`` / ``reasoning``); ``None``: the template's default."""
    stop: tuple[str, ...] = ()
    """Stop strings: the completion ends before the first one (OpenAI ``stop``, Anthropic
    ``stop_sequences``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Completion:
    """One served, recorded completion, ready for a surface to write back."""

    turn: TurnRecord
    """The recorded turn (prompt ids, engine result)."""
    parsed: ParsedCompletion
    """Content and tool calls parsed from the sampled text."""
    prompt_tokens: int
    """Prompt length in tokens."""
    finish: Literal["stop", "length", "tool_calls"]
    """Why it ended, in OpenAI chat terms (each surface maps it to its own)."""
    stop_sequence: str | None = None
    """The stop string that ended it (``None``: a stop token, the length, or a tool call)."""
    streamed: str = ""
    """Content already sent to the client while it was generated (streaming; a prefix of
    ``parsed.content`` but in a corner case, see :meth:`content_rest`)."""

    @property
    def completion_tokens(self) -> int:
        """Sampled tokens."""
        return len(self.turn.result.output_ids)

    streamed_reasoning: str = ""
    """Reasoning already sent while it was generated (a prefix of ``parsed.reasoning``)."""

    def reasoning_rest(self) -> str:
        """The reasoning still to send after :attr:`streamed_reasoning` (all of it again if
        parsing changed what was streamed)."""
        reasoning = self.parsed.reasoning or ""
        if reasoning.startswith(self.streamed_reasoning):
            return reasoning[len(self.streamed_reasoning) :]
        return reasoning

    def content_rest(self) -> str:
        """The content still to send after :attr:`streamed`: the rest of ``parsed.content``.
        A family's parser strips the text around a tool call, so leading whitespace streamed
        before a call came may be missing from the content: the rest follows the stripped
        text then (the client's text differs from the non-streamed one by that whitespace
        only). The whole content again if parsing changed the text otherwise."""
        content = self.parsed.content or ""
        for sent in (self.streamed, self.streamed.lstrip()):
            if content.startswith(sent):
                return content[len(sent) :]
        return content


class Backend(Protocol):
    """What a surface needs from the server that serves it (:class:`~rl_agents.server.AgentServer`
    implements it). The surfaces depend on this protocol, not on the server module, so the
    server can import them without an import circle."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The policy's tokenizer (decodes sampled tokens for ``logprobs``)."""
        ...

    @property
    def served_model(self) -> str:
        """The model id reported when a request names none."""
        ...

    def check_model(self, name: Any) -> str | None:
        """The LoRA adapter a request's ``model`` names (``None``: the base policy), or
        HTTP 404 listing the served names."""
        ...

    def session_of(self, request: web.Request, body_user: str | None = None) -> Session:
        """The open session a request belongs to, or HTTP 401/404."""
        ...

    async def complete(
        self,
        s: Session,
        req: ChatRequest,
        request: web.Request | None = None,
        on_text: Callable[[str, int, bool], Awaitable[None]] | None = None,
    ) -> Completion:
        """Render, generate and record one completion of session ``s`` (aborted when the
        client of ``request`` disconnects); content and reasoning are handed to ``on_text``
        (``(delta, prompt tokens, is it reasoning)``) as they are generated when given."""
        ...


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body, or HTTP 400."""
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HTTPError(400, f"request body is not JSON: {e}", "invalid_json") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "request body must be a JSON object", "invalid_json")
    return body


def stream_error(e: HTTPError) -> bytes:
    """The server-sent event of an error met after a stream began (the HTTP status is sent):
    OpenAI's and Anthropic's clients raise on an ``error`` event."""
    err = {"message": e.message, "type": "api_error", "code": e.code, "param": e.param}
    return sse({"type": "error", "error": err}, "error")


def sse(data: Mapping[str, Any], event: str | None = None) -> bytes:
    """One server-sent event (with an ``event:`` line when named)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


def text_of(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """Text of ``content``: a string, ``None`` or a list of text parts of the given types."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for k, p in enumerate(content):
            if not isinstance(p, Mapping) or p.get("type") not in kinds:
                kind = p.get("type") if isinstance(p, Mapping) else p
                raise HTTPError(
                    400,
                    f"{where}[{k}]: only {'/'.join(kinds)} parts are supported, got {kind!r}.",
                    "unsupported_content",
                    where,
                )
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise HTTPError(
        400, f"{where}: expected a string or a list of text parts", "invalid_value", where
    )


def stop_strings(value: Any, name: str, limit: int = 4) -> tuple[str, ...]:
    """A request's stop strings (a string or a list of at most ``limit`` non-empty strings),
    or HTTP 400 naming ``name``."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > limit
        or not all(isinstance(x, str) and x for x in items)
    ):
        raise HTTPError(
            400,
            f"{name} must be a non-empty string or a list of at most {limit} non-empty strings, "
            f"got {value!r}",
            "invalid_value",
            name,
        )
    return tuple(items)


def refuse(body: Mapping[str, Any], name: str, why: str, allowed: Any = None) -> None:
    """HTTP 400 naming field ``name`` when the body sets it (to anything but ``allowed``):
    the server does not honour it, and says so instead of ignoring it."""
    value = body.get(name)
    if value is not None and value != allowed:
        raise HTTPError(400, f"{name}: not supported by this server ({why})", "unsupported", name)


def positive_int(value: Any, name: str) -> int | None:
    """``value`` as a positive int (``None`` kept), or HTTP 400 naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HTTPError(
            400, f"{name} must be a positive integer, got {value!r}", "invalid_value", name
        )
    return value


def number(value: Any, name: str) -> float | None:
    """``value`` as a float (``None`` kept), or HTTP 400 naming ``name``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise HTTPError(400, f"{name} must be a number, got {value!r}", "invalid_value", name)
    return float(value)
