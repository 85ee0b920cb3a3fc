"""Conformance suites (one per interface) and small fakes that pass them.

Implementations subclass the suite in their own tests; see :mod:`rl_core.testing._base`.
"""

from rl_core.testing._base import ConformanceSuite

__all__ = ["ConformanceSuite"]
