"""OpenAI ``POST /v1/chat/completions`` (``stream`` true or false, ``tools``, ``tool_choice``
``auto``/``none``, ``logprobs``, ``max_tokens``/``max_completion_tokens``, ``seed``, ``stop``,
``reasoning_effort``).

The model's reasoning comes back as ``message.reasoning_content`` (``delta.reasoning_content``
when streamed). ``reasoning_effort`` ``none``/``minimal`` turns the template's reasoning switch
off, any other value on (see :class:`~rl_agents.server.AgentServer`). Parameters the server
does not honour are refused with HTTP 400 naming the field, never ignored: ``n`` > 1,
``tool_choice`` ``required`` or a named function (the engine cannot force a call),
``response_format`` other than text, ``parallel_tool_calls: false``, ``logit_bias``,
non-zero ``presence_penalty`` / ``frequency_penalty``, ``top_logprobs`` > 0, ``functions`` /
``function_call``.

Streaming (``stream: true``) sends server-sent events: the role, then reasoning and content
deltas as the generator samples them (a generator that streams, :attr:`~rl_core.interfaces.Generator.
streams_tokens`; see :class:`~rl_agents.server.AgentServer` for which text is sent early), then
the reasoning, the content not sent yet, tool-call deltas, the finish reason, an optional usage
chunk and ``[DONE]``; what a client assembles equals the non-streamed response. An error met
after the stream began is sent as an ``error`` event (the clients raise it).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rl_agents.api.common import (
    Backend,
    ChatRequest,
    Completion,
    HTTPError,
    number,
    positive_int,
    read_json,
    refuse,
    sse,
    stop_strings,
    stream_error,
)

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["handle", "logprobs_of"]

STREAM_PIECE_CHARS = 16
"""Characters of content per streamed delta."""


def error_response(e: HTTPError) -> web.StreamResponse:
    """OpenAI's error body."""
    from aiohttp import web

    err = {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": e.code}
    return web.json_response({"error": err}, status=e.status)


_NO_REASONING = ("none", "minimal")


def parse(body: Mapping[str, Any], adapter: str | None = None) -> ChatRequest:
    """The canonical request of a chat-completions body (``adapter``: the one ``model``
    names). Raises HTTP 400 naming a parameter the server does not honour."""
    if body.get("n", 1) not in (1, None):
        raise HTTPError(400, "n: only n=1 is supported", "unsupported", "n")
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise HTTPError(
            400,
            f"tool_choice: only 'auto' and 'none' are supported, got {choice!r} (the engine "
            "cannot force a call)",
            "unsupported",
            "tool_choice",
        )
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise HTTPError(
            400,
            "response_format: only {'type': 'text'} is supported (no constrained decoding)",
            "unsupported",
            "response_format",
        )
    refuse(body, "parallel_tool_calls", "the model may make several calls", allowed=True)
    refuse(body, "logit_bias", "sampling is the trainer's", allowed={})
    refuse(body, "presence_penalty", "sampling is the trainer's", allowed=0)
    refuse(body, "frequency_penalty", "sampling is the trainer's", allowed=0)
    refuse(body, "top_logprobs", "only the sampled token's log-prob is returned", allowed=0)
    refuse(body, "functions", "send tools instead")
    refuse(body, "function_call", "send tool_choice instead")
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise HTTPError(
            400, "reasoning_effort: expected a string", "invalid_value", "reasoning_effort"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HTTPError(400, "'messages' must be a non-empty list", "invalid_value", "messages")
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    tools = body.get("tools") or None
    seed = body.get("seed")
    return ChatRequest(
        messages=messages,
        tools=tools,
        tools_enabled=bool(tools) and choice != "none",
        max_tokens=positive_int(limit, "max_tokens"),
        temperature=number(body.get("temperature"), "temperature"),
        top_p=number(body.get("top_p"), "top_p"),
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
        adapter=adapter,
        thinking=None if effort is None else effort not in _NO_REASONING,
        stop=stop_strings(body.get("stop"), "stop"),
    )


async def handle(server: Backend, request: web.Request) -> web.StreamResponse:
    """Serve one chat completion (see the module docstring)."""
    out: _Stream | None = None
    try:
        body = await read_json(request)
        adapter = server.check_model(body.get("model"))
        session = server.session_of(request, body.get("user"))
        req = parse(body, adapter)
        if body.get("stream"):
            out = _Stream(server, request, body)
            done = await server.complete(session, req, request, on_text=out.content)
        else:
            done = await server.complete(session, req, request)
    except HTTPError as e:
        if out is None or out.resp is None:
            return error_response(e)
        return await out.fail(e)
    if out is not None:
        return await out.finish(done)
    return await _respond(server, request, body, done)


def logprobs_of(server: Backend, done: Completion) -> dict[str, Any]:
    """The ``logprobs`` object of a choice: each sampled token and its engine log-prob."""
    content = []
    result = done.turn.result
    for t, lp in zip(result.output_ids, result.output_logprobs, strict=True):
        s = server.tokenizer.decode([t], skip_special_tokens=False)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []})
    return {"content": content}


async def _respond(
    server: Backend, request: web.Request, body: Mapping[str, Any], done: Completion
) -> web.StreamResponse:
    """The non-streamed response."""
    from aiohttp import web

    usage = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    parsed = done.parsed
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "finish_reason": done.finish,
        "logprobs": logprobs_of(server, done) if body.get("logprobs") else None,
    }
    return web.json_response(
        {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": str(body.get("model") or server.served_model),
            "choices": [choice],
            "usage": usage,
        }
    )


class _Stream:
    """A streamed chat completion: the events are sent as the completion is generated."""

    def __init__(self, server: Backend, request: web.Request, body: Mapping[str, Any]) -> None:
        self.server, self.request, self.body = server, request, body
        self.resp: web.StreamResponse | None = None
        model = str(body.get("model") or server.served_model)
        self.head = {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    async def _start(self) -> web.StreamResponse:
        from aiohttp import web

        if self.resp is None:
            self.resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.resp.prepare(self.request)
            await self._send({"role": "assistant", "content": ""})
        return self.resp

    async def _send(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> None:
        assert self.resp is not None
        choice = {"index": 0, "delta": delta, "finish_reason": finish, **extra}
        await self.resp.write(sse({**self.head, "choices": [choice]}))

    async def content(self, delta: str, prompt_tokens: int, reasoning: bool) -> None:
        """Send content or reasoning generated so far (the server's ``on_text``)."""
        await self._start()
        await self._send({"reasoning_content" if reasoning else "content": delta})

    async def fail(self, e: HTTPError) -> web.StreamResponse:
        """End a begun stream with an error event."""
        resp = await self._start()
        with contextlib.suppress(ConnectionError):
            await resp.write(stream_error(e))
            await resp.write_eof()
        return resp

    async def finish(self, done: Completion) -> web.StreamResponse:
        """Send the rest: reasoning, content not streamed yet, tool calls, the finish reason,
        usage and ``[DONE]``."""
        resp = await self._start()
        parsed = done.parsed
        reasoning = done.reasoning_rest()
        for i in range(0, len(reasoning), STREAM_PIECE_CHARS):
            await self._send({"reasoning_content": reasoning[i : i + STREAM_PIECE_CHARS]})
        content = done.content_rest()
        for i in range(0, len(content), STREAM_PIECE_CHARS):
            await self._send({"content": content[i : i + STREAM_PIECE_CHARS]})
        for i, c in enumerate(parsed.tool_calls):
            await self._send({"tool_calls": [c.to_openai(index=i)]})
        want_lp = bool(self.body.get("logprobs"))
        lp = {"logprobs": logprobs_of(self.server, done)} if want_lp else {}
        await self._send({}, done.finish, **lp)
        opts = self.body.get("stream_options") or {}
        if isinstance(opts, Mapping) and opts.get("include_usage"):
            usage = {
                "prompt_tokens": done.prompt_tokens,
                "completion_tokens": done.completion_tokens,
                "total_tokens": done.prompt_tokens + done.completion_tokens,
            }
            await resp.write(sse({**self.head, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
