"""The fakes shipped in rl_core.testing pass their own conformance suites."""

from __future__ import annotations

import pytest

from rl_core.testing.buffer import BufferConformance, FakeBuffer
from rl_core.testing.data_source import DataSourceConformance, FakeDataSource


class TestFakeDataSource(DataSourceConformance):
    @pytest.fixture
    def data_source_factory(self):
        return lambda: FakeDataSource(["alpha", "beta", "gamma", "delta", "eps"], seed=3)


class TestFakeBuffer(BufferConformance):
    @pytest.fixture
    def buffer_factory(self):
        return FakeBuffer
