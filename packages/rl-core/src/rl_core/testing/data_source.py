"""Conformance suite for :class:`~rl_core.interfaces.DataSource`, and a fake that passes it.

An implementation's tests subclass :class:`DataSourceConformance` and provide one fixture, a
factory that builds a *fresh* source with the same configuration on every call (the resume tests
need two independent instances)::

    class TestJsonlSource(DataSourceConformance):
        @pytest.fixture
        def data_source_factory(self, tmp_path):
            path = write_jsonl(tmp_path, n=7)
            return lambda: JsonlSource(JsonlSource.Config(path=str(path)), tokenizer)

The source under test must hold at least three prompts per epoch.

Capability flags (class attributes of the subclass):

- ``epoch_is_permutation`` (default ``True``): each run of ``len(source)`` draws yields every
  prompt exactly once. Weighted mixtures, which sample their children by weight, set it to
  ``False``.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import pytest

from rl_core.errors import CheckpointError
from rl_core.interfaces import DataSource
from rl_core.testing._base import ConformanceSuite
from rl_core.types import Prompt

__all__ = ["DataSourceConformance", "FakeDataSource"]


class FakeDataSource(DataSource):
    """In-memory prompts, one token per character, shuffled per epoch from ``(seed, epoch)``.

    Small, dependency-free stand-in for trainer and buffer tests; passes
    :class:`DataSourceConformance`.
    """

    def __init__(self, texts: Sequence[str], *, seed: int = 0, shuffle: bool = True) -> None:
        if not texts:
            raise ValueError("FakeDataSource needs at least one text.")
        self._texts = list(texts)
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._pos = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        idx = np.arange(len(self._texts))
        if self._shuffle:
            np.random.default_rng([self._seed, epoch]).shuffle(idx)
        return idx.tolist()

    def next_prompts(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts; uid ``fake:{epoch}:{row}``."""
        if n < 0:
            raise ValueError(f"next_prompts: n must be >= 0, got {n}.")
        out = []
        for _ in range(n):
            if self._pos == len(self._texts):
                self._epoch += 1
                self._pos = 0
                self._order = self._epoch_order(self._epoch)
            row = self._order[self._pos]
            self._pos += 1
            text = self._texts[row]
            out.append(
                Prompt(
                    uid=f"fake:{self._epoch}:{row}",
                    input=text,
                    token_ids=tuple(ord(c) % 256 for c in text) or (0,),
                    label=text[::-1],
                    metadata={"source": "fake"},
                )
            )
        return out

    def __len__(self) -> int:
        """Prompts per epoch."""
        return len(self._texts)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and position."""
        return {"epoch": self._epoch, "position": self._pos, "num_prompts": len(self._texts)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore epoch and position; refuses a state from a source of another size."""
        if state.get("num_prompts") != len(self._texts):
            raise CheckpointError(
                f"FakeDataSource: state is for {state.get('num_prompts')} prompts, this source "
                f"has {len(self._texts)}."
            )
        self._epoch = int(state["epoch"])
        self._pos = int(state["position"])
        self._order = self._epoch_order(self._epoch)


def _key(p: Prompt) -> tuple[Any, ...]:
    return (json.dumps(p.input, sort_keys=True), p.token_ids)


class DataSourceConformance(ConformanceSuite):
    """Standard tests every :class:`~rl_core.interfaces.DataSource` must pass.

    Override the ``data_source_factory`` fixture: a zero-argument callable returning a fresh
    source (cursor at the start) with the same configuration each call, holding >= 3 prompts.
    """

    __test__ = False

    epoch_is_permutation: ClassVar[bool] = True
    """Each run of ``len(source)`` draws yields every prompt exactly once."""

    @pytest.fixture
    def data_source_factory(self) -> Callable[[], DataSource]:
        """Override: return a zero-argument callable that builds a fresh source."""
        raise NotImplementedError(
            "Override the `data_source_factory` fixture in your DataSourceConformance subclass."
        )

    def test_len_is_positive(self, data_source_factory: Callable[[], DataSource]) -> None:
        """``len(source)`` is the number of prompts per epoch, an int >= 3 here.

        Troubleshooting: ``__len__`` must count prompts left after filtering (e.g. over-long
        prompts dropped), not raw lines; the fixture must hold at least three prompts.
        """
        n = len(data_source_factory())
        assert isinstance(n, int)
        assert n >= 3, "the fixture's source must hold at least 3 prompts per epoch"

    def test_next_prompts_returns_exactly_n(
        self, data_source_factory: Callable[[], DataSource]
    ) -> None:
        """``next_prompts(n)`` returns exactly ``n`` prompts, crossing epochs as needed; 0 gives
        an empty list.

        Troubleshooting: when the epoch runs out mid-request, start the next epoch and keep
        going; never return a short list.
        """
        src = data_source_factory()
        assert src.next_prompts(0) == []
        assert len(src.next_prompts(1)) == 1
        assert len(src.next_prompts(len(src) + 2)) == len(src) + 2

    def test_negative_n_raises(self, data_source_factory: Callable[[], DataSource]) -> None:
        """``next_prompts(-1)`` raises ``ValueError``.

        Troubleshooting: validate ``n`` before touching the cursor.
        """
        with pytest.raises(ValueError):
            data_source_factory().next_prompts(-1)

    def test_prompts_are_well_formed(self, data_source_factory: Callable[[], DataSource]) -> None:
        """Every prompt has a str uid, non-empty int token ids (a tuple), an input that is text
        or chat messages, and a dict of metadata.

        Troubleshooting: convert tokenizer output (lists, numpy or torch ints) to a tuple of
        Python ints; chat inputs are lists of ``{"role", "content"}`` dicts.
        """
        src = data_source_factory()
        for p in src.next_prompts(len(src)):
            assert isinstance(p, Prompt)
            assert isinstance(p.uid, str) and p.uid
            assert isinstance(p.token_ids, tuple) and len(p.token_ids) > 0
            assert all(type(t) is int for t in p.token_ids)
            if isinstance(p.input, list):
                assert all(isinstance(m, dict) and "role" in m and "content" in m for m in p.input)
            else:
                assert isinstance(p.input, str)
            assert isinstance(p.metadata, dict)

    def test_uids_unique_across_epochs(self, data_source_factory: Callable[[], DataSource]) -> None:
        """Every draw has its own uid, also across epochs (the uid is the group id).

        Troubleshooting: include the epoch (or a draw counter) in the uid, e.g.
        ``f"{source}:{epoch}:{index}"``.
        """
        src = data_source_factory()
        uids = [p.uid for p in src.next_prompts(2 * len(src) + 1)]
        assert len(set(uids)) == len(uids)

    def test_each_epoch_is_a_permutation(
        self, data_source_factory: Callable[[], DataSource]
    ) -> None:
        """Each epoch yields every prompt exactly once (two epochs hold the same multiset).

        Troubleshooting: shuffle a permutation of the rows per epoch; do not sample with
        replacement. A weighted mixture sets ``epoch_is_permutation = False``.
        """
        if not self.epoch_is_permutation:
            pytest.skip("source declares epoch_is_permutation = False")
        src = data_source_factory()
        n = len(src)
        e0 = Counter(_key(p) for p in src.next_prompts(n))
        e1 = Counter(_key(p) for p in src.next_prompts(n))
        assert e0 == e1
        assert sum(e0.values()) == n

    def test_same_config_same_order(self, data_source_factory: Callable[[], DataSource]) -> None:
        """Two fresh sources with the same config yield identical prompts (reproducibility).

        Troubleshooting: derive every random choice from the configured seed (and the epoch),
        never from global RNG state or the clock.
        """
        a, b = data_source_factory(), data_source_factory()
        n = 2 * len(a) + 1
        assert a.next_prompts(n) == b.next_prompts(n)

    def test_resume_mid_epoch_is_exact(self, data_source_factory: Callable[[], DataSource]) -> None:
        """Restoring ``state_dict()`` mid-epoch into a fresh source continues exactly where the
        original left off, across the next epoch boundary too.

        Troubleshooting: the state must hold the epoch and the position within it; the
        per-epoch order must be recomputable from it (or be stored in the state).
        """
        src = data_source_factory()
        n = len(src)
        src.next_prompts(n // 2 + 1)
        state = src.state_dict()
        resumed = data_source_factory()
        resumed.load_state_dict(state)
        assert resumed.next_prompts(n + 2) == src.next_prompts(n + 2)

    def test_resume_at_epoch_boundary(self, data_source_factory: Callable[[], DataSource]) -> None:
        """A state taken exactly at the end of an epoch resumes into the next epoch's order.

        Troubleshooting: an exhausted epoch must roll over on the next draw with the next
        epoch's seed, whichever of the saved or the resumed source draws it.
        """
        src = data_source_factory()
        src.next_prompts(len(src))
        resumed = data_source_factory()
        resumed.load_state_dict(src.state_dict())
        assert resumed.next_prompts(len(src)) == src.next_prompts(len(src))

    def test_state_dict_is_json_and_pure(
        self, data_source_factory: Callable[[], DataSource]
    ) -> None:
        """``state_dict()`` is plain JSON data, and taking it does not move the cursor.

        Troubleshooting: store ints and strings (not numpy scalars or RNG objects); rebuild RNGs
        from seeds on load.
        """
        src = data_source_factory()
        src.next_prompts(2)
        state = json.loads(json.dumps(src.state_dict()))
        expected = src.next_prompts(3)
        other = data_source_factory()
        other.next_prompts(2)
        other.state_dict()
        assert other.next_prompts(3) == expected
        fresh = data_source_factory()
        fresh.load_state_dict(state)
        assert fresh.next_prompts(3) == expected

    def test_load_rejects_foreign_state(
        self, data_source_factory: Callable[[], DataSource]
    ) -> None:
        """Loading an empty or unrelated state raises an error instead of silently restarting.

        Troubleshooting: check the keys you need and raise
        :class:`~rl_core.errors.CheckpointError` naming what is missing or mismatched.
        """
        with pytest.raises((CheckpointError, KeyError, ValueError)):
            data_source_factory().load_state_dict({})
