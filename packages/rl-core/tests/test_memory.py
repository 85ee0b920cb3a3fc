"""``rl_core.memory``: ``trim_host_memory`` (glibc's ``malloc_trim`` returns freed arena memory to
the system; live tensors keep their values) and ``FrozenObjects`` (what a run built kept out of
the garbage collector's passes, and given back) and ``HostMemoryTrim`` (trims only when the
resident memory grew enough to repay the page faults)."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from rl_core.memory import FrozenObjects, HostMemoryTrim, resident_bytes, trim_host_memory


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim is glibc's")
def test_trim_runs_on_linux_and_keeps_live_values() -> None:
    """It runs (glibc) between allocations of large temporaries; a tensor alive across the trim
    keeps its values bitwise."""
    kept = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    before = kept.clone()
    for _ in range(3):
        tmp = torch.ones(1 << 22)  # 16 MB freed right after
        del tmp
        assert trim_host_memory() is True
    assert torch.equal(kept, before)


class _Node:
    """An object in a reference cycle (only the collector frees it)."""

    def __init__(self) -> None:
        self.me = self


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


@pytest.fixture
def no_freeze():
    """The test starts and ends with nothing frozen in this process."""
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_freeze_moves_live_objects_out_and_thaw_gives_them_back(no_freeze) -> None:
    frozen = FrozenObjects()
    assert frozen.enabled and not frozen.frozen
    dead = _cycle()  # garbage before the freeze: collected by it, not frozen
    alive = _Node()
    frozen.freeze()
    assert dead() is None
    assert frozen.frozen and gc.get_freeze_count() > 0
    # a full collection leaves frozen objects alone: a cycle dropped after the freeze stays
    kept = weakref.ref(alive)
    del alive
    gc.collect()
    assert kept() is not None
    frozen.thaw()
    assert not frozen.frozen and gc.get_freeze_count() == 0
    gc.collect()
    assert kept() is None  # thawed: collected as usual


def test_a_second_freeze_collects_what_the_first_froze_and_later_died(no_freeze) -> None:
    frozen = FrozenObjects()
    warmup = _Node()  # e.g. the warm-up phase's policy, frozen with its phase
    gone = weakref.ref(warmup)
    frozen.freeze()
    del warmup  # replaced by the next phase's build
    frozen.freeze()
    assert gone() is None
    assert gc.get_freeze_count() > 0
    frozen.thaw()
    assert gc.get_freeze_count() == 0


def test_disabled_or_already_frozen_processes_are_left_alone(no_freeze) -> None:
    off = FrozenObjects(enabled=False)
    off.freeze()
    assert gc.get_freeze_count() == 0 and not off.frozen
    gc.freeze()  # the process froze its own objects first
    other = FrozenObjects()
    assert not other.enabled
    probes = [[] for _ in range(2000)]  # tracked, not frozen: a freeze would add them
    mine = gc.get_freeze_count()  # (frozen objects that die meanwhile lower it a little)
    other.freeze()
    assert not other.frozen and gc.get_freeze_count() < mine + len(probes)
    other.thaw()
    assert gc.get_freeze_count() > mine - len(probes)  # its own freeze is not undone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="malloc_trim and statm: Linux")
def test_host_memory_trim_trims_first_then_only_after_enough_growth(monkeypatch) -> None:
    """The first call trims; later calls only once the resident memory grew by
    ``min_growth_bytes`` since just after the last trim; memory given back lowers that mark."""
    import rl_core.memory as memory

    calls: list[int] = []
    monkeypatch.setattr(memory, "trim_host_memory", lambda: calls.append(1) or True)
    trim = HostMemoryTrim(min_growth_bytes=48 * 2**20)
    assert resident_bytes() is not None
    assert trim() is True and calls == [1]
    assert trim() is False and calls == [1]  # nothing grew
    grown = bytearray(96 * 2**20)  # 96 MiB, zero-filled: resident
    assert trim() is True and len(calls) == 2
    assert trim() is False
    del grown  # unmapped: the resident memory falls below the mark, which follows it down
    assert trim() is False
    regrown = bytearray(64 * 2**20)
    assert trim() is True and len(calls) == 3  # 64 MiB above the lowered mark
    del regrown
    assert trim.trims == 3
    every = HostMemoryTrim(min_growth_bytes=0)
    assert [every() for _ in range(3)] == [True, True, True]
