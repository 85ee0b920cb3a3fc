"""Conformance suites (one per interface) and small fakes that pass them.

Implementations subclass the suite in their own tests (see :mod:`rl_core.testing._base`)::

    from rl_core.testing import GeneratorConformance

    class TestMyGenerator(GeneratorConformance):
        @pytest.fixture
        def generator(self):
            return MyGenerator(MyGenerator.Config(...))

The suites need pytest (extra ``rlpost-core[test]``); names are imported on first use, so
``import rl_core.testing`` itself needs nothing beyond rl-core.
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_core.testing._base import ConformanceSuite

__all__ = [
    "BufferConformance",
    "ConformanceSuite",
    "DataSourceConformance",
    "DictTarget",
    "FakeBuffer",
    "FakeDataSource",
    "FakeGenerator",
    "GeneratorConformance",
    "InMemoryTransport",
    "PolicyConformance",
    "WeightTransportConformance",
    "load_module",
]

_LAZY = {
    "PolicyConformance": "rl_core.testing.policy",
    "GeneratorConformance": "rl_core.testing.generator",
    "FakeGenerator": "rl_core.testing.fake_generator",
    "InMemoryTransport": "rl_core.testing.fake_generator",
    "BufferConformance": "rl_core.testing.buffer",
    "FakeBuffer": "rl_core.testing.buffer",
    "DataSourceConformance": "rl_core.testing.data_source",
    "FakeDataSource": "rl_core.testing.data_source",
    "WeightTransportConformance": "rl_core.testing.weight_transport",
    "DictTarget": "rl_core.testing.weight_transport",
    "load_module": "rl_core.testing.modules",
}


def __getattr__(name: str) -> Any:
    """Import suites and fakes on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted(__all__)
