"""Weights from the trainer into SGLang servers over a collective group (gloo on CPU, NCCL on GPU).

SGLang joins a weight-update group through ``/init_weights_update_group`` and receives tensors
through ``/update_weights_from_distributed`` (one ``broadcast(src=0)`` per tensor, in the order
the call names them). The trainer is rank 0 of that group. SGLang builds its side with its own
``init_custom_process_group``: a TCP rendezvous whose store is wrapped in
``PrefixStore(group_name)``, so a plain ``torch.distributed.init_process_group`` never meets it.
:func:`init_custom_process_group` rebuilds exactly that on the trainer side without importing
sglang (the trainer's environment does not have it)::

    transport = SGLangCollectiveTransport(SGLangCollectiveTransport.Config(backend="gloo"))
    update = transport.publish(3, policy.named_weights())   # stages a CPU copy
    await generator.update_weights(update, transport)        # group, begin, broadcast, end

The generator (:class:`~rl_sglang.generator.SGLangGenerator`) drives the HTTP side and calls
:meth:`SGLangCollectiveTransport.push`; the group is (re)built whenever the set of servers
changes (a restarted server joins a new group). Other targets (e.g. the reference generator in
the same process) get the staged tensors through :meth:`~SGLangCollectiveTransport.receive`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch

from rl_core.config import Port, PositiveFloat
from rl_core.errors import ConfigError, WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.types import WeightUpdate
from rl_sglang._http import Server, ServerClient

__all__ = ["SGLangCollectiveTransport", "init_custom_process_group"]

log = logging.getLogger(__name__)


def _shutdown_group(pg: Any, name: str) -> None:
    """Shut down a weight-update process group being dropped; a failure is logged, not raised
    (the group is discarded either way and rebuilt on the next update)."""
    try:
        pg.shutdown()
    except Exception as e:
        log.warning(
            "SGLangCollectiveTransport: shutting down weight-update group %r failed (%s: %s); "
            "it is dropped anyway.",
            name,
            type(e).__name__,
            e,
        )


def init_custom_process_group(
    *,
    backend: str,
    init_method: str,
    world_size: int,
    rank: int,
    group_name: str,
    timeout: timedelta,
) -> Any:
    """A process group that rendezvouses with SGLang's ``init_custom_process_group``.

    TCP rendezvous on ``init_method``, store wrapped in ``PrefixStore(group_name)``, group built
    with torch's ``_new_process_group_helper`` (not the default group, so a trainer's own
    ``torch.distributed`` world is untouched).
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    params = inspect.signature(_new_process_group_helper).parameters
    options = "backend_options" if "backend_options" in params else "pg_options"
    pg, _ = _new_process_group_helper(
        world_size,
        rank,
        [],
        Backend(backend),
        store,
        group_name=group_name,
        timeout=timeout,
        **{options: None},
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class SGLangCollectiveTransport(WeightTransport):
    """Trainer-side collective broadcast into SGLang servers (rank 0 of SGLang's update group)."""

    name: ClassVar[str] = "sglang_collective"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`SGLangCollectiveTransport`."""

        backend: str = "gloo"
        """``gloo`` (CPU tensors) or ``nccl`` (GPU)."""
        master_address: str = "127.0.0.1"
        """Address of this (trainer) process as the servers reach it."""
        port: Port = 0
        """Rendezvous port; 0 picks a free one for each group."""
        group_name: str = "rl_weight_update"
        """Prefix of the group names (a counter is appended per group)."""
        device: str = "cpu"
        """Device of the broadcast tensors (``cuda`` with NCCL)."""
        timeout_s: PositiveFloat = 300.0
        """Rendezvous and collective timeout."""

        def __post_init__(self) -> None:
            if self.backend not in ("gloo", "nccl"):
                raise ConfigError(
                    f"SGLangCollectiveTransport.Config.backend: {self.backend!r}; use 'gloo' or "
                    "'nccl'."
                )

    def __init__(self, config: SGLangCollectiveTransport.Config | None = None) -> None:
        """Build from ``config``; the group is made lazily on the first push."""
        self.config = config or SGLangCollectiveTransport.Config()
        self._staged: tuple[int, list[tuple[str, torch.Tensor]]] | None = None
        self._pg: Any = None
        self._members: tuple[str, ...] = ()
        self._group_name = ""
        self._groups_made = 0
        self._lock = threading.Lock()

    # -- sender ---------------------------------------------------------------------------------

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Stage a copy of the weights of ``version`` (above the last one) for the next push."""
        with self._lock:
            if self._staged is not None and version <= self._staged[0]:
                raise WeightSyncError(
                    f"SGLangCollectiveTransport.publish: version {version} is not above the last "
                    f"published version {self._staged[0]}; publish increasing versions."
                )
            dev = self.config.device
            tensors = [(n, t.detach().to(dev).contiguous().clone()) for n, t in named_tensors]
            self._staged = (version, tensors)
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=f"collective:{self.config.group_name}",
            metadata={**(metadata or {}), "num_tensors": len(tensors)},
        )

    def staged(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """The staged tensors of ``version`` (the last published one)."""
        with self._lock:
            if self._staged is None or self._staged[0] != version:
                have = None if self._staged is None else self._staged[0]
                raise WeightSyncError(
                    f"SGLangCollectiveTransport: version {version} is not staged (last published: "
                    f"{have}); apply the newest update."
                )
            return list(self._staged[1])

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The staged tensors, for an in-process target that is not an SGLang generator."""
        if update.version <= current_version:
            raise WeightSyncError(
                f"SGLangCollectiveTransport.receive: version {update.version} is not above the "
                f"receiver's {current_version} (replayed or out of order)."
            )
        return iter(self.staged(update.version))

    # -- the group ------------------------------------------------------------------------------

    async def _regroup(self, servers: Sequence[Server], client: ServerClient) -> None:
        """Build a fresh group of this process (rank 0) and ``servers`` (ranks 1..N)."""
        from rl_sglang.server import free_port

        await self._drop_group(servers, client)
        c = self.config
        self._groups_made += 1
        name = f"{c.group_name}-{self._groups_made}"
        port = c.port or free_port(c.master_address)
        world = 1 + len(servers)
        timeout = timedelta(seconds=c.timeout_s)

        def local() -> Any:
            return init_custom_process_group(
                backend=c.backend,
                init_method=f"tcp://{c.master_address}:{port}",
                world_size=world,
                rank=0,
                group_name=name,
                timeout=timeout,
            )

        calls = [
            client.control(
                s,
                "/init_weights_update_group",
                {
                    "master_address": c.master_address,
                    "master_port": port,
                    "rank_offset": 1 + i,
                    "world_size": world,
                    "group_name": name,
                    "backend": c.backend,
                },
            )
            for i, s in enumerate(servers)
        ]
        results = await asyncio.gather(asyncio.to_thread(local), *calls, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError(
                f"SGLangCollectiveTransport: building group {name!r} on port {port} failed: "
                f"{errors[0]!r}"
            ) from errors[0]
        self._pg = results[0]
        self._group_name = name
        self._members = tuple(s.url for s in servers)

    async def _drop_group(self, servers: Sequence[Server], client: ServerClient) -> None:
        if self._pg is None:
            return
        still = [s for s in servers if s.url in self._members]
        await asyncio.gather(
            *(
                client.post(
                    s.url, "/destroy_weights_update_group", {"group_name": self._group_name}
                )
                for s in still
            ),
            return_exceptions=True,
        )
        _shutdown_group(self._pg, self._group_name)
        self._pg = None
        self._members = ()

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        import torch.distributed as dist

        for _, t in tensors:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            opts.rootTensor = 0
            self._pg.broadcast([t], opts).wait()

    async def push(
        self, update: WeightUpdate, servers: Sequence[Server], client: ServerClient
    ) -> None:
        """Broadcast the staged ``update`` into ``servers`` over their HTTP ``client`` (called by
        the SGLang generator's weight updater).

        Builds the group if the servers changed, then per server ``/begin_weight_update``,
        ``/update_weights_from_distributed`` (while this process broadcasts), ``/end_weight_update``.
        """
        if update.transport != self.name:
            raise WeightSyncError(
                f"SGLangCollectiveTransport: update made by {update.transport!r}; pass it to the "
                "transport that published it."
            )
        tensors = self.staged(update.version)
        if tuple(s.url for s in servers) != self._members:
            await self._regroup(servers, client)
        body = {
            "names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors],
            "group_name": self._group_name,
            "weight_version": str(update.version),
            "flush_cache": True,
        }
        await asyncio.gather(*(client.control(s, "/begin_weight_update", {}) for s in servers))
        try:
            results = await asyncio.gather(
                asyncio.to_thread(self._broadcast, tensors),
                *(client.control(s, "/update_weights_from_distributed", body) for s in servers),
                return_exceptions=True,
            )
        finally:
            await asyncio.gather(
                *(client.control(s, "/end_weight_update", {}) for s in servers),
                return_exceptions=True,
            )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # The group may be left mid-collective: rebuild it next time.
            await self._drop_group(servers, client)
            raise WeightSyncError(
                f"SGLangCollectiveTransport: weight version {update.version} failed: {errors[0]!r}"
            ) from errors[0]

    def close(self) -> None:
        """Forget the group and the staged weights."""
        if self._pg is not None:
            _shutdown_group(self._pg, self._group_name)
        self._pg = None
        self._members = ()
        self._staged = None
