"""The rollout buffer: a FIFO of scored groups with staleness control and partial rollouts.

Every rollout carries the policy version of each response token (``Rollout.versions``).
``take(n, min_version=v)`` never returns a group with a token older than ``v``; with
``max_staleness=s`` and ``take(n, policy_version=p)`` the bound is ``p - s``. Stale groups met by
``take`` are dropped (counted) or recycled (their prompts handed back via
:meth:`~GroupBuffer.pop_recycled` for regeneration), per ``on_stale``.

Partial rollouts (aborted at a weight update) are kept apart with their tokens, log-probs and
versions (:meth:`GroupBuffer.put_partial` / :meth:`GroupBuffer.take_partial`); the generator
continues them on the new weights and puts the finished group back with :meth:`GroupBuffer.put`.
``mask_offpolicy_tokens`` zeroes the loss mask of tokens sampled by an older policy than the one
that finished the rollout. Everything, partial rollouts included, is in
:meth:`~GroupBuffer.state_dict`::

    buf = GroupBuffer(GroupBuffer.Config(max_staleness=1, on_stale="drop"))
    buf.put(groups)                                  # scored groups from the generator
    batch = buf.take(32, policy_version=policy.version)   # None until 32 fresh groups exist
    buf.put_partial(aborted_groups)                  # at a weight update
    to_resume = buf.take_partial()                   # next rollout step: continue these
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from rl_core.config import NonNegInt, PositiveInt
from rl_core.errors import CheckpointError, ConfigError
from rl_core.interfaces import Buffer
from rl_core.serde import group_from_dict, group_to_dict, prompt_from_dict, prompt_to_dict
from rl_core.types import Group, Prompt, RolloutStatus

__all__ = ["GroupBuffer"]

logger = logging.getLogger(__name__)

_STATE_FORMAT = 1


def _routing_bytes(groups: Sequence[Group] | deque[Group]) -> int:
    """Bytes of the ``routed_experts`` tensors of the rollouts of ``groups``."""
    return sum(
        r.routed_experts.numel() * r.routed_experts.element_size()
        for g in groups
        for r in g.rollouts
        if r.routed_experts is not None
    )


class GroupBuffer(Buffer):
    """FIFO of scored groups; see the module docstring."""

    supports_partial: ClassVar[bool] = True
    """Has ``put_partial`` / ``take_partial``."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Options of :class:`GroupBuffer`."""

        max_staleness: NonNegInt | None = None
        """With ``take(policy_version=p)``, return only groups whose oldest token is from version
        ``p - max_staleness`` or newer (0: strictly on-policy). ``None``: no bound from the policy
        version (an explicit ``min_version`` still applies)."""
        on_stale: Literal["drop", "recycle"] = "drop"
        """What ``take`` does with a stale group: ``drop`` it (counted in ``stale_dropped``), or
        ``recycle`` its prompt (returned by :meth:`GroupBuffer.pop_recycled` for regeneration)."""
        mask_offpolicy_tokens: bool = False
        """On ``take``, zero ``loss_mask`` on response tokens whose version is older than the
        newest version in the same rollout (the tokens generated before a partial rollout was
        resumed)."""
        max_groups: PositiveInt | None = None
        """Cap on stored trainable groups; ``put`` beyond it drops the oldest (counted). ``None``:
        unbounded."""
        max_routing_bytes: PositiveInt | None = None
        """Budget, in bytes, for the expert routing the held rollouts carry
        (``Rollout.routed_experts``, trainable and partial groups together). A ``put`` or
        ``put_partial`` that would exceed it is refused with a ``ConfigError`` before anything
        is stored, so routing replay can never grow host memory past it. ``None``: no budget."""

        def __post_init__(self) -> None:
            if self.max_staleness is not None and self.max_staleness < 0:
                raise ConfigError(
                    f"buffer.max_staleness: must be >= 0 or None, got {self.max_staleness}."
                )
            if self.on_stale not in ("drop", "recycle"):
                raise ConfigError(
                    f"buffer.on_stale: {self.on_stale!r}; expected 'drop' or 'recycle'."
                )
            if self.max_routing_bytes is not None and self.max_routing_bytes < 1:
                raise ConfigError(
                    f"buffer.max_routing_bytes: must be >= 1 or None, got {self.max_routing_bytes}."
                )
            if self.max_groups is not None and self.max_groups < 1:
                raise ConfigError(
                    f"buffer.max_groups: must be >= 1 or None, got {self.max_groups}."
                )

    def __init__(self, config: GroupBuffer.Config | None = None) -> None:
        self.config = config or GroupBuffer.Config()
        self._groups: deque[Group] = deque()
        self._partial: deque[Group] = deque()
        self._recycled: deque[Prompt] = deque()
        self.counters: Counter[str] = Counter()
        """Running counts: ``put``, ``taken``, ``stale_dropped``, ``stale_recycled``,
        ``overflow_dropped``, ``partial_put``, ``partial_taken``, ``masked_offpolicy_tokens``."""

    # -- trainable groups ------------------------------------------------------------------

    def routing_bytes(self) -> int:
        """Bytes of expert routing held (trainable and partial groups)."""
        return _routing_bytes(self._groups) + _routing_bytes(self._partial)

    def _check_routing_budget(self, groups: Sequence[Group], where: str) -> None:
        """Refuse ``groups`` if their routing would take the buffer past its budget."""
        budget = self.config.max_routing_bytes
        if budget is None:
            return
        incoming = _routing_bytes(groups)
        if not incoming:
            return
        held = self.routing_bytes()
        if held + incoming > budget:
            tokens = sum(len(r.tokens) for g in groups for r in g.rollouts)
            raise ConfigError(
                f"buffer.max_routing_bytes: {where} of {len(groups)} groups would hold "
                f"{held + incoming} bytes of expert routing ({held} held + {incoming} for "
                f"{tokens} tokens, {incoming / max(tokens, 1):.0f} bytes/token) over the budget "
                f"of {budget}. Raise buffer.max_routing_bytes, keep fewer groups in flight "
                "(rollout.prompts_per_step, rl.max_staleness, buffer.max_groups), or set "
                "rollout.routing_replay: off."
            )

    def put(self, groups: Sequence[Group]) -> None:
        """Append scored groups (any rollout status; filters decide what is trained on).

        Raises:
            ConfigError: their routing would exceed ``max_routing_bytes`` (nothing stored).
        """
        self._check_routing_budget(groups, "put")
        self._groups.extend(groups)
        self.counters["put"] += len(groups)
        cap = self.config.max_groups
        while cap is not None and len(self._groups) > cap:
            self._groups.popleft()
            self.counters["overflow_dropped"] += 1

    def min_version_for(self, policy_version: int | None) -> int | None:
        """The oldest acceptable token version for a policy at ``policy_version``."""
        if policy_version is None or self.config.max_staleness is None:
            return None
        return policy_version - self.config.max_staleness

    def _is_stale(self, g: Group, bound: int | None) -> bool:
        if bound is None:
            return False
        v = g.min_version
        return v is not None and v < bound

    def take(
        self, n: int, *, min_version: int | None = None, policy_version: int | None = None
    ) -> list[Group] | None:
        """Remove and return the ``n`` oldest fresh groups, or ``None`` if fewer exist.

        A group is fresh when its oldest token version is at least ``min_version`` and at least
        ``policy_version - max_staleness`` (when both are given). Stale groups are purged
        as they are met, whatever the outcome (dropped or recycled per ``on_stale``); fresh groups
        are only removed when ``n`` of them can be returned.
        """
        if n < 0:
            raise ValueError(f"take: n must be >= 0, got {n}.")
        bounds = [b for b in (min_version, self.min_version_for(policy_version)) if b is not None]
        bound = max(bounds) if bounds else None
        if bound is not None and any(self._is_stale(g, bound) for g in self._groups):
            kept: deque[Group] = deque()
            for g in self._groups:
                if self._is_stale(g, bound):
                    self._discard_stale(g)
                else:
                    kept.append(g)
            self._groups = kept
        if len(self._groups) < n:
            return None
        out = [self._groups.popleft() for _ in range(n)]
        self.counters["taken"] += n
        if self.config.mask_offpolicy_tokens:
            out = [self._mask_offpolicy(g) for g in out]
        return out

    def _discard_stale(self, g: Group) -> None:
        if self.config.on_stale == "recycle":
            self._recycled.append(g.prompt)
            self.counters["stale_recycled"] += 1
        else:
            self.counters["stale_dropped"] += 1

    def _mask_offpolicy(self, g: Group) -> Group:
        rollouts = []
        for r in g.rollouts:
            if not r.versions or min(r.versions) == max(r.versions):
                rollouts.append(r)
                continue
            newest = max(r.versions)
            mask = tuple(m if v == newest else 0 for m, v in zip(r.loss_mask, r.versions))
            self.counters["masked_offpolicy_tokens"] += sum(
                1 for m, v in zip(r.loss_mask, r.versions) if m and v != newest
            )
            rollouts.append(dataclasses.replace(r, loss_mask=mask))
        return Group(prompt=g.prompt, rollouts=rollouts)

    def __len__(self) -> int:
        """Trainable groups held (stale ones not yet purged included; partials excluded)."""
        return len(self._groups)

    def pop_recycled(self) -> list[Prompt]:
        """Prompts of stale groups recycled by ``take`` (``on_stale="recycle"``); generate them
        again. Returns and clears the list."""
        out = list(self._recycled)
        self._recycled.clear()
        return out

    # -- partial rollouts ------------------------------------------------------------------

    def put_partial(self, groups: Sequence[Group]) -> None:
        """Store groups with aborted rollouts (tokens, log-probs and versions so far) to resume.

        A group may mix finished and aborted rollouts; the generator resumes the aborted ones.

        Raises:
            ConfigError: their routing would exceed ``max_routing_bytes`` (nothing stored).
        """
        self._check_routing_budget(groups, "put_partial")
        for g in groups:
            if not any(r.status == RolloutStatus.ABORTED for r in g.rollouts):
                logger.debug("put_partial: group %s has no aborted rollout", g.uid)
        self._partial.extend(groups)
        self.counters["partial_put"] += len(groups)

    def take_partial(self, n: int | None = None) -> list[Group]:
        """Remove and return up to ``n`` (default all) partial groups, oldest first."""
        k = len(self._partial) if n is None else min(n, len(self._partial))
        out = [self._partial.popleft() for _ in range(k)]
        self.counters["partial_taken"] += k
        return out

    @property
    def num_partial(self) -> int:
        """Partial groups waiting to be resumed."""
        return len(self._partial)

    # -- metrics and state -----------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        """Metrics under ``buffer/*``: sizes and the running counters."""
        out = {
            "buffer/groups": float(len(self._groups)),
            "buffer/partial_groups": float(len(self._partial)),
            "buffer/recycled_prompts": float(len(self._recycled)),
            "buffer/routing_bytes": float(self.routing_bytes()),
        }
        out.update({f"buffer/{k}": float(v) for k, v in self.counters.items()})
        return out

    def state_dict(self) -> dict[str, Any]:
        """Groups, partial groups, recycled prompts and counters, as plain data."""
        return {
            "format": _STATE_FORMAT,
            "groups": [group_to_dict(g) for g in self._groups],
            "partial": [group_to_dict(g) for g in self._partial],
            "recycled": [prompt_to_dict(p) for p in self._recycled],
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents with ``state`` (from :meth:`state_dict`)."""
        if state.get("format") != _STATE_FORMAT or "groups" not in state:
            raise CheckpointError(
                f"GroupBuffer: state format {state.get('format')!r} (keys {sorted(state)}) is not "
                f"a GroupBuffer state of format {_STATE_FORMAT}."
            )
        self._groups = deque(group_from_dict(d) for d in state["groups"])
        self._partial = deque(group_from_dict(d) for d in state.get("partial", []))
        self._recycled = deque(prompt_from_dict(d) for d in state.get("recycled", []))
        self.counters = Counter({k: int(v) for k, v in state.get("counters", {}).items()})
