"""``rl_core.memory``: ``trim_host_memory`` (glibc's ``malloc_trim`` returns freed arena memory to
the system; live tensors keep their values) and ``FrozenObjects`` (what a run built kept out of
the garbage collector's passes, and given back)."""

from __future__ import annotations

import gc
import sys
import weakref

import pytest
import torch

from rl_core.memory import FrozenObjects, trim_host_memory


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
    mine = gc.get_freeze_count()
    other = FrozenObjects()
    assert not other.enabled
    other.freeze()
    other.thaw()
    assert gc.get_freeze_count() == mine  # neither added to nor undone
