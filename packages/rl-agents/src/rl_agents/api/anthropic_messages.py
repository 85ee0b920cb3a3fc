"""Anthropic ``POST /v1/messages``: ``system``, text / ``tool_use`` / ``tool_result`` content
blocks, ``tools`` with ``input_schema``, ``tool_choice``, ``stream`` and the stop reasons
``end_turn``, ``max_tokens`` and ``tool_use``.

Point the official client at the server's root (``anthropic.Anthropic(base_url=
server.root_url, api_key=session_id)``): the client sends the key as ``x-api-key``, which names
the session. The request is turned into OpenAI chat messages (the server's canonical form):
``system`` becomes the system message, an assistant message's ``tool_use`` blocks its tool
calls (the ids are the server's own, so the completion that made them is rendered back
exactly), a user message's ``tool_result`` blocks ``tool`` messages (in order, before the
user's text). ``tool_choice`` ``none`` disables tools, ``auto`` leaves the choice to the
model; ``any`` and ``tool`` are refused with HTTP 400 (the engine cannot force a call), as are
non-text blocks (images, documents). ``stop_sequences`` are honoured (``stop_reason``
``stop_sequence``, see :class:`~rl_agents.server.AgentServer`).

Reasoning. ``thinking`` (``{"type": "enabled", "budget_tokens": N}`` or ``{"type":
"disabled"}``) sets the chat template's reasoning switch (``budget_tokens`` is not enforced: the
reasoning counts against ``max_tokens``); the model's reasoning comes back as a ``thinking``
block before the text (``signature`` empty: nothing to verify), and ``thinking`` /
``redacted_thinking`` blocks an agent sends back are skipped (the server renders the turn back
from what the model wrote, reasoning included).

Streaming sends ``message_start``, one ``content_block_start`` / ``_delta`` (``thinking_delta``,
``text_delta`` or ``input_json_delta``) / ``_stop`` per block, ``message_delta`` (stop reason,
output tokens) and ``message_stop``. With a generator that streams, thinking and text are sent as they
are generated (blocks begun before the completion ends, thinking first; see
:class:`~rl_agents.server.AgentServer` for which text is sent early), the other blocks follow
once it ends; an error met after the stream began is an ``error`` event. A tool call whose arguments are not a JSON object is returned with its value
under ``input["value"]`` (Anthropic's ``input`` is always an object).
"""

from __future__ import annotations

import contextlib
import json
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
    stop_strings,
    stream_error,
    text_of,
)

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["handle", "parse", "to_message"]

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_THINKING = {"enabled": True, "adaptive": True, "disabled": False}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}
_PIECE = 16


def error_response(e: HTTPError) -> web.StreamResponse:
    """Anthropic's error body."""
    from aiohttp import web

    kind = _ERROR_TYPES.get(e.status, "api_error")
    body = {"type": "error", "error": {"type": kind, "message": e.message}}
    return web.json_response(body, status=e.status)


def parse(body: Mapping[str, Any], adapter: str | None = None) -> ChatRequest:
    """The canonical request of a Messages API body (``adapter``: the one ``model`` names)."""
    thinking = body.get("thinking")
    switch = None
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, Mapping) else None
        if kind not in _THINKING:
            raise HTTPError(
                400,
                "thinking: expected {'type': 'enabled', 'budget_tokens': N} or "
                f"{{'type': 'disabled'}}, got {thinking!r}",
                "invalid_value",
                "thinking",
            )
        switch = _THINKING[kind]
    max_tokens = positive_int(body.get("max_tokens"), "max_tokens")
    if max_tokens is None:
        raise HTTPError(400, "max_tokens: field required", "invalid_value", "max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise HTTPError(400, "messages: must be a non-empty list", "invalid_value", "messages")
    messages: list[dict[str, Any]] = []
    system = text_of(body.get("system"), "system")
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(raw):
        messages.extend(_message(i, m))
    tools = None
    if body.get("tools"):
        tools = [_tool(i, t) for i, t in enumerate(body["tools"])]
    choice = body.get("tool_choice") or {}
    if isinstance(choice, Mapping) and choice.get("type") in ("any", "tool"):
        raise HTTPError(
            400,
            f"tool_choice: {choice.get('type')!r} is not supported (the engine cannot force a "
            "call); use 'auto' or 'none'",
            "unsupported",
            "tool_choice",
        )
    metadata = body.get("metadata") or {}
    return ChatRequest(
        messages=messages,
        tools=tools,
        tools_enabled=bool(tools)
        and not (isinstance(choice, Mapping) and choice.get("type") == "none"),
        max_tokens=max_tokens,
        temperature=number(body.get("temperature"), "temperature"),
        top_p=number(body.get("top_p"), "top_p"),
        seed=None,
        adapter=adapter,
        thinking=switch,
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences", limit=64),
        user=str(metadata["user_id"])
        if isinstance(metadata, Mapping) and metadata.get("user_id")
        else None,
    )


def _message(i: int, m: Any) -> list[dict[str, Any]]:
    where = f"messages[{i}]"
    if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant"):
        raise HTTPError(
            400, f"{where}: expected role 'user' or 'assistant'", "invalid_value", where
        )
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise HTTPError(
            400, f"{where}.content: a string or a list of blocks", "invalid_value", where
        )
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for k, b in enumerate(content):
        kind = b.get("type") if isinstance(b, Mapping) else None
        at = f"{where}.content[{k}]"
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # rendered back from what the model wrote (Session.substitute)
        elif kind == "tool_use" and role == "assistant":
            args = json.dumps(b.get("input") or {}, ensure_ascii=False)
            fn = {"name": str(b.get("name", "")), "arguments": args}
            calls.append({"id": b.get("id"), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            text = text_of(b.get("content"), f"{at}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": text})
        else:
            raise HTTPError(
                400,
                f"{at}: block type {kind!r} is not supported in a {role} message (text, "
                "tool_use in assistant messages, tool_result in user messages)",
                "unsupported_content",
                at,
            )
    if role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            out["tool_calls"] = calls
        return [out]
    text = "".join(texts)
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _tool(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if (
        not isinstance(t, Mapping)
        or not isinstance(t.get("name"), str)
        or t.get("type") not in (None, "custom")
    ):
        raise HTTPError(
            400,
            f"{where}: only client tools {{name, description, input_schema}} are supported",
            "unsupported",
            where,
        )
    fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def _input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        value = arguments
    return value if isinstance(value, dict) else {"value": value}


def to_message(done: Completion, model: str, msg_id: str) -> dict[str, Any]:
    """The Messages API response object of a completion."""
    blocks: list[dict[str, Any]] = []
    if done.parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": done.parsed.reasoning, "signature": ""})
    if done.parsed.content:
        blocks.append({"type": "text", "text": done.parsed.content})
    for c in done.parsed.tool_calls:
        blocks.append(
            {"type": "tool_use", "id": c.id, "name": c.name, "input": _input(c.arguments)}
        )
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": "stop_sequence" if done.stop_sequence else _STOP[done.finish],
        "stop_sequence": done.stop_sequence,
        "usage": {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens},
    }


async def handle(server: Backend, request: web.Request) -> web.StreamResponse:
    """Serve one message (see the module docstring)."""
    out: _Stream | None = None
    try:
        body = await read_json(request)
        adapter = server.check_model(body.get("model"))
        req = parse(body, adapter)
        session = server.session_of(request, req.user)
        if body.get("stream"):
            out = _Stream(request, str(body.get("model") or server.served_model))
            done = await server.complete(session, req, request, on_text=out.content)
        else:
            done = await server.complete(session, req, request)
    except HTTPError as e:
        if out is None or out.resp is None:
            return error_response(e)
        return await out.fail(e)
    if out is not None:
        return await out.finish(done)
    from aiohttp import web

    model = str(body.get("model") or server.served_model)
    return web.json_response(to_message(done, model, f"msg_{uuid.uuid4().hex}"))


class _Stream:
    """A streamed message: the events are sent as the completion is generated (a text block
    first when content streams before the completion ends)."""

    def __init__(self, request: web.Request, model: str) -> None:
        self.request, self.model = request, model
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.resp: web.StreamResponse | None = None
        self.blocks: list[str] = []
        """The kinds of the blocks begun while generating (``thinking``, ``text``), in order;
        the last one is open."""

    async def _send(self, event: str, data: dict[str, Any]) -> None:
        assert self.resp is not None
        await self.resp.write(sse({"type": event, **data}, event))

    async def _start(self, prompt_tokens: int) -> web.StreamResponse:
        from aiohttp import web

        if self.resp is None:
            self.resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.resp.prepare(self.request)
            start = {
                "id": self.msg_id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }
            await self._send("message_start", {"message": start})
        return self.resp

    async def content(self, delta: str, prompt_tokens: int, reasoning: bool) -> None:
        """Send text or thinking generated so far (the server's ``on_text``)."""
        await self._start(prompt_tokens)
        kind = "thinking" if reasoning else "text"
        if not self.blocks or self.blocks[-1] != kind:
            if self.blocks:
                await self._send("content_block_stop", {"index": len(self.blocks) - 1})
            self.blocks.append(kind)
            head = {"type": "thinking", "thinking": "", "signature": ""} if reasoning else {}
            head = head or {"type": "text", "text": ""}
            await self._send(
                "content_block_start", {"index": len(self.blocks) - 1, "content_block": head}
            )
        body = {"type": "thinking_delta", "thinking": delta} if reasoning else {}
        body = body or {"type": "text_delta", "text": delta}
        await self._send("content_block_delta", {"index": len(self.blocks) - 1, "delta": body})

    async def fail(self, e: HTTPError) -> web.StreamResponse:
        """End a begun stream with an ``error`` event."""
        resp = await self._start(0)
        with contextlib.suppress(ConnectionError):
            await resp.write(stream_error(e))
            await resp.write_eof()
        return resp

    async def finish(self, done: Completion) -> web.StreamResponse:
        """Send the rest of the message: the streamed text block's rest, then each other
        block, ``message_delta`` and ``message_stop``."""
        resp = await self._start(done.prompt_tokens)
        message = to_message(done, self.model, self.msg_id)
        blocks = message["content"]
        rests = {"thinking": done.reasoning_rest(), "text": done.content_rest()}
        for i, kind in enumerate(self.blocks):  # finish the blocks begun while generating
            if i == len(self.blocks) - 1 and rests[kind]:
                key, delta_type = (
                    ("thinking", "thinking_delta")
                    if kind == "thinking"
                    else (
                        "text",
                        "text_delta",
                    )
                )
                delta = {"type": delta_type, key: rests[kind]}
                await self._send("content_block_delta", {"index": i, "delta": delta})
            if i == len(self.blocks) - 1:
                await self._send("content_block_stop", {"index": i})
        blocks = [b for b in blocks if b["type"] not in self.blocks]
        i = len(self.blocks)
        for block in blocks:
            await self._block(i, block)
            i += 1
        await self._send(
            "message_delta",
            {
                "delta": {
                    "stop_reason": message["stop_reason"],
                    "stop_sequence": message["stop_sequence"],
                },
                "usage": {"output_tokens": done.completion_tokens},
            },
        )
        await self._send("message_stop", {})
        await resp.write_eof()
        return resp

    async def _block(self, i: int, block: dict[str, Any]) -> None:
        """One whole content block at index ``i``: start, deltas, stop."""
        if block["type"] == "thinking":
            head = {"type": "thinking", "thinking": "", "signature": ""}
            await self._send("content_block_start", {"index": i, "content_block": head})
            text = block["thinking"]
            for j in range(0, len(text), _PIECE):
                delta = {"type": "thinking_delta", "thinking": text[j : j + _PIECE]}
                await self._send("content_block_delta", {"index": i, "delta": delta})
        elif block["type"] == "text":
            head = {"type": "text", "text": ""}
            await self._send("content_block_start", {"index": i, "content_block": head})
            text = block["text"]
            for j in range(0, len(text), _PIECE):
                delta = {"type": "text_delta", "text": text[j : j + _PIECE]}
                await self._send("content_block_delta", {"index": i, "delta": delta})
        else:
            head = {**block, "input": {}}
            await self._send("content_block_start", {"index": i, "content_block": head})
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            await self._send("content_block_delta", {"index": i, "delta": delta})
        await self._send("content_block_stop", {"index": i})
