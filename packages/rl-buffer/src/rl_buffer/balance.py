"""FLOPs-balanced data-parallel split of one optimizer step, then micro-batch packing.

Balance first, pack second. slime packs micro-batches first and then hands whole micro-batches to
ranks (Karmarkar-Karp over bins), which is coarse when each rank gets only a few micro-batches.
Here samples (or fan-out units: all samples sharing a ``rollout_id``) are assigned to ranks so
every rank gets the same estimated FLOPs as nearly as possible (LPT greedy, Karmarkar-Karp for
small steps, then a move/swap local search on the most loaded rank). Each rank's samples are then
packed into micro-batches of at most ``max_tokens_per_micro_batch`` tokens (a single longer
sample gets a micro-batch of its own, with a warning), and every rank gets the same number of
micro-batches (pipeline parallelism needs it), token-balanced inside the rank::

    plan = schedule_step([len(r.tokens) for r in rollouts], dp_size=8,
                         max_tokens_per_micro_batch=16384, shape=policy.model_shape,
                         rollout_ids=[r.rollout_id for r in rollouts])
    for rank in range(8):
        for mb in plan.micro_batches[rank]:      # sample indices of one micro-batch
            ...
    plan.imbalance                               # most loaded rank / lower bound, >= 1

Pure Python and numpy; usable without the rest of the framework.
"""

from __future__ import annotations

import contextlib
import gc
import heapq
import logging
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from rl_buffer.flops import estimate_flops_array
from rl_core.errors import ConfigError
from rl_core.types import ModelShape, Rollout

__all__ = [
    "SchedulePlan",
    "karmarkar_karp_partition",
    "lpt_partition",
    "pack_micro_batches",
    "schedule_step",
    "split_steps",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SchedulePlan:
    """The data-parallel split and micro-batch plan of one optimizer step."""

    micro_batches: tuple[tuple[tuple[int, ...], ...], ...]
    """``[dp][m]``: sample indices (into the scheduled list) of micro-batch ``m`` of each rank.
    Every rank has the same number of micro-batches."""
    flops_per_rank: tuple[float, ...]
    """``[dp]`` estimated FLOPs (or the balanced cost) of each rank."""
    tokens_per_rank: tuple[int, ...]
    """``[dp]`` tokens of each rank."""
    lower_bound: float
    """``max(total / dp, largest unit)``: no split can put less on its most loaded rank."""
    over_cap: tuple[int, ...] = ()
    """Samples longer than the token cap (each alone in its micro-batch)."""

    @property
    def dp_size(self) -> int:
        """Number of data-parallel ranks."""
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (equal on all ranks)."""
        return len(self.micro_batches[0]) if self.micro_batches else 0

    @property
    def imbalance(self) -> float:
        """Most loaded rank over the lower bound (1.0 is perfect)."""
        top = max(self.flops_per_rank, default=0.0)
        return top / self.lower_bound if self.lower_bound > 0 else 1.0

    def rank_samples(self, rank: int) -> list[int]:
        """Sample indices of ``rank`` in micro-batch order."""
        return [i for mb in self.micro_batches[rank] for i in mb]

    def micro_batch_bounds(self, rank: int) -> tuple[int, ...]:
        """Sequence-index bounds ``[0, k1, ..., N]`` of ``rank``'s micro-batches, for
        ``TrainBatch.micro_batch_bounds`` when sequences are packed in :meth:`rank_samples`
        order."""
        out = [0]
        for mb in self.micro_batches[rank]:
            out.append(out[-1] + len(mb))
        return tuple(out)


@contextlib.contextmanager
def _no_gc():
    """Pause the cyclic garbage collector: scheduling allocates many small lists, and a full
    collection over a process holding torch costs more than the whole schedule."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# -- partitioning ---------------------------------------------------------------------------


def lpt_partition(costs: Sequence[float] | np.ndarray, k: int) -> np.ndarray:
    """Longest-processing-time greedy: items by decreasing cost, each to the least loaded of
    ``k`` bins. Returns the bin of every item."""
    c = np.asarray(costs, dtype=np.float64)
    assign = np.empty(len(c), dtype=np.int64)
    heap = [(0.0, b) for b in range(k)]
    cl = c.tolist()
    for i in np.argsort(-c, kind="stable").tolist():
        load, b = heap[0]
        assign[i] = b
        heapq.heapreplace(heap, (load + cl[i], b))
    return assign


def karmarkar_karp_partition(
    costs: Sequence[float] | np.ndarray, k: int, *, equal_size: bool = False
) -> np.ndarray:
    """Multiway largest-differencing (Karmarkar-Karp) partition into ``k`` bins.

    With ``equal_size`` (requires ``len(costs) % k == 0``) every bin gets the same number of
    items, as slime does when it hands micro-batches to ranks. Returns the bin of every item.
    """
    with _no_gc():
        return _kk(np.asarray(costs, dtype=np.float64), k, equal_size)


def _kk(c: np.ndarray, k: int, equal_size: bool) -> np.ndarray:
    n = len(c)
    if equal_size and n % k:
        raise ValueError(f"karmarkar_karp_partition: {n} items do not split into {k} equal bins.")
    order = np.argsort(-c, kind="stable").tolist()
    heap: list[tuple[float, int, list[tuple[float, list[int]]]]] = []
    if equal_size:
        chunks = [order[j : j + k] for j in range(0, n, k)]
    else:
        chunks = [[i] for i in order]
    for t, chunk in enumerate(chunks):
        part = [(float(c[i]), [i]) for i in chunk] + [(0.0, []) for _ in range(k - len(chunk))]
        part.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(part[0][0] - part[-1][0]), t, part))
    tie = len(chunks)
    while len(heap) > 1:
        _, _, p = heapq.heappop(heap)
        _, _, q = heapq.heappop(heap)
        merged = [(p[j][0] + q[k - 1 - j][0], p[j][1] + q[k - 1 - j][1]) for j in range(k)]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), tie, merged))
        tie += 1
    assign = np.zeros(n, dtype=np.int64)
    if heap:
        for b, (_, items) in enumerate(heap[0][2]):
            assign[items] = b
    return assign


_SWAP_RANKS = 8
"""Swap partners of the most loaded rank are searched on this many of the least loaded ranks."""


def _refine(c: np.ndarray, assign: np.ndarray, k: int, target: float, max_iters: int) -> None:
    """Local search in place: move or swap items between the most loaded bin and the others while
    that lowers the larger of the two loads (the sum of squared loads falls every step, so it
    ends). Stops at ``target`` or after ``max_iters`` steps."""
    loads = np.bincount(assign, weights=c, minlength=k)
    for _ in range(max_iters):
        m = int(np.argmax(loads))
        lm = loads[m]
        if lm <= target:
            return
        eps = lm * 1e-12
        in_m = np.flatnonzero(assign == m)
        best, best_val = None, lm - eps
        r = int(np.argmin(loads))
        if r != m and in_m.size:
            vals = np.maximum(lm - c[in_m], loads[r] + c[in_m])
            j = int(np.argmin(vals))
            if vals[j] < best_val:
                best, best_val = ("move", int(in_m[j]), r), vals[j]
        # swaps: for each lighter rank r the best partner of item a has cost nearest to
        # c[a] - (lm - loads[r]) / 2; find it by binary search in r's sorted costs
        if in_m.size:
            ca = c[in_m]
            for r in np.argsort(loads, kind="stable")[:_SWAP_RANKS].tolist():
                gap = lm - loads[r]
                if r == m or gap <= 0:
                    continue
                idx_r = np.flatnonzero(assign == r)
                if not idx_r.size:
                    continue
                o = np.argsort(c[idx_r], kind="stable")
                cs = c[idx_r][o]
                pos = np.searchsorted(cs, ca - gap / 2)
                hi = cs.size - 1
                for cand in (np.minimum(np.maximum(pos - 1, 0), hi), np.minimum(pos, hi)):
                    delta = ca - cs[cand]
                    ok = (delta > 0) & (delta < gap)
                    vals = np.where(ok, np.maximum(lm - delta, loads[r] + delta), np.inf)
                    a = int(np.argmin(vals))
                    if vals[a] < best_val:
                        best = ("swap", int(in_m[a]), int(idx_r[o[cand[a]]]))
                        best_val = vals[a]
        if best is None:
            return
        if best[0] == "move":
            _, i, r = best
            assign[i] = r
            loads[m] -= c[i]
            loads[r] += c[i]
        else:
            _, i, j = best
            r = int(assign[j])
            assign[i], assign[j] = r, m
            loads[m] += c[j] - c[i]
            loads[r] += c[i] - c[j]


def _balance_units(c: np.ndarray, k: int, tol: float) -> np.ndarray:
    n = len(c)
    lower = max(float(c.sum()) / k, float(c.max(initial=0.0)))
    target = lower * (1 + tol)
    iters = 400 if n <= 2048 else 60
    candidates = [lpt_partition(c, k)]
    if n <= 512:
        candidates.append(karmarkar_karp_partition(c, k))
    best, best_max = candidates[0], np.inf
    for assign in candidates:
        _refine(c, assign, k, target, iters)
        top = np.bincount(assign, weights=c, minlength=k).max(initial=0.0)
        if top < best_max:
            best, best_max = assign, top
    return best


# -- packing --------------------------------------------------------------------------------


def _desc(indices: Sequence[int], tok: np.ndarray) -> list[int]:
    ix = np.asarray(indices, dtype=np.int64)
    return ix[np.argsort(-tok[ix], kind="stable")].tolist() if len(ix) else []


def _lpt_bins(items: list[int], tok: np.ndarray, cap: int, nb: int) -> list[list[int]] | None:
    """``items`` (decreasing tokens) over ``nb`` token-balanced bins; ``None`` if a bin would
    exceed ``cap``."""
    heap = [(0, b) for b in range(nb)]
    bins: list[list[int]] = [[] for _ in range(nb)]
    for i, t in zip(items, tok[items].tolist() if items else []):
        load, b = heap[0]
        if load + t > cap:
            return None
        bins[b].append(i)
        heapq.heapreplace(heap, (load + t, b))
    return bins


def _ffd_bins(items: list[int], tok: np.ndarray, cap: int) -> list[list[int]]:
    """First-fit decreasing of ``items`` (decreasing tokens, each at most ``cap``)."""
    bins: list[list[int]] = []
    loads = np.zeros(max(1, len(items)), dtype=np.int64)
    for i in items:
        t = int(tok[i])
        nb = len(bins)
        if nb:
            j = int(np.argmax(loads[:nb] <= cap - t))
            if loads[j] + t <= cap:
                bins[j].append(i)
                loads[j] += t
                continue
        bins.append([i])
        loads[nb] = t
    return bins


def _split_to(bins: list[list[int]], tok: np.ndarray, nb: int) -> list[list[int]]:
    """Split the heaviest multi-sample bin in two token-balanced halves until there are ``nb``
    bins (empty bins once nothing can be split)."""
    bins = [list(b) for b in bins]
    while len(bins) < nb:
        multi = [j for j, b in enumerate(bins) if len(b) > 1]
        if not multi:
            bins.append([])
            continue
        j = max(multi, key=lambda j: sum(int(tok[i]) for i in bins[j]))
        big = bins.pop(j)
        halves: list[list[int]] = [[], []]
        hl = [0, 0]
        for i in big:  # decreasing tokens
            h = 0 if hl[0] <= hl[1] else 1
            halves[h].append(i)
            hl[h] += int(tok[i])
        bins += halves
    return bins


def _split_over(indices: Sequence[int], tok: np.ndarray, cap: int) -> tuple[list[int], list[int]]:
    order = _desc(indices, tok)
    return [i for i in order if tok[i] > cap], [i for i in order if tok[i] <= cap]


def _finish(bins: list[list[int]], over: list[int], nb: int) -> list[list[int]]:
    out = [sorted(b) for b in bins if b] + [[i] for i in over]
    out += [[] for _ in range(nb - len(out))]
    out.sort(key=lambda b: b[0] if b else float("inf"))
    return out


_LPT_TRIES = 3
"""Bin counts tried with balanced (LPT) packing above ``ceil(tokens / cap)`` before falling back
to first-fit decreasing."""


def _pack_min(over: list[int], rest: list[int], tok: np.ndarray, cap: int) -> list[list[int]]:
    """Few token-balanced bins for ``rest``: LPT at ``ceil(tokens / cap)`` and a few more, else
    first-fit decreasing."""
    if not rest:
        return []
    lo = max(1, -(-int(tok[rest].sum()) // cap))
    for nb in range(lo, lo + _LPT_TRIES):
        bins = _lpt_bins(rest, tok, cap, nb)
        if bins is not None:
            return bins
    return _ffd_bins(rest, tok, cap)


def _pack_to(
    over: list[int], rest: list[int], tok: np.ndarray, cap: int, nb: int, own: list[list[int]]
) -> list[list[int]] | None:
    """Exactly ``nb`` micro-batches (``own``: a packing of ``rest`` with at most ``nb`` bins),
    token-balanced when LPT fits the cap, else ``own`` split up."""
    want = nb - len(over)
    if want < len([b for b in own if b]):
        return None
    if want == len(own) or not rest:
        return _finish(own, over, nb)
    bins = _lpt_bins(rest, tok, cap, want)
    if bins is None:
        bins = _split_to(own, tok, want)
    return _finish(bins, over, nb)


def pack_micro_batches(
    indices: Sequence[int],
    tokens: Sequence[int] | np.ndarray,
    cap: int,
    *,
    num_bins: int | None = None,
) -> list[list[int]]:
    """Pack ``indices`` into token-balanced micro-batches of at most ``cap`` tokens.

    A sample longer than ``cap`` gets a micro-batch of its own. Without ``num_bins`` the count is
    small: ``ceil(tokens / cap)`` (or up to two more) when balanced packing fits the cap, else
    the first-fit-decreasing count. With ``num_bins`` there are exactly that many (empty ones only when there are fewer
    samples); ``ValueError`` if they cannot hold the samples under the cap. Micro-batches list
    sample indices in increasing order and are ordered by their first index.
    """
    tok = np.asarray(tokens, dtype=np.int64)
    over, rest = _split_over(indices, tok, cap)
    own = _pack_min(over, rest, tok, cap)
    nb = max(1, len(own) + len(over)) if num_bins is None else num_bins
    out = _pack_to(over, rest, tok, cap, nb, own)
    if out is None:
        ffd = _ffd_bins(rest, tok, cap)
        out = _pack_to(over, rest, tok, cap, nb, ffd)
    if out is None:
        raise ValueError(
            f"pack_micro_batches: {num_bins} micro-batches cannot hold the samples under cap "
            f"{cap}; {len(own) + len(over)} are needed."
        )
    return out


def split_steps(rollout_ids: Sequence[str], num_steps: int) -> list[list[int]]:
    """Split a rollout batch into ``num_steps`` optimizer steps without splitting fan-out
    siblings: samples sharing a ``rollout_id`` land in the same step.

    Rollouts (unique ids, in first-occurrence order) are cut into contiguous chunks whose sizes
    differ by at most one. Returns the sample indices of each step, in sample order.
    """
    if num_steps < 1:
        raise ConfigError(f"split_steps: num_steps must be >= 1, got {num_steps}.")
    units: dict[str, int] = {}
    unit_of = [units.setdefault(rid, len(units)) for rid in rollout_ids]
    if len(units) < num_steps:
        raise ConfigError(
            f"split_steps: {len(units)} rollouts cannot fill {num_steps} optimizer steps; "
            "lower num_steps or sample more rollouts."
        )
    q, r = divmod(len(units), num_steps)
    step_of_unit = [s for s in range(num_steps) for _ in range(q + (s < r))]
    steps: list[list[int]] = [[] for _ in range(num_steps)]
    for i, u in enumerate(unit_of):
        steps[step_of_unit[u]].append(i)
    return steps


def _runs(
    indices: Sequence[int], tok: np.ndarray, cap: int, groups: Sequence[Hashable] | None
) -> tuple[list[list[int]], np.ndarray]:
    """The packing units of a rank's ``indices`` and their tokens: single samples, or (with
    ``groups``) each group's samples cut into first-fit-decreasing runs of at most ``cap``
    tokens (an over-cap sample is a run of its own)."""
    if groups is None:
        return [[i] for i in indices], tok[np.asarray(indices, dtype=np.int64)]
    by_key: dict[Hashable, list[int]] = {}
    for i in indices:
        by_key.setdefault(groups[i], []).append(i)
    units: list[list[int]] = []
    sizes: list[int] = []
    for members in by_key.values():
        total = int(tok[members].sum())
        if total <= cap:  # the common case: the whole group is one run
            units.append(members)
            sizes.append(total)
            continue
        over, rest = _split_over(members, tok, cap)
        for run in [[i] for i in over] + _ffd_bins(rest, tok, cap):
            units.append(run)
            sizes.append(int(tok[run].sum()))
    return units, np.array(sizes, dtype=np.int64)


def _expand(bins: list[list[int]], units: list[list[int]]) -> list[list[int]]:
    """Bins of unit indices as bins of sample indices (increasing; bins by first index)."""
    out = [sorted(i for u in b for i in units[u]) for b in bins]
    out.sort(key=lambda b: b[0] if b else float("inf"))
    return out


# -- the scheduler --------------------------------------------------------------------------


def schedule_step(
    samples: Sequence[int] | Sequence[Rollout],
    *,
    dp_size: int,
    max_tokens_per_micro_batch: int,
    shape: ModelShape | None = None,
    rollout_ids: Sequence[str] | None = None,
    costs: Sequence[float] | None = None,
    tolerance: float = 1e-7,
    prefix_groups: Sequence[Hashable] | None = None,
) -> SchedulePlan:
    """Split one optimizer step's samples over ``dp_size`` ranks and into micro-batches.

    Args:
        samples: sequence lengths in tokens, or rollouts (length ``len(tokens)``, ids from
            ``rollout_id``).
        dp_size: data-parallel ranks.
        max_tokens_per_micro_batch: token cap of one micro-batch, never exceeded except by a
            single over-long sample, which then runs alone (logged as a warning).
        shape: model shape for the FLOPs estimate; ``None`` balances tokens.
        rollout_ids: per-sample fan-out id; samples sharing one go to the same rank.
        costs: per-sample costs overriding the FLOPs estimate.
        tolerance: stop refining once the most loaded rank is within this fraction of the
            lower bound (the local search also stops when no move or swap helps).
        prefix_groups: per-sample key of the prompt it shares (a GRPO group's ``prompt_uid``),
            for a policy that computes a micro-batch's shared prompt once
            (``HFPolicy.Config.share_prefix``): a rank's samples of one key are packed into
            the same micro-batch, or, when they exceed the cap together, into as few as
            first-fit decreasing needs; those runs are then packed whole. The cap is still on
            full tokens (attention keeps one row per sample). ``None``: samples are packed
            one by one (token balance only).

    Returns:
        A :class:`SchedulePlan` in which every sample appears exactly once.
    """
    with _no_gc():
        return _schedule(
            samples,
            dp_size,
            max_tokens_per_micro_batch,
            shape,
            rollout_ids,
            costs,
            tolerance,
            prefix_groups,
        )


def _schedule(
    samples: Sequence[int] | Sequence[Rollout],
    dp_size: int,
    max_tokens_per_micro_batch: int,
    shape: ModelShape | None,
    rollout_ids: Sequence[str] | None,
    costs: Sequence[float] | None,
    tolerance: float,
    prefix_groups: Sequence[Hashable] | None = None,
) -> SchedulePlan:
    if dp_size < 1:
        raise ConfigError(f"schedule_step: dp_size must be >= 1, got {dp_size}.")
    if max_tokens_per_micro_batch < 1:
        raise ConfigError(
            f"schedule_step: max_tokens_per_micro_batch must be >= 1, got "
            f"{max_tokens_per_micro_batch}."
        )
    if len(samples) and isinstance(samples[0], Rollout):
        rolls: Sequence[Rollout] = samples  # type: ignore[assignment]
        tokens = np.array([len(r.tokens) for r in rolls], dtype=np.int64)
        if rollout_ids is None:
            rollout_ids = [r.rollout_id for r in rolls]
    else:
        tokens = np.asarray(samples, dtype=np.int64).reshape(-1)
    n = len(tokens)
    if costs is not None:
        c = np.asarray(costs, dtype=np.float64)
    elif shape is not None:
        c = estimate_flops_array(tokens, shape)
    else:
        c = tokens.astype(np.float64)
    if (
        len(c) != n
        or (rollout_ids is not None and len(rollout_ids) != n)
        or (prefix_groups is not None and len(prefix_groups) != n)
    ):
        raise ValueError(
            "schedule_step: samples, costs, rollout_ids and prefix_groups must have equal lengths."
        )

    # fan-out units: all samples of one rollout_id go to the same rank
    if rollout_ids is None:
        unit_of = np.arange(n)
        n_units = n
    else:
        ids: dict[str, int] = {}
        unit_of = np.array([ids.setdefault(rid, len(ids)) for rid in rollout_ids], dtype=np.int64)
        n_units = len(ids)
    unit_cost = np.bincount(unit_of, weights=c, minlength=n_units) if n else np.zeros(0)
    unit_rank = _balance_units(unit_cost, dp_size, tolerance) if n else np.zeros(0, np.int64)
    rank_of = unit_rank[unit_of] if n else np.zeros(0, np.int64)

    per_rank = [np.flatnonzero(rank_of == r).tolist() for r in range(dp_size)]
    over = [i for i in range(n) if tokens[i] > max_tokens_per_micro_batch]
    if over:
        logger.warning(
            "schedule_step: %d sample(s) longer than max_tokens_per_micro_batch=%d (longest %d "
            "tokens) run alone in their micro-batch; raise the cap or lower the response length.",
            len(over),
            max_tokens_per_micro_batch,
            int(tokens[over].max()),
        )
    cap = max_tokens_per_micro_batch
    runs = [_runs(ix, tokens, cap, prefix_groups) for ix in per_rank]
    parts = [_split_over(range(len(r)), run_tok, cap) for r, run_tok in runs]
    own = [
        _pack_min(over_r, rest_r, run_tok, cap)
        for (over_r, rest_r), (_, run_tok) in zip(parts, runs)
    ]
    k = max(1, *(len(b) + len(p[0]) for b, p in zip(own, parts)))
    packed = []
    for (over_r, rest_r), own_r, (rank_runs, run_tok), ix in zip(parts, own, runs, per_rank):
        bins = _pack_to(over_r, rest_r, run_tok, cap, k, own_r)
        assert bins is not None  # k >= every rank's own count
        bins = _expand(bins, rank_runs)
        if prefix_groups is not None and sum(1 for b in bins if not b) > max(0, k - len(ix)):
            # Whole runs left a micro-batch empty that the rank's samples could fill (equal
            # counts across ranks): split the heaviest micro-batches in two until none is.
            full = [_desc(b, tokens) for b in bins if b]
            bins = _finish(_split_to(full, tokens, k), [], k)
        packed.append(bins)
    loads = np.bincount(rank_of, weights=c, minlength=dp_size) if n else np.zeros(dp_size)
    toks = np.bincount(rank_of, weights=tokens, minlength=dp_size) if n else np.zeros(dp_size)
    lower = max(float(c.sum()) / dp_size, float(unit_cost.max(initial=0.0)))
    return SchedulePlan(
        micro_batches=tuple(tuple(tuple(mb) for mb in bins) for bins in packed),
        flops_per_rank=tuple(float(x) for x in loads),
        tokens_per_rank=tuple(int(x) for x in toks),
        lower_bound=lower,
        over_cap=tuple(over),
    )
