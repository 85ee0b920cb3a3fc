"""OpenAI ``POST /v1/chat/completions`` (``stream`` true or false, ``tools``, ``tool_choice``
``auto``/``none``, ``logprobs``, ``max_tokens``/``max_completion_tokens``, ``seed``).

``n`` > 1 and ``stop`` strings are refused with HTTP 400 (the engine stops on token ids; set the
session's ``stop_token_ids``). Streaming is emulated: the completion is generated in full, then
sent as server-sent events (role, content pieces, tool-call deltas, finish reason, an optional
usage chunk, ``[DONE]``); the bytes a client assembles are those of the non-streaming response.
"""

from __future__ import annotations

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
    sse,
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


def parse(body: Mapping[str, Any]) -> ChatRequest:
    """The canonical request of a chat-completions body."""
    if body.get("n", 1) not in (1, None):
        raise HTTPError(400, "only n=1 is supported", "unsupported", "n")
    if body.get("stop"):
        raise HTTPError(
            400,
            "stop strings are not supported; the session's stop_token_ids apply",
            "unsupported",
            "stop",
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
        tools_enabled=bool(tools) and body.get("tool_choice", "auto") != "none",
        max_tokens=positive_int(limit, "max_tokens"),
        temperature=number(body.get("temperature"), "temperature"),
        top_p=number(body.get("top_p"), "top_p"),
        seed=seed if isinstance(seed, int) and not isinstance(seed, bool) else None,
    )


async def handle(server: Backend, request: web.Request) -> web.StreamResponse:
    """Serve one chat completion (see the module docstring)."""
    try:
        body = await read_json(request)
        server.check_model(body.get("model"))
        session = server.session_of(request, body.get("user"))
        done = await server.complete(session, parse(body))
    except HTTPError as e:
        return error_response(e)
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
    from aiohttp import web

    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    model = str(body.get("model") or server.served_model)
    usage = {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    parsed = done.parsed
    want_lp = bool(body.get("logprobs"))
    if not body.get("stream"):
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.tool_calls:
            message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": done.finish,
            "logprobs": logprobs_of(server, done) if want_lp else None,
        }
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [choice],
                "usage": usage,
            }
        )

    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    async def send(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any):
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}
        await resp.write(sse({**head, "choices": [choice]}))

    await send({"role": "assistant", "content": ""})
    content = parsed.content or ""
    for i in range(0, len(content), STREAM_PIECE_CHARS):
        await send({"content": content[i : i + STREAM_PIECE_CHARS]})
    for i, c in enumerate(parsed.tool_calls):
        await send({"tool_calls": [c.to_openai(index=i)]})
    await send({}, done.finish, **({"logprobs": logprobs_of(server, done)} if want_lp else {}))
    opts = body.get("stream_options") or {}
    if isinstance(opts, Mapping) and opts.get("include_usage"):
        await resp.write(sse({**head, "choices": [], "usage": usage}))
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
