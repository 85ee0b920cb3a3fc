"""The collective weight-sync group of the ``ray`` runtime (``weight_transport.type=broadcast``).

Policy rank 0 (the sender, rank 0 of the group) and every generator engine (ranks 1..M) form
one :class:`~rl_weightsync.BroadcastTransport` world. Its address comes from Ray: policy rank 0
reports its node's IP and a free port (:meth:`PolicyRank.address`); ``host``, ``port``,
``rank``, ``world_size`` and ``group_name`` of the recipe are replaced. A group is one fixed
world, so when an engine is restarted (or a member fails a transfer) the pool forms a new
*generation* of the group, with a fresh port and group name::

    group = CollectiveGroup(runtime.ranks[0], spec, tag="rl-1234abcd")
    versions = await group.form(engines)      # generation 1; again after every restart

The new sender takes over the old one (:meth:`~rl_weightsync.BroadcastTransport.take_over`): the
newest published version is posted again on the new group, every member joins it (the restarted
engine applies it, the others discard it: :meth:`GeneratorEngine.resync`), and the run goes on
without restarting the trainer. Members that are dead cannot hang the others: a receiver gives up
after the transport's ``timeout_s`` and a closed receiver (its group re-formed) stops waiting at
once.

With a model-parallel policy (Megatron TP/PP, several policy ranks), every rank iterates
``named_weights`` (the collective gathers run once per weight) and only rank 0 feeds the
transport: each weight is gathered once and broadcast once, from rank 0
(:meth:`PolicyRank.publish`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import RLError

__all__ = ["CollectiveGroup", "is_collective"]


def is_collective(spec: ComponentSpec) -> bool:
    """Whether ``spec``'s transport is the collective ``broadcast`` (a group, not files)."""
    cls = registry.resolve(
        registry.GROUPS["weight_transport"], spec.type, field="weight_transport.type"
    )
    return cls.__module__ == "rl_weightsync.broadcast"


class CollectiveGroup:
    """Forms (and re-forms) the broadcast group of policy rank 0 and the engines.

    ``sender`` is policy rank 0's actor, ``spec`` the transport's spec (bucket size, dtype,
    device, timeout are taken from it), ``tag`` the run's unique prefix for group names.
    """

    def __init__(self, sender: Any, spec: ComponentSpec, tag: str) -> None:
        self.sender = sender
        self.spec = spec
        self.tag = tag
        self.generation = 0
        """Groups formed so far (1 after the first :meth:`form`)."""
        self._lock = asyncio.Lock()

    def member_spec(self, host: str, port: int, world_size: int, rank: int) -> ComponentSpec:
        """The transport spec of ``rank`` in the current generation."""
        return ComponentSpec(
            type=self.spec.type,
            options={
                **self.spec.options,
                "host": host,
                "port": port,
                "world_size": world_size,
                "rank": rank,
                "group_name": f"{self.tag}/g{self.generation}",
            },
        )

    async def form(self, engines: list[Any]) -> list[Any]:
        """Form a new generation of the group over ``engines`` (ranks 1..len) and re-sync them
        to the newest published version. Returns, per engine, the version it serves after the
        re-sync, or the exception its re-sync raised (``None`` for all when nothing was
        published yet: the engines serve their initial weights)."""
        async with self._lock:
            self.generation += 1
            host, port = await self.sender.address.remote()
            world = len(engines) + 1
            update = await self.sender.reform_sender.remote(self.member_spec(host, port, world, 0))
            await asyncio.gather(
                *(
                    e.set_receiver.remote(self.member_spec(host, port, world, i + 1), True)
                    for i, e in enumerate(engines)
                )
            )
            if update is None:
                return [None] * len(engines)
            tasks = [asyncio.ensure_future(_await(e.resync.remote(update))) for e in engines]
            # The first failure ends the wait: the others are waiting for a member that will
            # never join, and the caller's next generation releases them (closed receivers).
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            out: list[Any] = []
            for t in tasks:
                if t.done():
                    out.append(t.exception() or t.result())
                else:
                    t.add_done_callback(_drop_result)
                    out.append(RLError("re-sync interrupted: another member of the group failed"))
            return out


async def _await(ref: Any) -> Any:
    return await ref


def _drop_result(task: asyncio.Future[Any]) -> None:
    """Retrieve an abandoned re-sync's outcome (it ends when its group is re-formed)."""
    if not task.cancelled():
        task.exception()
