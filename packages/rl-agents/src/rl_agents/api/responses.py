"""OpenAI ``POST /v1/responses``: ``input`` (a string or a list of message, ``function_call``
and ``function_call_output`` items), ``instructions``, function ``tools``, ``tool_choice``,
``max_output_tokens``, ``previous_response_id`` and ``stream``.

The input is turned into OpenAI chat messages (the server's canonical form): ``instructions``
becomes the system message, ``developer`` messages are system messages, consecutive
``function_call`` items join the assistant message before them as its tool calls (their
``call_id`` is the server's own, so the completion that made them is rendered back exactly),
and ``function_call_output`` items become ``tool`` messages. ``previous_response_id`` continues
a response of the same session: its input and output come first (its ``instructions`` are not
carried over, as in OpenAI's API). ``reasoning`` items an agent sends back are skipped (the
server renders the turn back from what the model wrote, reasoning included). Built-in tools
(web search, file search, ...), non-text content, ``tool_choice`` ``required`` or a named
function (the engine cannot force a call), ``text.format`` other than text and
``parallel_tool_calls: false`` are refused with HTTP 400 naming the field.

``reasoning.effort`` ``none``/``minimal`` turns the chat template's reasoning switch off, any
other value on (see :class:`~rl_agents.server.AgentServer`). The output holds a ``reasoning``
item (the model's reasoning as ``reasoning_text`` content, when it wrote any), a ``message``
item (when there is text) and one ``function_call`` item per call; ``status`` is ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"``
when the engine hit its length limit. Streaming: ``response.created``, ``response.in_progress``,
per item ``response.output_item.added`` / reasoning, text or argument deltas / ``...done``
events, then ``response.completed`` (or ``response.incomplete``). With a generator that
streams, reasoning and text are sent as they are generated (the reasoning and message items
first, begun before the completion ends; see :class:`~rl_agents.server.AgentServer` for which text is sent early), the
other items follow once it ends; an error met after the stream began is an ``error`` event.
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
    stream_error,
    text_of,
)

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["handle", "parse", "to_response"]

_TEXT_KINDS = ("input_text", "output_text", "text")
_PIECE = 16


def error_response(e: HTTPError) -> web.StreamResponse:
    """OpenAI's error body."""
    from aiohttp import web

    err = {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": e.code}
    return web.json_response({"error": err}, status=e.status)


def parse(
    body: Mapping[str, Any], history: list[dict[str, Any]], adapter: str | None = None
) -> ChatRequest:
    """The canonical request of a Responses API body; ``history`` is the conversation of
    ``previous_response_id`` (empty without one), ``adapter`` the one ``model`` names."""
    choice = body.get("tool_choice")
    if choice is not None and choice not in ("auto", "none"):
        raise HTTPError(
            400,
            f"tool_choice: only 'auto' and 'none' are supported, got {choice!r} (the engine "
            "cannot force a call)",
            "unsupported",
            "tool_choice",
        )
    text_opts = body.get("text")
    fmt = text_opts.get("format") if isinstance(text_opts, Mapping) else None
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type") == "text"):
        raise HTTPError(
            400,
            "text.format: only {'type': 'text'} is supported (no constrained decoding)",
            "unsupported",
            "text.format",
        )
    refuse(body, "parallel_tool_calls", "the model may make several calls", allowed=True)
    reasoning = body.get("reasoning")
    effort = reasoning.get("effort") if isinstance(reasoning, Mapping) else None
    if reasoning is not None and not isinstance(reasoning, Mapping):
        raise HTTPError(400, "reasoning: expected an object", "invalid_value", "reasoning")
    raw = body.get("input")
    items: list[Any]
    if isinstance(raw, str):
        items = [{"role": "user", "content": raw}]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise HTTPError(
            400, "input: a string or a non-empty list of items", "invalid_value", "input"
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": text_of(instructions, "instructions")})
    messages += [dict(m) for m in history]
    for i, item in enumerate(items):
        _item(i, item, messages)
    tools = [_tool(i, t) for i, t in enumerate(body.get("tools") or [])] or None
    return ChatRequest(
        messages=messages,
        tools=tools,
        tools_enabled=bool(tools) and choice != "none",
        max_tokens=positive_int(body.get("max_output_tokens"), "max_output_tokens"),
        temperature=number(body.get("temperature"), "temperature"),
        top_p=number(body.get("top_p"), "top_p"),
        adapter=adapter,
        thinking=None if effort is None else effort not in ("none", "minimal"),
    )


def _item(i: int, item: Any, messages: list[dict[str, Any]]) -> None:
    where = f"input[{i}]"
    if not isinstance(item, Mapping):
        raise HTTPError(400, f"{where}: expected an object", "invalid_value", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise HTTPError(400, f"{where}.role: unknown role {role!r}", "invalid_value", where)
        text = text_of(item.get("content"), f"{where}.content", _TEXT_KINDS)
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "type": "function",
            "function": {
                "name": str(item.get("name", "")),
                "arguments": item.get("arguments") or "{}",
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or []), call]
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "reasoning":
        return  # rendered back from what the model wrote (Session.substitute)
    elif kind == "function_call_output":
        out = item.get("output")
        text = out if isinstance(out, str) else text_of(out, f"{where}.output", _TEXT_KINDS)
        messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
    else:
        raise HTTPError(
            400,
            f"{where}: item type {kind!r} is not supported (message, function_call, "
            "function_call_output)",
            "unsupported_content",
            where,
        )


def _tool(i: int, t: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    if (
        not isinstance(t, Mapping)
        or t.get("type") != "function"
        or not isinstance(t.get("name"), str)
    ):
        raise HTTPError(400, f"{where}: only function tools are supported", "unsupported", where)
    fn = {"name": t["name"], "parameters": t.get("parameters") or {"type": "object"}}
    if t.get("description"):
        fn["description"] = t["description"]
    return {"type": "function", "function": fn}


def to_response(done: Completion, body: Mapping[str, Any], model: str, rid: str) -> dict[str, Any]:
    """The Responses API object of a completion."""
    output: list[dict[str, Any]] = []
    if done.parsed.reasoning:
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": done.parsed.reasoning}],
                "status": "completed",
            }
        )
    if done.parsed.content:
        part = {"type": "output_text", "text": done.parsed.content, "annotations": []}
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for c in done.parsed.tool_calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{uuid.uuid4().hex}",
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
        )
    incomplete = done.finish == "length" and not done.parsed.tool_calls
    usage = {
        "input_tokens": done.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": done.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }
    return {
        **_envelope(body, model, rid),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "output": output,
        "usage": usage,
    }


def _envelope(body: Mapping[str, Any], model: str, rid: str) -> dict[str, Any]:
    """The fields of a Responses API object that do not depend on the completion (an
    ``in_progress`` response with no output)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "incomplete_details": None,
        "error": None,
        "model": model,
        "output": [],
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "max_output_tokens": body.get("max_output_tokens"),
        "parallel_tool_calls": True,
        "reasoning": body.get("reasoning"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": list(body.get("tools") or []),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "usage": None,
    }


def _history_of(req: ChatRequest, done: Completion, instructions: bool) -> list[dict[str, Any]]:
    """The conversation a later ``previous_response_id`` continues: the input (without the
    instructions) and the assistant's reply."""
    messages = req.messages[1:] if instructions else list(req.messages)
    reply: dict[str, Any] = {"role": "assistant", "content": done.parsed.content}
    if done.parsed.tool_calls:
        reply["tool_calls"] = [c.to_openai() for c in done.parsed.tool_calls]
    return [*messages, reply]


async def handle(server: Backend, request: web.Request) -> web.StreamResponse:
    """Serve one response (see the module docstring)."""
    out: _Stream | None = None
    try:
        body = await read_json(request)
        adapter = server.check_model(body.get("model"))
        user = body.get("user")
        session = server.session_of(request, user if isinstance(user, str) else None)
        prev = body.get("previous_response_id")
        history: list[dict[str, Any]] = []
        if prev is not None:
            if prev not in session.responses:
                raise HTTPError(
                    404,
                    f"previous_response_id {prev!r} is not a response of session {session.id!r}",
                    "response_not_found",
                    "previous_response_id",
                )
            history = session.responses[prev]
        req = parse(body, history, adapter)
        model = str(body.get("model") or server.served_model)
        rid = f"resp_{uuid.uuid4().hex}"
        if body.get("stream"):
            out = _Stream(request, _envelope(body, model, rid))
            done = await server.complete(session, req, request, on_text=out.content)
        else:
            done = await server.complete(session, req, request)
    except HTTPError as e:
        if out is None or out.resp is None:
            return error_response(e)
        return await out.fail(e)
    from aiohttp import web

    session.responses[rid] = _history_of(req, done, bool(body.get("instructions")))
    response = to_response(done, body, model, rid)
    if out is not None:
        return await out.finish(response, done)
    return web.json_response(response)


class _Stream:
    """A streamed response: the events are sent as the completion is generated (the items
    begun while generating, reasoning then message, come first in the output)."""

    def __init__(self, request: web.Request, envelope: dict[str, Any]) -> None:
        self.request, self.envelope = request, envelope
        self.resp: web.StreamResponse | None = None
        self.seq = 0
        self.items: list[tuple[str, str]] = []
        """``(type, id)`` of the items begun while generating, in order; the last is open."""
        self.texts: dict[str, str] = {"reasoning": "", "message": ""}
        """The text streamed into each of them."""

    async def _send(self, event: str, data: dict[str, Any]) -> None:
        assert self.resp is not None
        await self.resp.write(sse({"type": event, "sequence_number": self.seq, **data}, event))
        self.seq += 1

    async def _start(self) -> web.StreamResponse:
        from aiohttp import web

        if self.resp is None:
            self.resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await self.resp.prepare(self.request)
            await self._send("response.created", {"response": self.envelope})
            await self._send("response.in_progress", {"response": self.envelope})
        return self.resp

    async def content(self, delta: str, prompt_tokens: int, reasoning: bool) -> None:
        """Send text or reasoning generated so far (the server's ``on_text``)."""
        await self._start()
        kind = "reasoning" if reasoning else "message"
        if not self.items or self.items[-1][0] != kind:
            if self.items:
                await self._close(len(self.items) - 1, self._item_of(*self.items[-1], None))
            item_id = f"{'rs' if reasoning else 'msg'}_{uuid.uuid4().hex}"
            self.items.append((kind, item_id))
            n = len(self.items) - 1
            ids = {"item_id": item_id, "output_index": n}
            if reasoning:
                item = {"type": "reasoning", "id": item_id, "summary": [], "content": []}
            else:
                item = {"type": "message", "id": item_id, "role": "assistant", "content": []}
            item["status"] = "in_progress"
            await self._send("response.output_item.added", {"output_index": n, "item": item})
            if not reasoning:
                part = {"type": "output_text", "text": "", "annotations": []}
                await self._send(
                    "response.content_part.added", {**ids, "content_index": 0, "part": part}
                )
        n, item_id = len(self.items) - 1, self.items[-1][1]
        self.texts[kind] += delta
        ids = {"item_id": item_id, "output_index": n, "content_index": 0}
        if reasoning:
            await self._send("response.reasoning_text.delta", {**ids, "delta": delta})
        else:
            await self._send("response.output_text.delta", {**ids, "delta": delta, "logprobs": []})

    def _item_of(self, kind: str, item_id: str, final: dict[str, Any] | None) -> dict[str, Any]:
        """The finished item of a streamed one: ``final``'s (the response's item of that type)
        under the streamed id, or one holding the streamed text when the response has none."""
        if final is not None:
            return {**final, "id": item_id}
        text = self.texts[kind]
        if kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}]
            return {
                "type": "reasoning",
                "id": item_id,
                "summary": [],
                "content": content,
                "status": "completed",
            }
        part = {"type": "output_text", "text": text, "annotations": []}
        return {
            "type": "message",
            "id": item_id,
            "status": "completed",
            "role": "assistant",
            "content": [part],
        }

    async def _close(self, n: int, item: dict[str, Any], rest: str = "") -> None:
        """Finish streamed item ``n`` (``rest``: text not sent yet)."""
        ids = {"item_id": item["id"], "output_index": n, "content_index": 0}
        if item["type"] == "reasoning":
            if rest:
                await self._send("response.reasoning_text.delta", {**ids, "delta": rest})
            text = item["content"][0]["text"]
            await self._send("response.reasoning_text.done", {**ids, "text": text})
        else:
            if rest:
                await self._send(
                    "response.output_text.delta", {**ids, "delta": rest, "logprobs": []}
                )
            part = item["content"][0]
            await self._send(
                "response.output_text.done", {**ids, "text": part["text"], "logprobs": []}
            )
            await self._send("response.content_part.done", {**ids, "part": part})
        await self._send("response.output_item.done", {"output_index": n, "item": item})

    async def fail(self, e: HTTPError) -> web.StreamResponse:
        """End a begun stream with an ``error`` event."""
        resp = await self._start()
        with contextlib.suppress(ConnectionError):
            await resp.write(stream_error(e))
            await resp.write_eof()
        return resp

    async def finish(self, response: dict[str, Any], done: Completion) -> web.StreamResponse:
        """Send the rest: the open streamed item's rest, each other output item, then
        ``response.completed`` (or ``response.incomplete``), its output in the streamed
        order."""
        resp = await self._start()
        rest_of = {"reasoning": done.reasoning_rest(), "message": done.content_rest()}
        by_type = {o["type"]: o for o in response["output"] if o["type"] in rest_of}
        streamed = []
        for n, (kind, item_id) in enumerate(self.items):
            item = self._item_of(kind, item_id, by_type.get(kind))
            streamed.append(item)
            if n == len(self.items) - 1:
                await self._close(n, item, rest_of[kind])
        kinds = {k for k, _ in self.items}
        others = [o for o in response["output"] if o["type"] not in kinds]
        response = {**response, "output": [*streamed, *others]}
        for n, item in enumerate(others, start=len(streamed)):
            await self._item(n, item)
        final = (
            "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        )
        await self._send(final, {"response": response})
        await resp.write_eof()
        return resp

    async def _item(self, n: int, item: dict[str, Any]) -> None:
        """One whole output item at index ``n``: added, its deltas, done."""
        ids = {"item_id": item["id"], "output_index": n}
        if item["type"] == "reasoning":
            await self._send(
                "response.output_item.added",
                {"output_index": n, "item": {**item, "status": "in_progress", "content": []}},
            )
            text = item["content"][0]["text"]
            for j in range(0, len(text), _PIECE):
                await self._send(
                    "response.reasoning_text.delta",
                    {**ids, "content_index": 0, "delta": text[j : j + _PIECE]},
                )
            await self._send(
                "response.reasoning_text.done", {**ids, "content_index": 0, "text": text}
            )
        elif item["type"] == "message":
            await self._send(
                "response.output_item.added",
                {"output_index": n, "item": {**item, "status": "in_progress", "content": []}},
            )
            part = item["content"][0]
            await self._send(
                "response.content_part.added",
                {**ids, "content_index": 0, "part": {**part, "text": ""}},
            )
            text = part["text"]
            for j in range(0, len(text), _PIECE):
                await self._send(
                    "response.output_text.delta",
                    {**ids, "content_index": 0, "delta": text[j : j + _PIECE], "logprobs": []},
                )
            await self._send(
                "response.output_text.done",
                {**ids, "content_index": 0, "text": text, "logprobs": []},
            )
            await self._send(
                "response.content_part.done", {**ids, "content_index": 0, "part": part}
            )
        else:
            await self._send(
                "response.output_item.added",
                {"output_index": n, "item": {**item, "status": "in_progress", "arguments": ""}},
            )
            await self._send(
                "response.function_call_arguments.delta", {**ids, "delta": item["arguments"]}
            )
            await self._send(
                "response.function_call_arguments.done",
                {**ids, "name": item["name"], "arguments": item["arguments"]},
            )
        await self._send("response.output_item.done", {"output_index": n, "item": item})
