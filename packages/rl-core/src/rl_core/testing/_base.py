"""Base class of the conformance suites.

A suite is a pytest test class. An implementation's own tests subclass it and fill in the
abstract fixtures; every standard test then runs against the implementation::

    class TestMyGenerator(GeneratorConformance):
        @pytest.fixture
        def generator(self, tmp_path):
            return MyGenerator(MyGenerator.Config(...))

A subclass may not override or delete a standard test unless it marks it
``@pytest.mark.xfail(reason=...)``; :meth:`ConformanceSuite.test_no_overrides_DO_NOT_OVERRIDE`
fails otherwise. Optional capabilities are flags on the suite, not ``if backend == ...``.
"""

from __future__ import annotations

import inspect

__all__ = ["ConformanceSuite"]


class ConformanceSuite:
    """Common machinery of the conformance suites (the no-override guard)."""

    __test__ = False  # pytest: the base itself holds no tests

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Concrete subclasses in implementation test files are collected; suite classes opt out
        # by setting ``__test__ = False`` in their own body.
        if "__test__" not in cls.__dict__:
            cls.__test__ = True

    @classmethod
    def _standard_suite(cls) -> type[ConformanceSuite]:
        for klass in cls.__mro__:
            if klass.__dict__.get("__test__") is False and klass is not ConformanceSuite:
                return klass
        return ConformanceSuite

    def test_no_overrides_DO_NOT_OVERRIDE(self) -> None:
        """Standard tests must not be overridden except to mark them xfail.

        Troubleshooting: if this fails, your test class redefines a ``test_*`` method of the
        suite. Delete the override, or mark it ``@pytest.mark.xfail(reason="why")`` so the gap is
        visible.
        """
        suite = self._standard_suite()
        for name, member in inspect.getmembers(suite):
            if not name.startswith("test_") or not callable(member):
                continue
            mine = getattr(type(self), name, None)
            if mine is None:
                raise AssertionError(f"{type(self).__name__} deletes standard test {name}")
            if mine is member:
                continue
            marks = [m.name for m in getattr(mine, "pytestmark", [])]
            if "xfail" not in marks:
                raise AssertionError(
                    f"{type(self).__name__} overrides standard test {name} without "
                    "@pytest.mark.xfail(reason=...)"
                )
