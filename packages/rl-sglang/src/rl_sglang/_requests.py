"""Requests of :class:`~rl_sglang.generator.SGLangGenerator`: dispatch to the least-loaded server
(or the router), retries of transient failures, parsing responses, aborting requests in flight
(:class:`RequestDispatcher`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from rl_core.errors import GenerationError
from rl_core.types import FinishReason, GenerationRequest, GenerationResult
from rl_sglang._fleet import ServerFleet
from rl_sglang._http import Server, ServerClient
from rl_sglang._io import IOLoop
from rl_sglang._routing import RoutingLayout, decode_routing
from rl_sglang._weights import WeightUpdater

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


class _Retry(Exception):
    """A transient failure: retry the request elsewhere."""


@dataclass(slots=True, eq=False)
class _Live:
    """One request in flight (or waiting for a slot)."""

    request_id: str
    rid: str = ""
    server: Server | None = None
    aborted: bool = False


class RequestDispatcher:
    """Serves ``generate`` calls on the fleet: one ``/generate`` per request on the up server
    with the most free slots (or through the router), retried elsewhere on transient failures,
    checked against the weight version; aborts end requests with their partial tokens."""

    def __init__(
        self,
        *,
        io: IOLoop,
        client: ServerClient,
        fleet: ServerFleet,
        weights: WeightUpdater,
        stats: dict[str, int],
        seed: int,
        max_retries: int,
        retry_backoff_s: float,
        request_timeout_s: float,
        stop_on_eos: bool,
        extra_stop_token_ids: tuple[int, ...],
        default_stop_ids: tuple[int, ...],
        vocab_size: int | None,
        routing_layout: RoutingLayout | None,
        supports_routing: bool,
    ) -> None:
        """Requests without a seed get one from ``Random(seed)``; ``stats`` counts requests,
        retries, failed requests and version mismatches."""
        self._io = io
        self._client = client
        self._fleet = fleet
        self._weights = weights
        self._stats = stats
        self._seed_rng = random.Random(seed)
        self._max_retries = max_retries
        self._retry_backoff_s = retry_backoff_s
        self._request_timeout_s = request_timeout_s
        self._stop_on_eos = stop_on_eos
        self._extra_stop_token_ids = extra_stop_token_ids
        self._default_stop_ids = default_stop_ids
        self._vocab_size = vocab_size
        self._routing_layout = routing_layout
        self._supports_routing = supports_routing
        self._live: dict[str, list[_Live]] = {}
        self._abort_epoch = 0  # bumped by abort-all; generate() calls from before it are aborted
        self._background: set[asyncio.Future[Any]] = set()

    async def generate(
        self, requests: Sequence[GenerationRequest], adapters: list[str | None]
    ) -> list[GenerationResult]:
        """Serve ``requests`` (non-empty; ``adapters``: the served adapter name of each, or
        ``None``) concurrently, bounded per server; results in request order."""
        seeds = []
        for r in requests:
            if not r.input_ids:
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has no input ids."
                )
            v = self._vocab_size
            if v is not None and (min(r.input_ids) < 0 or max(r.input_ids) >= v):
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has token ids outside "
                    f"[0, {v}); encode prompts with the served model's tokenizer."
                )
            if not self._stop_on_eos and (r.sampling.stop_token_ids or self._extra_stop_token_ids):
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} has stop ids, but "
                    "generator.stop_on_eos=false sends SGLang's ignore_eos, which ignores every "
                    "stop id; set stop_on_eos=true or drop the stop ids."
                )
            if r.return_routing and not self._supports_routing:
                raise GenerationError(
                    f"SGLangGenerator.generate: request {r.request_id!r} asks for the expert "
                    f"routing (rollout.routing_replay), but {self._routing_refusal()}"
                )
            seeds.append(
                r.sampling.seed if r.sampling.seed is not None else self._seed_rng.getrandbits(62)
            )
        # An abort-all issued after this call started covers its requests even if they are not
        # registered on the I/O loop yet (a loaded machine can delay that past the abort).
        epoch = self._abort_epoch
        return await self._io.run(self._generate_all(list(requests), seeds, adapters, epoch))

    async def _generate_all(
        self,
        requests: list[GenerationRequest],
        seeds: list[int],
        adapters: list[str | None],
        epoch: int,
    ) -> list[GenerationResult]:
        lives = []
        for r in requests:
            live = _Live(r.request_id)
            live.aborted = epoch != self._abort_epoch
            self._live.setdefault(r.request_id, []).append(live)
            lives.append(live)
        try:
            return list(
                await asyncio.gather(
                    *(
                        self._one(r, s, a, lv)
                        for r, s, a, lv in zip(requests, seeds, adapters, lives)
                    )
                )
            )
        finally:
            for lv in lives:
                group = self._live.get(lv.request_id)
                if group is not None:
                    with contextlib.suppress(ValueError):
                        group.remove(lv)
                    if not group:
                        del self._live[lv.request_id]

    def _payload(
        self, req: GenerationRequest, seed: int, rid: str, adapter: str | None = None
    ) -> dict[str, Any]:
        s = req.sampling
        stops = sorted(set(s.stop_token_ids) | set(self._default_stop_ids))
        params: dict[str, Any] = {
            "temperature": float(s.temperature),
            "top_p": float(s.top_p),
            "top_k": int(s.top_k) if s.top_k > 0 else -1,
            "max_new_tokens": int(s.max_new_tokens),
            "stop_token_ids": stops,
            "sampling_seed": int(seed),
            "no_stop_trim": True,
            "ignore_eos": not self._stop_on_eos,
            "skip_special_tokens": False,
        }
        body: dict[str, Any] = {
            "rid": rid,
            "input_ids": list(req.input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if req.return_routing:
            body["return_routed_experts"] = True
        if adapter is not None:
            body["lora_path"] = adapter  # SGLang resolves a loaded adapter by its name
        return body

    def _routing_refusal(self) -> str:
        """Why this generator cannot return routing (for error messages)."""
        if self._routing_layout is None:
            return (
                "the served model is not a mixture-of-experts checkpoint this generator can read "
                "(config.json has no num_experts / num_experts_per_tok); set "
                "rollout.routing_replay=off."
            )
        return (
            "the SGLang servers were not launched with --enable-return-routed-experts; set "
            "SGLangGenerator.Config.capture_routing=true (or start the attached servers with "
            "that flag)."
        )

    def _aborted_result(self, req: GenerationRequest) -> GenerationResult:
        return GenerationResult(
            request_id=req.request_id,
            output_ids=(),
            output_logprobs=(),
            finish_reason=FinishReason.ABORT,
            weight_version=self._weights.version,
        )

    async def _pick(self) -> Server:
        """The up server with the most free slots; waits while none is up."""
        deadline = time.monotonic() + self._request_timeout_s
        while True:
            up = [s for s in self._fleet.servers if s.up]
            if up:
                return max(up, key=lambda s: (s.sem._value, -s.index))
            if time.monotonic() > deadline:
                raise _Retry("no SGLang server in rotation")
            await asyncio.sleep(0.2)

    async def _one(
        self, req: GenerationRequest, seed: int, adapter: str | None, live: _Live
    ) -> GenerationResult:
        attempt = 0
        while True:
            if live.aborted:
                return self._aborted_result(req)
            try:
                return await self._attempt(req, seed, adapter, live, attempt)
            except _Retry as e:
                attempt += 1
                if live.aborted:
                    return self._aborted_result(req)
                if attempt > self._max_retries:
                    self._stats["failed_requests"] += 1
                    log.warning(
                        "SGLangGenerator: request %s failed %d times (%s); returning it as "
                        "an error (a failed rollout).",
                        req.request_id,
                        attempt,
                        e,
                    )
                    return dataclasses.replace(
                        self._aborted_result(req), finish_reason=FinishReason.ERROR
                    )
                self._stats["retries"] += 1
                await asyncio.sleep(self._retry_backoff_s * 2 ** (attempt - 1))

    async def _attempt(
        self, req: GenerationRequest, seed: int, adapter: str | None, live: _Live, attempt: int
    ) -> GenerationResult:
        # sglang-router 0.3.2 re-serialises /generate from a typed struct that has no
        # return_routed_experts (verified: it forwards lora_path, drops that field), so requests
        # asking for routing go to a server directly.
        via_router = self._fleet.router_url is not None and not req.return_routing
        server = None if via_router else await self._pick()
        sem = self._fleet.router_sem if via_router else server.sem  # type: ignore[union-attr]
        assert sem is not None
        async with sem:
            if live.aborted:
                return self._aborted_result(req)
            if server is not None and not server.up:
                raise _Retry(f"{server.url} left rotation")
            rid = f"{req.request_id}#{attempt}-{random.getrandbits(32):08x}"
            live.rid, live.server = rid, server
            url = self._fleet.router_url if via_router else server.url  # type: ignore[union-attr]
            assert url is not None
            post = asyncio.ensure_future(
                self._client.post(
                    url,
                    "/generate",
                    self._payload(req, seed, rid, adapter),
                    timeout=self._request_timeout_s,
                )
            )
            waiters: set[asyncio.Future[Any]] = {post}
            down = None
            if server is not None:
                down = asyncio.ensure_future(server.down.wait())
                waiters.add(down)
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if down is not None:
                    down.cancel()
            if not post.done():
                post.cancel()
                # Let the cancelled POST wind down. Its own outcome (cancelled, or an error just
                # before) is superseded by the _Retry below, counted in stats["retries"]; a
                # cancellation of this task itself still propagates (asyncio.wait re-raises it).
                await asyncio.wait({post})
                if not post.cancelled():
                    post.exception()  # retrieved, so asyncio does not log it as unhandled
                raise _Retry(f"{server.url if server else url} was taken out of rotation")
            try:
                status, data = post.result()
            except (TimeoutError, aiohttp.ClientError, OSError) as e:
                if server is not None:
                    self._fleet.suspect(server)
                raise _Retry(f"{url}: {type(e).__name__}: {e}") from e
            finally:
                live.server = None
        if status != 200:
            msg = data.get("error", data) if isinstance(data, dict) else data
            if 400 <= status < 500 and status not in (408, 429):
                raise GenerationError(
                    f"SGLangGenerator: request {req.request_id!r} refused by {url} (HTTP "
                    f"{status}): {msg}"
                )
            raise _Retry(f"{url}: HTTP {status}: {str(msg)[:200]}")
        return self._parse(req, data, server)

    def _parse(self, req: GenerationRequest, data: Any, server: Server | None) -> GenerationResult:
        if isinstance(data, list):
            (data,) = data
        meta = data["meta_info"]
        ids = tuple(int(t) for t in data.get("output_ids") or ())
        lps_raw = meta.get("output_token_logprobs") or []
        lps = tuple(float(x[0]) for x in lps_raw)
        if len(lps) != len(ids) or any(int(x[1]) != t for x, t in zip(lps_raw, ids)):
            raise _Retry(
                f"{req.request_id}: {len(ids)} output ids but {len(lps)} log-probs in the response"
            )
        version = self._response_version(meta, req, server)
        finish = meta.get("finish_reason") or {}
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        reason = _FINISH.get(str(kind))
        if reason is None:
            raise _Retry(f"{req.request_id}: unknown finish reason {finish!r}")
        routing = self._parse_routing(req, meta, len(req.input_ids) + len(ids), reason)
        self._stats["requests"] += 1
        return GenerationResult(
            request_id=req.request_id,
            output_ids=ids,
            output_logprobs=lps,
            finish_reason=reason,
            weight_version=version,
            routed_experts=routing,
        )

    def _parse_routing(
        self, req: GenerationRequest, meta: dict[str, Any], num_tokens: int, reason: FinishReason
    ) -> Any:
        if not req.return_routing:
            return None
        payload = meta.get("routed_experts")
        if not payload:
            if reason is FinishReason.ABORT:
                return None  # aborted before the model ran: nothing was routed
            raise _Retry(f"{req.request_id}: the response carries no routed_experts")
        assert self._routing_layout is not None  # generate() refuses routing without a layout
        try:
            return decode_routing(payload, self._routing_layout, num_tokens)
        except ValueError as e:
            raise GenerationError(
                f"SGLangGenerator: request {req.request_id!r}: cannot read the server's "
                f"routed_experts ({e}); does model_path match the served model?"
            ) from e

    def _response_version(
        self, meta: dict[str, Any], req: GenerationRequest, server: Server | None
    ) -> int:
        raw = [meta.get("weight_version")]
        spans = meta.get("weight_versions") or []
        raw += [sp.get("version") for sp in spans if isinstance(sp, dict)]
        try:
            versions = [int(str(v)) for v in raw if v is not None]
        except ValueError as e:
            raise _Retry(f"{req.request_id}: weight version {raw} is not an integer") from e
        if not versions:
            raise _Retry(f"{req.request_id}: the response carries no weight version")
        version = min(versions)
        if not self._weights.updating and any(v != self._weights.version for v in versions):
            # A server out of sync (restarted elsewhere, or changed behind our back).
            self._stats["version_mismatches"] += 1
            if server is not None:
                self._fleet.mark_down(
                    server, f"serves weight version {versions}, expected {self._weights.version}"
                )
            raise _Retry(
                f"{req.request_id}: served by weight version {versions}, expected {self._weights.version}"
            )
        return version

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) requests; they return ABORT with their partial tokens.

        Requests still waiting for a slot return ABORT with no tokens. Unknown ids are ignored.
        Aborting all also covers requests of :meth:`generate` calls already made but not yet
        dispatched.
        """
        if request_ids is None:
            self._abort_epoch += 1
        await self._io.run(self._abort(None if request_ids is None else list(request_ids)))

    async def _abort(self, request_ids: list[str] | None) -> None:
        if request_ids is None:
            lives = [lv for group in self._live.values() for lv in group]
        else:
            lives = [lv for rid in request_ids for lv in self._live.get(rid, [])]
        for lv in lives:
            lv.aborted = True
        up = [s for s in self._fleet.servers if s.up]
        if request_ids is None:
            bodies = [{"abort_all": True}]
        else:
            bodies = [{"rid": lv.rid} for lv in lives if lv.rid]
        if not bodies:
            return

        async def send() -> None:
            calls = []
            for body in bodies:
                targets = up
                if "rid" in body:
                    owner = next((lv.server for lv in lives if lv.rid == body["rid"]), None)
                    targets = [owner] if owner is not None else up
                calls += [
                    self._client.post(s.url, "/abort_request", body, timeout=30) for s in targets
                ]
            await asyncio.gather(*calls, return_exceptions=True)

        await send()
        # A request still in transit to the server when the abort arrived is unknown there;
        # repeat the abort shortly for the ones still running.
        pending = [lv for lv in lives if lv.rid]

        async def again() -> None:
            for delay in (0.1, 0.4):
                await asyncio.sleep(delay)
                still = [lv for lv in pending if lv.request_id in self._live]
                if not still:
                    return
                await asyncio.gather(
                    *(
                        self._client.post(s.url, "/abort_request", {"rid": lv.rid}, timeout=30)
                        for lv in still
                        for s in ([lv.server] if lv.server else up)
                    ),
                    return_exceptions=True,
                )

        if pending:
            task = asyncio.ensure_future(again())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
