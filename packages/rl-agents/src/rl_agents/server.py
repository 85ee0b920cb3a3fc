"""An OpenAI-compatible ``/v1/chat/completions`` server in front of any
:class:`~rl_core.interfaces.Generator`, recording what it serves for training.

::

    server = AgentServer(AgentServer.Config(), generator=gen, tokenizer=tok)
    await server.start()                              # http://127.0.0.1:<port>/v1
    server.open_session("s1", sampling=SamplingParams(temperature=1.0, max_new_tokens=256))
    # ... an agent program uses OpenAI(base_url=server.base_url, api_key="s1") ...
    rollouts = server.finish_session("s1", prompt_uid="p0", prompt_ids=ids, reward=1.0)
    await server.close()

Endpoints: ``POST /v1/chat/completions`` (``stream`` true or false, ``tools``, ``tool_choice``
``auto``/``none``, ``logprobs``, ``max_tokens``/``max_completion_tokens``, ``seed``) and
``GET /v1/models``.

Sessions. A request belongs to the session named by, in this order: the ``X-Session-Id``
header, the bearer token (``Authorization: Bearer <id>``, i.e. the client's ``api_key``), or the
body's ``user`` field. Only sessions the trainer opened are served; any other id gets HTTP 401,
so a stray client cannot inject training data. A finished session gets 404.

Sampling is the trainer's: temperature, top-p and top-k come from the session (the log-probs
must be those of the policy being trained), unless ``Config.client_sampling`` is on. A client's
``max_tokens`` may only lower the session's ``max_new_tokens``. ``n`` > 1 and ``stop`` strings
are refused with HTTP 400 (the engine stops on token ids; set the session's
``stop_token_ids``).

Streaming is emulated: the completion is generated in full, then sent as server-sent events
(role, content pieces, tool-call deltas, finish reason, an optional usage chunk, ``[DONE]``).
The bytes a client assembles are those of the non-streaming response.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_agents.chat import ChatFormat, ParsedCompletion
from rl_agents.session import Session, TurnRecord
from rl_core.config import Port, PositiveInt
from rl_core.errors import ConfigError, DataError, GenerationError, RLError
from rl_core.interfaces import Generator, Tokenizer
from rl_core.types import FinishReason, GenerationRequest, Rollout, SamplingParams

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["AgentServer"]

_STREAM_PIECE_CHARS = 16


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


class AgentServer:
    """Serves chat completions from a generator and records each session's tokens; see the
    module docstring."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`AgentServer`."""

        host: str = "127.0.0.1"
        """Interface to bind (loopback by default: agents run on this machine)."""
        port: Port = 0
        """TCP port; 0 picks a free one (read :attr:`AgentServer.base_url`)."""
        model_name: str = "policy"
        """The model id reported by ``/v1/models`` and in responses (any requested name is
        accepted)."""
        client_sampling: bool = False
        """Let clients set temperature/top_p (off: the session's sampling is used, so log-probs
        are the trained policy's at the training temperature)."""
        max_turns: PositiveInt | None = 64
        """Completions per session at most (protects against agents that loop)."""
        max_context_tokens: PositiveInt | None = None
        """Prompt + completion tokens per request at most; ``None``: no limit besides the
        engine's."""
        chat: ChatFormat.Config = field(default_factory=ChatFormat.Config)
        """Chat template and tool-call format."""

        def __post_init__(self) -> None:
            if not 0 <= self.port < 65536:
                raise ConfigError(f"agents.port: must be in [0, 65535], got {self.port}.")
            if self.max_turns is not None and self.max_turns < 1:
                raise ConfigError(f"agents.max_turns: must be >= 1 or null, got {self.max_turns}.")
            if isinstance(self.chat, Mapping):
                object.__setattr__(self, "chat", ChatFormat.Config(**self.chat))

    def __init__(self, config: Config, *, generator: Generator, tokenizer: Tokenizer) -> None:
        self.config = config
        self.generator = generator
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, config.chat)
        self.sessions: dict[str, Session] = {}
        """Open sessions by id."""
        self._finished: set[str] = set()
        self._runner: Any = None
        self._port: int | None = None

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Bind and start serving on the running event loop."""
        try:
            from aiohttp import web
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError(
                "agents: the chat-completions server needs aiohttp; install rl-agents."
            ) from e
        if self._runner is not None:
            return
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.config.host, self.config.port)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or []
        self._port = int(sockets[0].getsockname()[1]) if sockets else self.config.port
        self._runner = runner

    async def close(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def base_url(self) -> str:
        """``http://host:port/v1``, the OpenAI client's ``base_url``."""
        if self._port is None:
            raise RLError("AgentServer.base_url: call `await server.start()` first.")
        return f"http://{self.config.host}:{self._port}/v1"

    # ----------------------------------------------------------------------------- sessions
    def open_session(
        self,
        session_id: str,
        *,
        sampling: SamplingParams,
        metadata: Mapping[str, Any] | None = None,
    ) -> Session:
        """Start recording a session; requests carrying ``session_id`` are served from now on."""
        if session_id in self.sessions or session_id in self._finished:
            raise DataError(f"agents: session {session_id!r} was already opened; ids are unique.")
        s = Session(
            id=session_id,
            sampling=sampling,
            max_turns=self.config.max_turns,
            max_context_tokens=self.config.max_context_tokens,
            metadata=dict(metadata or {}),
        )
        self.sessions[session_id] = s
        return s

    def finish_session(
        self,
        session_id: str,
        *,
        prompt_uid: str,
        prompt_ids: Sequence[int],
        reward: float | None = None,
        failure: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """Close the session and return its rollouts (see :meth:`Session.to_rollouts`)."""
        s = self.sessions.pop(session_id, None)
        if s is None:
            raise DataError(f"agents: session {session_id!r} is not open.")
        s.closed = True
        self._finished.add(session_id)
        return s.to_rollouts(
            prompt_uid, prompt_ids, reward=reward, failure=failure, metadata=metadata
        )

    # ----------------------------------------------------------------------------- handlers
    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "rl",
                    }
                ],
            }
        )

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise _HTTPError(400, f"request body is not JSON: {e}", "invalid_json") from None
            if not isinstance(body, dict):
                raise _HTTPError(400, "request body must be a JSON object", "invalid_json")
            session = self._session_of(request, body)
            turn, parsed, prompt_len = await self._complete(session, body)
        except _HTTPError as e:
            return web.json_response(
                {
                    "error": {
                        "message": e.message,
                        "type": "invalid_request_error",
                        "param": e.param,
                        "code": e.code,
                    }
                },
                status=e.status,
            )
        return await self._respond(request, body, turn, parsed, prompt_len)

    def _session_of(self, request: web.Request, body: Mapping[str, Any]) -> Session:
        sid = request.headers.get("X-Session-Id")
        if not sid:
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                sid = auth[7:].strip()
        if not sid and isinstance(body.get("user"), str):
            sid = body["user"]
        if not sid:
            raise _HTTPError(
                401,
                "no session id: send it as the API key, the X-Session-Id header or 'user'.",
                "session_missing",
            )
        if sid in self._finished:
            raise _HTTPError(404, f"session {sid!r} has finished.", "session_finished")
        s = self.sessions.get(sid)
        if s is None:
            raise _HTTPError(401, f"session {sid!r} is not open on this server.", "session_unknown")
        return s

    def _sampling(self, s: Session, body: Mapping[str, Any]) -> SamplingParams:
        if body.get("n", 1) not in (1, None):
            raise _HTTPError(400, "only n=1 is supported", "unsupported", "n")
        if body.get("stop"):
            raise _HTTPError(
                400,
                "stop strings are not supported; the session's stop_token_ids apply",
                "unsupported",
                "stop",
            )
        sp = s.sampling
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            if not isinstance(limit, int) or limit < 1:
                raise _HTTPError(400, f"max_tokens must be a positive integer, got {limit!r}",
                                 "invalid_value", "max_tokens")  # fmt: skip
            sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, limit))
        if self.config.client_sampling:
            for key in ("temperature", "top_p"):
                if body.get(key) is not None:
                    sp = dataclasses.replace(sp, **{key: float(body[key])})
        seed = sp.seed
        if isinstance(body.get("seed"), int) and self.config.client_sampling:
            seed = body["seed"]
        if seed is not None:  # distinct, reproducible seeds per turn
            sp = dataclasses.replace(sp, seed=(seed * 1_000_003 + len(s.turns)) & 0x7FFFFFFF)
        return sp

    async def _complete(
        self, s: Session, body: Mapping[str, Any]
    ) -> tuple[TurnRecord, ParsedCompletion, int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _HTTPError(
                400, "'messages' must be a non-empty list", "invalid_value", "messages"
            )
        if s.max_turns is not None and len(s.turns) >= s.max_turns:
            raise _HTTPError(
                400, f"session {s.id!r} reached max_turns={s.max_turns}", "max_turns_reached"
            )
        tools = body.get("tools") or None
        tool_choice = body.get("tool_choice", "auto")
        tools_enabled = bool(tools) and tool_choice != "none"
        sampling = self._sampling(s, body)
        try:
            text = self.chat.render(s.substitute(messages), tools if tools_enabled else None)
        except DataError as e:
            raise _HTTPError(400, str(e), "invalid_messages", "messages") from None
        ids, _ = s.prompt_ids(text, self.chat.encode)
        limit = s.max_context_tokens
        if limit is not None:
            if len(ids) >= limit:
                raise _HTTPError(
                    400,
                    f"prompt has {len(ids)} tokens; the session allows {limit} in context",
                    "context_length_exceeded",
                    "messages",
                )
            sampling = dataclasses.replace(
                sampling, max_new_tokens=min(sampling.max_new_tokens, limit - len(ids))
            )
        req = GenerationRequest(
            request_id=f"{s.id}/{len(s.turns)}/{uuid.uuid4().hex[:8]}",
            input_ids=ids,
            sampling=sampling,
        )
        try:
            (result,) = await self.generator.generate([req])
        except (DataError, ValueError) as e:  # the request itself is bad (e.g. too long)
            raise _HTTPError(400, f"generation failed: {e}", "generation_failed") from None
        except (GenerationError, RLError) as e:  # the engine failed: retryable for the client
            raise _HTTPError(503, f"engine error: {e}", "engine_error") from None
        out = list(result.output_ids)
        dec = self.tokenizer.decode
        output_text = dec(out, skip_special_tokens=False)
        body_ids = out[:-1] if result.finish_reason == FinishReason.STOP and out else out
        raw = dec(body_ids, skip_special_tokens=False)
        visible = dec(body_ids, skip_special_tokens=True)
        parsed = ChatFormat.parse(visible, tools_enabled=tools_enabled)
        turn = TurnRecord(
            prompt_ids=ids,
            result=result,
            prompt_text=text,
            output_text=output_text,
            raw_content=raw,
            content=parsed.content,
            tool_call_ids=tuple(c.id for c in parsed.tool_calls),
            ill_formed=parsed.ill_formed,
        )
        if s.closed:  # finished while the engine was busy: serve, but do not record
            raise _HTTPError(404, f"session {s.id!r} has finished.", "session_finished")
        s.turns.append(turn)
        return turn, parsed, len(ids)

    # ----------------------------------------------------------------------------- responses
    def _finish_reason(self, turn: TurnRecord, parsed: ParsedCompletion) -> str:
        if parsed.tool_calls:
            return "tool_calls"
        return "length" if turn.result.finish_reason == FinishReason.LENGTH else "stop"

    def _logprobs(self, turn: TurnRecord) -> dict[str, Any]:
        content = []
        for t, lp in zip(turn.result.output_ids, turn.result.output_logprobs):
            s = self.tokenizer.decode([t], skip_special_tokens=False)
            content.append(
                {"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": []}
            )
        return {"content": content}

    async def _respond(
        self,
        request: web.Request,
        body: Mapping[str, Any],
        turn: TurnRecord,
        parsed: ParsedCompletion,
        prompt_len: int,
    ) -> web.StreamResponse:
        from aiohttp import web

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = str(body.get("model") or self.config.model_name)
        n_out = len(turn.result.output_ids)
        usage = {
            "prompt_tokens": prompt_len,
            "completion_tokens": n_out,
            "total_tokens": prompt_len + n_out,
        }
        finish = self._finish_reason(turn, parsed)
        want_lp = bool(body.get("logprobs"))
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = [c.to_openai() for c in parsed.tool_calls]
            choice: dict[str, Any] = {
                "index": 0,
                "message": message,
                "finish_reason": finish,
                "logprobs": self._logprobs(turn) if want_lp else None,
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

        async def send(delta: dict[str, Any], finish_reason: str | None = None, **extra: Any):
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())

        await send({"role": "assistant", "content": ""})
        content = parsed.content or ""
        for i in range(0, len(content), _STREAM_PIECE_CHARS):
            await send({"content": content[i : i + _STREAM_PIECE_CHARS]})
        for i, c in enumerate(parsed.tool_calls):
            await send({"tool_calls": [c.to_openai(index=i)]})
        await send({}, finish, **({"logprobs": self._logprobs(turn)} if want_lp else {}))
        opts = body.get("stream_options") or {}
        if isinstance(opts, Mapping) and opts.get("include_usage"):
            chunk = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage,
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        await asyncio.sleep(0)
        return resp
