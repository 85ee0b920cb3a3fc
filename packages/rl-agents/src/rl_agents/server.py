"""An agent server in front of any :class:`~rl_core.interfaces.Generator`, recording what it
serves for training. It speaks three APIs, so unmodified agents written against the official
clients work: OpenAI chat completions, OpenAI Responses and Anthropic Messages.

::

    server = AgentServer(AgentServer.Config(), generator=gen, tokenizer=tok)
    await server.start()                              # http://127.0.0.1:<port>
    server.open_session("s1", sampling=SamplingParams(temperature=1.0, max_new_tokens=256))
    # ... an agent uses OpenAI(base_url=server.base_url, api_key="s1")
    #     or Anthropic(base_url=server.root_url, api_key="s1") ...
    rollouts = server.finish_session("s1", prompt_uid="p0", prompt_ids=ids, reward=1.0)
    await server.close()

Endpoints (one module each under :mod:`rl_agents.api`): ``POST /v1/chat/completions``,
``POST /v1/responses``, ``POST /v1/messages`` (Anthropic) and ``GET /v1/models``. Every surface
turns its request into OpenAI chat messages and calls :meth:`AgentServer.complete`, which
renders them with the chat template, generates, and records the exact prompt ids, sampled ids
and log-probs as a :class:`~rl_agents.session.TurnRecord` of the session.

Sessions. A request belongs to the session named by, in this order: the ``X-Session-Id``
header, the bearer token (``Authorization: Bearer <id>``, the OpenAI client's ``api_key``), the
``x-api-key`` header (the Anthropic client's ``api_key``), or the body's ``user`` field
(``metadata.user_id`` for Anthropic). Only sessions the trainer opened are served; any other id
gets HTTP 401, so a stray client cannot inject training data. A finished session gets 404.
Concurrent agents each use their own id, and each turn is recorded only in its own session.

Models and adapters. Requests name the model ``Config.model_name`` (or one of
``Config.model_aliases``, or none): the generator's default weights. A request naming one of
``Config.adapters`` generates with that LoRA adapter (``GenerationRequest.adapter``: HFGenerator
and SGLangGenerator pick the adapter per request) and the trajectories it makes carry the name
in ``metadata[SEQUENCE_ADAPTER_KEY]``, so the trainer trains that adapter: one agent program can
train one adapter per role. A request continuing a conversation another adapter generated is
refused (a trajectory trains one adapter). Any other name gets HTTP 404 ``model_not_found``
listing the served names (``GET /v1/models`` lists them too).

Model families. Tool calls and reasoning are parsed in the format of the model's family
(``Config.chat.family``, :mod:`rl_agents.parsers`). Reasoning is returned to the client
(``reasoning_content``, ``thinking`` blocks, Responses ``reasoning`` items); its tokens are
sampled tokens of the trajectory like any other. A client's reasoning switch (Anthropic
``thinking``, OpenAI ``reasoning_effort``, Responses ``reasoning``) sets the chat template's
switch (``enable_thinking`` / ``thinking``); with a template that has none, asking for
reasoning is refused with HTTP 400 naming the field.

Stop strings (OpenAI ``stop``, Anthropic ``stop_sequences``) are applied to the completion the
engine returns (the engine stops on token ids only): the tokens are cut after the first token
that completes a stop string (those are the tokens recorded and trained), and the text returned
ends before the stop string. With a generator that streams and aborts (HFGenerator), the
request is watched as it is generated and aborted once a stop string is complete, so the
engine does not sample past it (the recorded tokens are the same cut ones).

Disconnects. A client that disconnects while its completion is generated (streamed or not)
aborts it (the engine's ``abort`` when it has one; otherwise the result is dropped) and the turn
is not recorded.

Streaming. A request with ``stream: true`` is generated through
:meth:`~rl_core.interfaces.Generator.generate_stream`: with a generator that streams
(``streams_tokens``: HFGenerator; not SGLangGenerator yet, nor a wrapper such as
ResumableGenerator, whose default stream yields the whole result once) content deltas are sent
as the tokens are sampled. Only text that is surely content goes out early: the last token is
held back (it may be the stop token), so is the text from the family's first tool-call or
reasoning trigger or a stop string on, a tail that could begin one of them or a special token,
an incomplete UTF-8 character and trailing whitespace. When the prompt leaves a reasoning block
open (Qwen3-style templates), the text up to ``</think>`` streams as reasoning
(``reasoning_content``, a ``thinking`` block, a ``reasoning`` item), then the content. The rest
(remaining reasoning and content, tool calls) follows when the completion ends, in each API's
events. The recorded tokens are those of the non-streamed completion for
the same seed.

Prompt length. A request's prompt is refused with HTTP 400 ``context_length_exceeded`` naming
the limit when it holds as many tokens as the context allows: ``Config.max_context_tokens`` or
the model's own context (a generator's ``max_context_tokens`` attribute, or its HF model's
``max_position_embeddings``, also through a wrapper's ``inner``), the smaller of the two; the tokenizer's ``model_max_length`` is
not the model's context and is not used. A text too long for the limit by its size alone is
refused before it is tokenized.

Fairness. Rendering the chat template and tokenizing (the heavy work of a request: ~5 s for
1 MiB with a byte-level tokenizer) run in a worker thread, so one large request does not stall
the other sessions' requests on the event loop.

Sampling is the trainer's: temperature, top-p and top-k come from the session (the log-probs
must be those of the policy being trained), unless ``Config.client_sampling`` is on. A client's
``max_tokens`` may only lower the session's ``max_new_tokens``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rl_agents.api import anthropic_messages, chat_completions, responses
from rl_agents.api.common import ChatRequest, Completion, HTTPError
from rl_agents.chat import ChatFormat
from rl_agents.resumable import ResumedResult
from rl_agents.session import Session, TurnRecord
from rl_core.config import Port, PositiveInt
from rl_core.errors import ConfigError, DataError, GenerationError, RLError
from rl_core.interfaces import Generator, Tokenizer
from rl_core.lora import SEQUENCE_ADAPTER_KEY
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    Rollout,
    SamplingParams,
)

if TYPE_CHECKING:
    from aiohttp import web

__all__ = ["AgentServer", "TextSink"]


class AgentServer:
    """Serves chat completions, Responses and Anthropic Messages from a generator and records
    each session's tokens; see the module docstring."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`AgentServer`."""

        host: str = "127.0.0.1"
        """Interface to bind (loopback by default: agents run on this machine)."""
        port: Port = 0
        """TCP port; 0 picks a free one (read :attr:`AgentServer.base_url`)."""
        model_name: str = "policy"
        """The model id reported by ``/v1/models`` and in responses; a request naming another
        model (not in ``model_aliases``) gets HTTP 404 naming this one."""
        model_aliases: tuple[str, ...] = ()
        """Other model names requests may use (agents with a hard-coded model name)."""
        adapters: tuple[str, ...] = ()
        """LoRA adapters served as models: a request whose ``model`` names one generates with
        it and its trajectories are tagged to train it (see the module docstring). The
        generator must have them loaded (an adapter-only weight update per name)."""
        client_sampling: bool = False
        """Let clients set temperature/top_p (off: the session's sampling is used, so log-probs
        are the trained policy's at the training temperature)."""
        max_turns: PositiveInt | None = 64
        """Completions per session at most (protects against agents that loop)."""
        max_context_tokens: PositiveInt | None = None
        """Prompt + completion tokens per request at most; ``None``: the model's context (see
        the module docstring), or no limit besides the engine's when the generator does not
        say."""
        chat: ChatFormat.Config = field(default_factory=ChatFormat.Config)
        """Chat template and tool-call format."""

        def __post_init__(self) -> None:
            if not 0 <= self.port < 65536:
                raise ConfigError(f"agents.port: must be in [0, 65535], got {self.port}.")
            if self.max_turns is not None and self.max_turns < 1:
                raise ConfigError(f"agents.max_turns: must be >= 1 or null, got {self.max_turns}.")
            if isinstance(self.chat, Mapping):
                object.__setattr__(self, "chat", ChatFormat.Config(**self.chat))
            if isinstance(self.model_aliases, str) or not all(
                isinstance(a, str) for a in self.model_aliases
            ):
                raise ConfigError(
                    f"agents.model_aliases: expected a list of model names, got "
                    f"{self.model_aliases!r}."
                )
            object.__setattr__(self, "model_aliases", tuple(self.model_aliases))
            if isinstance(self.adapters, str) or not all(
                isinstance(a, str) and a for a in self.adapters
            ):
                raise ConfigError(
                    f"agents.adapters: expected a list of adapter names, got {self.adapters!r}."
                )
            object.__setattr__(self, "adapters", tuple(self.adapters))
            clash = set(self.adapters) & {self.model_name, *self.model_aliases}
            if clash:
                raise ConfigError(
                    f"agents.adapters: {sorted(clash)} also named as model_name/model_aliases; "
                    "an adapter needs a name of its own."
                )

    def __init__(self, config: Config, *, generator: Generator, tokenizer: Tokenizer) -> None:
        self.config = config
        self.generator = generator
        self.tokenizer = tokenizer
        self.chat = ChatFormat(tokenizer, config.chat)
        self.sessions: dict[str, Session] = {}
        """Open sessions by id."""
        self._finished: set[str] = set()
        self._turn_adapters: dict[str, list[str | None]] = {}
        self._runner: Any = None
        self._port: int | None = None
        model_ctx = _model_context(generator)
        limits = [n for n in (config.max_context_tokens, model_ctx) if n is not None]
        self.max_context_tokens: int | None = min(limits) if limits else None
        """Prompt + completion tokens a request may use: ``Config.max_context_tokens`` or the
        model's context, the smaller (``None``: unknown, no limit besides the engine's)."""
        self._max_token_bytes = _max_token_bytes(tokenizer)

    # ----------------------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        """Bind and start serving on the running event loop."""
        try:
            from aiohttp import web
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ConfigError(
                "agents: the chat-completions server needs aiohttp; install rlpost-agents."
            ) from e
        if self._runner is not None:
            return
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._route(chat_completions.handle))
        app.router.add_post("/v1/responses", self._route(responses.handle))
        app.router.add_post("/v1/messages", self._route(anthropic_messages.handle))
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
        return f"{self.root_url}/v1"

    @property
    def served_model(self) -> str:
        """The model id reported when a request names none (``Config.model_name``)."""
        return self.config.model_name

    @property
    def served_models(self) -> tuple[str, ...]:
        """Every model name a request may use: the model, its aliases and the adapters."""
        c = self.config
        return (c.model_name, *c.model_aliases, *c.adapters)

    @property
    def root_url(self) -> str:
        """``http://host:port``, the Anthropic client's ``base_url`` (it appends ``/v1``)."""
        if self._port is None:
            raise RLError("AgentServer.root_url: call `await server.start()` first.")
        return f"http://{self.config.host}:{self._port}"

    # ----------------------------------------------------------------------------- sessions
    def open_session(
        self,
        session_id: str,
        *,
        sampling: SamplingParams,
        metadata: Mapping[str, Any] | None = None,
        return_routing: bool = False,
    ) -> Session:
        """Start recording a session; requests carrying ``session_id`` are served from now on.
        With ``return_routing`` every completion asks the engine for its MoE routing and the
        session's rollouts carry it (:attr:`Session.return_routing`)."""
        if session_id in self.sessions or session_id in self._finished:
            raise DataError(f"agents: session {session_id!r} was already opened; ids are unique.")
        s = Session(
            id=session_id,
            sampling=sampling,
            max_turns=self.config.max_turns,
            max_context_tokens=self.max_context_tokens,
            metadata=dict(metadata or {}),
            return_routing=return_routing,
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
        adapters = self._turn_adapters.pop(session_id, [])
        rollouts = s.to_rollouts(
            prompt_uid, prompt_ids, reward=reward, failure=failure, metadata=metadata
        )
        if s.turns and len(adapters) == len(s.turns):
            for rollout, group in zip(rollouts, _trajectory_turns(s.turns), strict=True):
                names = {adapters[i] for i in group}
                if len(names) == 1 and None not in names:
                    rollout.metadata[SEQUENCE_ADAPTER_KEY] = names.pop()
        return rollouts

    # ----------------------------------------------------------------------------- handlers
    async def _handle_models(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        return web.json_response(
            {
                "object": "list",
                "data": [
                    {"id": name, "object": "model", "created": 0, "owned_by": "rl"}
                    for name in (self.config.model_name, *self.config.adapters)
                ],
            }
        )

    def _route(self, handler: Any) -> Any:
        async def route(request: web.Request) -> web.StreamResponse:
            return await handler(self, request)

        return route

    def session_of(self, request: web.Request, body_user: str | None = None) -> Session:
        """The open session a request belongs to (see the module docstring), or HTTP 401/404."""
        sid = request.headers.get("X-Session-Id")
        if not sid:
            auth = request.headers.get("Authorization", "")
            if auth.lower().startswith("bearer "):
                sid = auth[7:].strip()
        if not sid:
            sid = request.headers.get("x-api-key", "").strip()
        if not sid and isinstance(body_user, str):
            sid = body_user
        if not sid:
            raise HTTPError(
                401,
                "no session id: send it as the API key, the X-Session-Id header or 'user'.",
                "session_missing",
            )
        if sid in self._finished:
            raise HTTPError(404, f"session {sid!r} has finished.", "session_finished")
        s = self.sessions.get(sid)
        if s is None:
            raise HTTPError(401, f"session {sid!r} is not open on this server.", "session_unknown")
        return s

    def check_model(self, name: Any) -> str | None:
        """The LoRA adapter a request's ``model`` names (``None``: the served model, one of its
        aliases, or no name), or HTTP 404 listing the served names."""
        if name is None or name == "":
            return None
        if name in self.config.adapters:
            return str(name)
        if name == self.config.model_name or name in self.config.model_aliases:
            return None
        raise HTTPError(
            404,
            f"model {name!r} is not served here; this server serves "
            f"{', '.join(map(repr, self.served_models))}.",
            "model_not_found",
            "model",
        )

    def _prompt(
        self, s: Session, req: ChatRequest
    ) -> tuple[str, tuple[int, ...], int | None, int | None]:
        """Render and tokenize ``req`` (run in a worker thread: the heavy part of a request).
        Refuses a text that cannot fit the context by its size alone before tokenizing it.
        Returns the text, its ids, the turn it continues and the turn rendered back
        differently (``None`` each when there is none)."""
        try:
            text = self.chat.render(
                s.substitute(req.messages),
                req.tools if req.tools_enabled else None,
                thinking=req.thinking,
            )
        except DataError as e:
            raise HTTPError(400, str(e), "invalid_messages", "messages") from None
        limit = s.max_context_tokens
        if limit is not None and self._max_token_bytes is not None:
            size = len(text.encode("utf-8", errors="replace"))
            # No token covers more than _max_token_bytes bytes of text (x4: normalizers may
            # shrink text before it is split), so the prompt has more tokens than the limit.
            if size > 4 * self._max_token_bytes * limit:
                raise HTTPError(
                    400,
                    f"prompt is {size} bytes, more than the {limit} tokens the context allows "
                    f"(max_context_tokens={limit}) can hold; shorten the messages",
                    "context_length_exceeded",
                    "messages",
                )
        ids, continued = s.prompt_ids(text, self.chat.encode)
        return text, ids, continued, s.rerendered(text)

    def _sampling(self, s: Session, req: ChatRequest) -> SamplingParams:
        sp = s.sampling
        if req.max_tokens is not None:
            sp = dataclasses.replace(sp, max_new_tokens=min(sp.max_new_tokens, req.max_tokens))
        seed = sp.seed
        if self.config.client_sampling:
            if req.temperature is not None:
                sp = dataclasses.replace(sp, temperature=req.temperature)
            if req.top_p is not None:
                sp = dataclasses.replace(sp, top_p=req.top_p)
            if req.seed is not None:
                seed = req.seed
        if seed is not None:  # distinct, reproducible seeds per turn
            sp = dataclasses.replace(sp, seed=(seed * 1_000_003 + len(s.turns)) & 0x7FFFFFFF)
        return sp

    async def complete(
        self,
        s: Session,
        req: ChatRequest,
        request: web.Request | None = None,
        on_text: TextSink | None = None,
    ) -> Completion:
        """Render ``req`` with the chat template, generate, record the turn in session ``s``
        and return it. A disconnect of ``request``'s client aborts the generation. With
        ``on_text``, content is handed to it as it is generated (see the module docstring:
        only text that is surely content, never a stop string or a tool call's start);
        :attr:`Completion.streamed` is what it was given. Raises
        :class:`~rl_agents.api.common.HTTPError` for a bad request."""
        if s.max_turns is not None and len(s.turns) >= s.max_turns:
            raise HTTPError(
                400, f"session {s.id!r} reached max_turns={s.max_turns}", "max_turns_reached"
            )
        if req.thinking and self.chat.thinking_switch is None:
            raise HTTPError(
                400,
                "thinking: this model's chat template has no reasoning switch (enable_thinking "
                "or thinking); omit the reasoning parameter or turn it off",
                "unsupported",
                "thinking",
            )
        sampling = self._sampling(s, req)
        loop = asyncio.get_running_loop()
        text, ids, continued, rerendered = await loop.run_in_executor(
            None, functools.partial(self._prompt, s, req)
        )
        adapters = self._turn_adapters.setdefault(s.id, [])
        if continued is not None and continued < len(adapters):
            before = adapters[continued]
            if before != req.adapter:
                raise HTTPError(
                    400,
                    f"model: this conversation was generated by "
                    f"{before or self.config.model_name!r} and continues with "
                    f"{req.adapter or self.config.model_name!r}; a trajectory trains one "
                    "adapter, so keep each role's conversation on its own model",
                    "adapter_mismatch",
                    "model",
                )
        limit = s.max_context_tokens
        if limit is not None:
            if len(ids) >= limit:
                raise HTTPError(
                    400,
                    f"prompt has {len(ids)} tokens; the context allows {limit} "
                    f"(max_context_tokens={limit}, prompt + completion); shorten the messages",
                    "context_length_exceeded",
                    "messages",
                )
            sampling = dataclasses.replace(
                sampling, max_new_tokens=min(sampling.max_new_tokens, limit - len(ids))
            )
        gen_request = GenerationRequest(
            request_id=f"{s.id}/{len(s.turns)}/{uuid.uuid4().hex[:8]}",
            input_ids=ids,
            sampling=sampling,
            return_routing=s.return_routing,
            adapter=req.adapter,
        )
        live = None
        g = self.generator
        early_stop = bool(req.stop) and g.streams_tokens and g.supports_abort
        if on_text is not None or early_stop:
            live = _LiveText(
                self.tokenizer,
                on_text,
                prompt_tokens=len(ids),
                ends=(*self.chat.format.triggers, *req.stop),
                clean=self.chat._strip_specials,
                holds=(*self.chat.format.triggers, *req.stop, *self.chat._specials),
                stops=req.stop if early_stop else (),
                thinking=self._reasoning_open(text),
            )
        try:
            result = await self._generate(gen_request, request, live)
        except (DataError, ValueError) as e:  # the request itself is bad (e.g. too long)
            raise HTTPError(400, f"generation failed: {e}", "generation_failed") from None
        except (GenerationError, RLError) as e:  # the engine failed: retryable for the client
            raise HTTPError(503, f"engine error: {e}", "engine_error") from None
        result, stop_at = self._apply_stop(result, req.stop, len(ids))
        out = list(result.output_ids)
        dec = self.tokenizer.decode
        output_text = dec(out, skip_special_tokens=False)
        ends_on_token = stop_at is None and result.finish_reason == FinishReason.STOP and bool(out)
        body_ids = out[:-1] if ends_on_token else out
        raw = dec(body_ids, skip_special_tokens=False)
        shown = raw
        if stop_at is not None:
            shown = raw[: raw.find(stop_at)] if stop_at in raw else raw
        parsed = self.chat.parse_completion(
            shown, prompt=text, tools_enabled=req.tools_enabled, tools=req.tools
        )
        turn = TurnRecord(
            prompt_ids=ids,
            result=result,
            prompt_text=text,
            output_text=output_text,
            raw_content=raw,
            content=parsed.content,
            tool_call_ids=tuple(c.id for c in parsed.tool_calls),
            ill_formed=parsed.ill_formed,
            rerendered_turn=rerendered,
        )
        if s.closed:  # finished while the engine was busy: serve, but do not record
            raise HTTPError(404, f"session {s.id!r} has finished.", "session_finished")
        s.turns.append(turn)
        adapters.append(req.adapter)  # parallel to s.turns (no await between the two)
        if parsed.tool_calls:
            finish = "tool_calls"
        else:
            finish = "length" if result.finish_reason == FinishReason.LENGTH else "stop"
        return Completion(
            turn=turn,
            parsed=parsed,
            prompt_tokens=len(ids),
            finish=finish,
            stop_sequence=stop_at,
            streamed=live.sent if live is not None else "",
            streamed_reasoning=live.sent_reasoning if live is not None else "",
        )

    def _reasoning_open(self, prompt_text: str) -> bool:
        """The prompt leaves a reasoning block open (the completion starts as reasoning)."""
        tail = prompt_text[-64:]
        return self.chat.format.reasoning and tail.rfind("<think>") > tail.rfind("</think>")

    async def _generate(
        self,
        gen_request: GenerationRequest,
        request: web.Request | None,
        live: _LiveText | None = None,
    ) -> GenerationResult:
        """Generate one request (streamed to ``live`` when given); when ``request``'s client
        disconnects first, abort it (the generator's ``abort`` if it has one, else drop the
        result) and raise HTTP 499."""
        task = asyncio.ensure_future(self._run(gen_request, live))
        if request is None:
            return await task
        while not task.done():
            await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if not task.done() and _disconnected(request):
                if getattr(self.generator, "supports_abort", False):
                    with contextlib.suppress(NotImplementedError):  # a wrapper's inner lacks it
                        await self.generator.abort([gen_request.request_id])
                task.add_done_callback(_swallow)
                raise HTTPError(
                    499, "the client disconnected; generation aborted", "client_disconnected"
                )
        return task.result()

    async def _run(
        self, gen_request: GenerationRequest, live: _LiveText | None
    ) -> GenerationResult:
        """The generator's result for ``gen_request``; with ``live``, through its
        :meth:`~rl_core.interfaces.Generator.generate_stream`, each chunk fed to ``live``."""
        if live is None:
            (result,) = await self.generator.generate([gen_request])
            return result
        final, aborted = None, False
        async for chunk in self.generator.generate_stream(gen_request):
            await live.feed(chunk.output_ids)
            final = chunk.result
            if live.stop_seen and not aborted and final is None:
                # A stop string is complete: the rest would be cut anyway (see _apply_stop).
                aborted = True
                with contextlib.suppress(NotImplementedError):
                    await self.generator.abort([gen_request.request_id])
        if final is None:
            raise GenerationError(
                f"{type(self.generator).__name__}.generate_stream ended without a result"
            )
        return final

    def _apply_stop(
        self, result: GenerationResult, stops: Sequence[str], prompt_len: int
    ) -> tuple[GenerationResult, str | None]:
        """``result`` cut after the first token that completes one of ``stops`` (the
        shortest prefix whose text holds a stop string; finish reason ``stop``), and the stop
        string met first; ``(result, None)`` when none occurs."""
        if not stops:
            return result, None
        out = result.output_ids
        dec = self.tokenizer.decode

        def hit(k: int) -> str | None:
            t = dec(list(out[:k]), skip_special_tokens=False)
            found = [(t.find(x), x) for x in stops if x in t]
            return min(found)[1] if found else None

        if not out or hit(len(out)) is None:
            return result, None
        lo, hi = 1, len(out)  # the smallest k with a hit (a prefix's text only grows)
        while lo < hi:
            mid = (lo + hi) // 2
            if hit(mid) is None:
                lo = mid + 1
            else:
                hi = mid
        routed = result.routed_experts
        cut = dataclasses.replace(
            result,
            output_ids=tuple(out[:lo]),
            output_logprobs=tuple(result.output_logprobs[:lo]),
            finish_reason=FinishReason.STOP,
            routed_experts=routed[: prompt_len + lo] if routed is not None else None,
        )
        if isinstance(cut, ResumedResult):  # its pieces give each token's version: cut them too
            pieces, left = [], lo
            for p in cut.pieces:
                if left <= 0:
                    break
                k = min(left, len(p.output_ids))
                if k < len(p.output_ids):
                    p = dataclasses.replace(
                        p, output_ids=p.output_ids[:k], output_logprobs=p.output_logprobs[:k]
                    )
                pieces.append(p)
                left -= k
            cut = dataclasses.replace(cut, pieces=tuple(pieces))
        return cut, hit(lo)


TextSink = Callable[[str, int, bool], Awaitable[None]]
"""Where :meth:`AgentServer.complete` streams text: ``(text delta, prompt tokens, is it
reasoning)``."""


class _LiveText:
    """The content (and the reasoning, when the prompt opened a reasoning block) of a
    completion being generated, handed on as it grows. Only text that is surely content is
    given: the last token is held (it may be the stop token, which is not
    content), and so is text from the first tool-call / reasoning trigger or stop string on
    (the rest of the content is known only once the completion is parsed), a tail that could
    begin a trigger, a stop string or a special token, and a tail that is an incomplete UTF-8
    character, and trailing whitespace (dropped by the parser before a tool call)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sink: TextSink | None,
        *,
        prompt_tokens: int,
        ends: Sequence[str],
        clean: Callable[[str], str],
        holds: Sequence[str],
        stops: Sequence[str] = (),
        thinking: bool = False,
    ) -> None:
        self.tokenizer, self.sink, self.prompt_tokens = tokenizer, sink, prompt_tokens
        self.ends, self.clean = tuple(e for e in ends if e), clean
        self.holds = tuple(h for h in holds if h)
        self.stops = tuple(x for x in stops if x)
        self.ids: list[int] = []
        self.sent = ""
        """Text handed to the sink so far."""
        self.stopped = self.sink is None
        """No more content is sent (no sink, a trigger or stop string met, client gone)."""
        self.stop_seen = False
        """The text holds one of ``stops``: the generation may be aborted."""
        self.decoded = 0
        """Tokens decoded at the last look."""
        self.thinking = thinking
        """Still in a reasoning block the prompt opened (text goes out as reasoning)."""
        self.sent_reasoning = ""
        """Reasoning handed to the sink so far."""
        self.offset = 0
        """Where the content starts in the text (after the reasoning block)."""
        self.after_trigger = False
        """A reasoning block came first: the parser strips the content, so do we."""

    async def feed(self, ids: Sequence[int]) -> None:
        """Take newly sampled ``ids`` and hand on the content they make surely known; note
        when the text holds a stop string (:attr:`stop_seen`)."""
        self.ids.extend(ids)
        watch = bool(self.stops) and not self.stop_seen
        if (self.stopped and not watch) or len(self.ids) < 2 or not ids:
            return
        n = len(self.ids) - 1
        if n - self.decoded < max(1, n // _DECODE_EVERY):
            return  # a long text is decoded anew every n/64 tokens, not every token
        self.decoded = n
        text = self.tokenizer.decode(self.ids[:-1], skip_special_tokens=False)
        if watch and any(x in text for x in self.stops):
            self.stop_seen = True
        if self.stopped or self.sink is None:
            return
        if self.thinking:  # the prompt opened the reasoning: it runs until </think>
            close = text.find(_THINK_CLOSE)
            seg = text if close < 0 else text[:close]
            ends = tuple(e for e in self.ends if e != _THINK_CLOSE)
            cut = self._cut(seg, ends, (_THINK_CLOSE, *self.holds))
            await self._send(self.clean(seg[:cut]).strip(), reasoning=True)
            if close < 0 or self.stopped:
                return
            self.thinking, self.offset, self.after_trigger = False, close + len(_THINK_CLOSE), True
        text = text[self.offset :]
        cut = self._cut(text, self.ends, self.holds)
        # Trailing whitespace waits for what follows: a parser strips it before a tool call
        # (and all of it around the content after a reasoning block).
        shown = self.clean(text[:cut]).rstrip()
        await self._send(shown.lstrip() if self.after_trigger else shown, reasoning=False)

    def _cut(self, text: str, ends: Sequence[str], holds: Sequence[str]) -> int:
        """How much of ``text`` is surely known: up to the first of ``ends`` (then no more is
        sent), less a tail that could begin one of ``holds`` or is an incomplete character."""
        cut = len(text)
        for e in ends:
            i = text.find(e)
            if i >= 0:
                cut, self.stopped = min(cut, i), True
        for h in holds:
            for k in range(min(len(h) - 1, len(text)), 0, -1):
                if text.endswith(h[:k]):
                    cut = min(cut, len(text) - k)
                    break
        while cut > 0 and text[cut - 1] == "\ufffd":
            cut -= 1
        return cut

    async def _send(self, shown: str, *, reasoning: bool) -> None:
        """Hand the growth of ``shown`` (the whole text known so far of one kind) on."""
        sent = self.sent_reasoning if reasoning else self.sent
        if not shown.strip() or not shown.startswith(sent) or len(shown) == len(sent):
            return
        delta = shown[len(sent) :]
        if reasoning:
            self.sent_reasoning = shown
        else:
            self.sent = shown
        try:
            assert self.sink is not None
            await self.sink(delta, self.prompt_tokens, reasoning)
        except Exception:  # the client went away: stop sending, the generation is aborted
            self.stopped = True


_DECODE_EVERY = 64
"""The text is decoded again once it grew by 1/64 of its tokens (every token for the first
64): the whole text is decoded each time (exactly what the parser sees), so this bounds the
cost of a long completion to a few hundred decodes instead of one per token."""

_THINK_CLOSE = "</think>"
"""The end of a reasoning block (every family with reasoning writes ``<think>`` blocks)."""

_DISCONNECT_POLL_S = 0.05
"""How often a request being generated checks that its client is still connected."""


def _disconnected(request: web.Request) -> bool:
    """The client of ``request`` has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _swallow(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned generation's outcome so its exception is not logged as lost."""
    if not task.cancelled():
        task.exception()


def _trajectory_turns(turns: Sequence[TurnRecord]) -> list[list[int]]:
    """The turn indices of each trajectory :func:`rl_agents.session.linearize` makes of
    ``turns``, in its order (the same rule: a turn extends the trajectory whose tokens are
    the longest prefix of its prompt ids, else starts one)."""
    held: list[tuple[int, ...]] = []
    groups: list[list[int]] = []
    for i, t in enumerate(turns):
        best = None
        for g, h in enumerate(held):
            extends = len(h) <= len(t.prompt_ids) and t.prompt_ids[: len(h)] == h
            if extends and (best is None or len(h) > len(held[best])):
                best = g
        if best is None:
            held.append(())
            groups.append([])
            best = len(held) - 1
        held[best] = t.prompt_ids + tuple(t.result.output_ids)
        groups[best].append(i)
    return groups


def _model_context(generator: Generator) -> int | None:
    """The model's context in tokens as the generator tells it: its ``max_context_tokens``
    attribute, or its HF model's ``config.max_position_embeddings``, looking through wrappers
    that keep the wrapped generator as ``inner`` (ResumableGenerator); ``None`` when none says."""
    g: Any = generator
    for _ in range(8):
        if g is None:
            break
        model_config = getattr(getattr(g, "model", None), "config", None)
        for value in (
            getattr(g, "max_context_tokens", None),
            getattr(model_config, "max_position_embeddings", None),
        ):
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        g = getattr(g, "inner", None)
    return None


def _max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of any vocabulary entry (an upper bound of the text one token
    covers: byte-level and SentencePiece vocabularies spell each byte with >= 1 byte); ``None``
    when the tokenizer has no ``get_vocab``."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
        return max((len(str(k).encode("utf-8", errors="replace")) for k in vocab), default=None)
    except Exception:  # a tokenizer without a usable vocabulary: no pre-check
        return None
