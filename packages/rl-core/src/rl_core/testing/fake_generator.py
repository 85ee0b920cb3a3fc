"""A fake :class:`~rl_core.interfaces.Generator` (a bigram table, pure torch) and an in-memory
:class:`~rl_core.interfaces.WeightTransport`.

:class:`FakeGenerator` passes :class:`~rl_core.testing.generator.GeneratorConformance` and serves
as a fast stand-in for other components' tests; :class:`InMemoryTransport` is the suite's default
transport. Both are also importable from :mod:`rl_core.testing.generator`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch

from rl_core.config import NonNegFloat, Range, Seed
from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    WeightUpdate,
)

__all__ = ["FakeGenerator", "InMemoryTransport"]

# ----------------------------------------------------------------------------------------------
# In-memory weight transport
# ----------------------------------------------------------------------------------------------


class InMemoryTransport(WeightTransport):
    """A :class:`~rl_core.interfaces.WeightTransport` inside one process: a dict version → tensors.

    ``publish`` copies the tensors (the trainer keeps training the originals) and refuses a version
    not above the last one; ``receive`` refuses a version at or below the receiver's and one never
    published (or already evicted), with :class:`~rl_core.errors.WeightSyncError`. Only the
    ``keep`` newest versions are held. Full updates only (no deltas, no checksums).
    """

    name: ClassVar[str] = "memory"
    """Registry name copied into every :class:`~rl_core.types.WeightUpdate`."""

    def __init__(self, *, keep: int = 2) -> None:
        """Hold at most ``keep`` published versions."""
        if keep < 1:
            raise ConfigError(f"InMemoryTransport.keep: must be >= 1, got {keep}.")
        self.keep = keep
        """Number of newest versions kept."""
        self._store: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._last: int | None = None
        self._lock = threading.Lock()

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Copy ``named_tensors`` as ``version`` (must be above the last published version)."""
        with self._lock:
            if self._last is not None and version <= self._last:
                raise WeightSyncError(
                    f"InMemoryTransport.publish: version {version} is not above the last "
                    f"published version {self._last}; publish increasing versions."
                )
            self._store[version] = [(n, t.detach().clone()) for n, t in named_tensors]
            self._last = version
            for old in sorted(self._store)[: -self.keep]:
                del self._store[old]
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=f"memory:{id(self)}",
            metadata=dict(metadata or {}),
        )

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The stored tensors of ``update`` (not copies: do not modify them).

        Raises :class:`~rl_core.errors.WeightSyncError` at once for a replayed, out-of-order or
        unknown version.
        """
        if update.version <= current_version:
            raise WeightSyncError(
                f"InMemoryTransport.receive: update version {update.version} is not above the "
                f"receiver's version {current_version} (replayed or out of order); publish a newer "
                "version."
            )
        with self._lock:
            tensors = self._store.get(update.version)
        if tensors is None:
            raise WeightSyncError(
                f"InMemoryTransport.receive: version {update.version} was never published here or "
                f"was evicted (kept: {sorted(self._store)}); raise `keep` or apply updates sooner."
            )
        return iter(list(tensors))


# ----------------------------------------------------------------------------------------------
# Fake generator
# ----------------------------------------------------------------------------------------------


class FakeGenerator(Generator):
    """A bigram language model as a generator: next-token logits are ``table[last_token]``.

    Pure torch, no model files; honours temperature (0 = greedy), top-k, top-p, max_new_tokens,
    stop ids (``eos_token_id`` is a default stop id) and seeds (a ``torch.Generator`` per
    request, so a seeded request gives the same tokens in any batch). Log-probs are
    ``log_softmax(table[last] / T)`` of the sampled token (``T = 1`` for greedy), before
    truncation. :meth:`load_weights` takes ``{"table": [V, V]}``. Supports abort and pause.
    """

    supports_abort: ClassVar[bool] = True
    """:meth:`abort` ends running requests at their next token."""
    supports_pause: ClassVar[bool] = True
    """:meth:`pause` holds calls that have not started until :meth:`resume`."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`FakeGenerator`."""

        vocab_size: Annotated[int, Range(ge=2)] = 64
        """Number of token ids."""
        seed: Seed = 0
        """Seed of the random table and of the seeds of unseeded requests."""
        scale: NonNegFloat = 2.0
        """Standard deviation of the table's logits (larger = more peaked)."""
        eos_token_id: int | None = None
        """Default stop id; ``None`` means ``vocab_size - 1``. Use -1 for none."""
        eos_logit_offset: float = -4.0
        """Added to the EOS column of the table, so responses are usually long (abort tests)."""
        step_delay_s: NonNegFloat = 0.0
        """Sleep per generated token, to simulate a slow engine in tests."""

        def __post_init__(self) -> None:
            if self.vocab_size < 2:
                raise ConfigError(
                    f"FakeGenerator.Config.vocab_size: must be >= 2, got {self.vocab_size}."
                )

    def __init__(self, config: FakeGenerator.Config | None = None) -> None:
        """Build the random table from ``config.seed``."""
        self.config = config or FakeGenerator.Config()
        c = self.config
        self.vocab_size: int = c.vocab_size
        """Number of token ids."""
        eos = c.vocab_size - 1 if c.eos_token_id is None else c.eos_token_id
        self.default_stop_ids: tuple[int, ...] = (eos,) if 0 <= eos < c.vocab_size else ()
        """Stop ids added to every request's own ``stop_token_ids``."""
        self.tokenizer: Any = None
        """No tokenizer: the fake works on ids only."""
        gen = torch.Generator().manual_seed(c.seed)
        table_VV = torch.randn(c.vocab_size, c.vocab_size, generator=gen) * c.scale
        for s in self.default_stop_ids:
            table_VV[:, s] += c.eos_logit_offset
        self.table = table_VV
        """``[V, V]`` float32 next-token logits by previous token."""
        self._version = 0
        self._seed_rng = random.Random(c.seed)
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._unpaused = threading.Event()
        self._unpaused.set()

    @property
    def weight_version(self) -> int:
        """Version of the table currently served."""
        return self._version

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Sample each request from the bigram table, in a worker thread."""
        seeds = []
        for r in requests:
            if not r.input_ids or min(r.input_ids) < 0 or max(r.input_ids) >= self.vocab_size:
                raise GenerationError(
                    f"FakeGenerator.generate: request {r.request_id!r} needs 1+ token ids in "
                    f"[0, {self.vocab_size})."
                )
            seeds.append(
                r.sampling.seed if r.sampling.seed is not None else self._seed_rng.getrandbits(63)
            )
        with self._lock:
            table, version = self.table, self._version
            self._running |= {r.request_id for r in requests}
        # A thread per call (not the shared executor): concurrent calls all make progress.
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[GenerationResult]] = loop.create_future()

        def work() -> None:
            self._unpaused.wait()
            try:
                res = self._generate(list(requests), seeds, table, version)
                done: tuple[Any, ...] = (_set_result, fut, res)
            except Exception as e:
                done = (_set_exception, fut, e)
            with contextlib.suppress(RuntimeError):  # the caller's loop may have closed
                loop.call_soon_threadsafe(*done)

        threading.Thread(target=work, name="FakeGenerator", daemon=True).start()
        return await fut

    def _generate(
        self,
        requests: list[GenerationRequest],
        seeds: list[int],
        table_VV: torch.Tensor,
        version: int,
    ) -> list[GenerationResult]:
        out = []
        try:
            for r, seed in zip(requests, seeds):
                out.append(self._one(r, seed, table_VV, version))
        finally:
            with self._lock:
                for r in requests:
                    self._running.discard(r.request_id)
                    self._aborted.discard(r.request_id)
        return out

    def _one(
        self, req: GenerationRequest, seed: int, table_VV: torch.Tensor, version: int
    ) -> GenerationResult:
        s = req.sampling
        gen = torch.Generator().manual_seed(seed)
        stops = set(s.stop_token_ids) | set(self.default_stop_ids)
        last = req.input_ids[-1]
        ids: list[int] = []
        lps: list[float] = []
        reason = FinishReason.LENGTH
        for _ in range(s.max_new_tokens):
            if req.request_id in self._aborted:
                reason = FinishReason.ABORT
                break
            if self.config.step_delay_s:
                threading.Event().wait(self.config.step_delay_s)
            logits_V = table_VV[last]
            temp = s.temperature if s.temperature > 0 else 1.0
            logp_V = torch.log_softmax(logits_V / temp, -1)
            if s.temperature == 0:
                tok = int(logits_V.argmax())
            else:
                probs_V = _truncate(logp_V.exp(), top_k=s.top_k, top_p=s.top_p)
                tok = int(torch.multinomial(probs_V, 1, generator=gen))
            ids.append(tok)
            lps.append(float(logp_V[tok]))
            last = tok
            if tok in stops:
                reason = FinishReason.STOP
                break
        return GenerationResult(
            request_id=req.request_id,
            output_ids=tuple(ids),
            output_logprobs=tuple(lps),
            finish_reason=reason,
            weight_version=version,
        )

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """End the given (or all) running requests at their next token with ``ABORT``."""
        with self._lock:
            ids = self._running if request_ids is None else set(request_ids) & self._running
            self._aborted |= ids

    async def pause(self) -> None:
        """Hold calls that have not started sampling until :meth:`resume`."""
        self._unpaused.clear()

    async def resume(self) -> None:
        """Release the calls held by :meth:`pause`."""
        self._unpaused.set()

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """``transport.apply(update, self)`` in a worker thread."""
        await asyncio.to_thread(transport.apply, update, self)

    async def close(self) -> None:
        """Abort running calls and release paused ones (they return ABORT at once)."""
        await self.abort()
        self._unpaused.set()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Take ``{"table": [V, V]}`` and set ``version``; other names or shapes are refused."""
        new = None
        for name, t in named_tensors:
            if name != "table" or tuple(t.shape) != tuple(self.table.shape):
                raise WeightSyncError(
                    f"FakeGenerator.load_weights: got {name!r} {tuple(t.shape)}; expected 'table' "
                    f"{tuple(self.table.shape)}."
                )
            new = t.detach().to(torch.float32).clone()
        with self._lock:
            if new is not None:
                self.table = new
            self._version = int(version)

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The table under its name ``"table"``."""
        yield "table", self.table

    def teacher_forced_logprobs(
        self, input_ids: Sequence[int], output_ids: Sequence[int], temperature: float
    ) -> torch.Tensor:
        """``[R, V]`` log-softmax of ``table / T`` at each output position (``T = 1`` for 0)."""
        prev = [input_ids[-1], *output_ids[:-1]]
        t = temperature if temperature > 0 else 1.0
        return torch.log_softmax(self.table[torch.tensor(prev, dtype=torch.long)] / t, -1)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future[Any], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)


def _truncate(probs_V: torch.Tensor, *, top_k: int, top_p: float) -> torch.Tensor:
    """Zero the tokens outside top-k, then outside top-p of the renormalised rest."""
    sorted_V, order_V = probs_V.sort(descending=True)
    if top_k > 0:
        sorted_V = torch.where(torch.arange(sorted_V.shape[0]) < top_k, sorted_V, 0.0)
    if top_p < 1:
        cum_V = sorted_V.cumsum(0)
        before_V = (cum_V - sorted_V) / cum_V[-1]
        sorted_V = torch.where(before_V < top_p, sorted_V, 0.0)
    return torch.zeros_like(probs_V).scatter(0, order_V, sorted_V)
