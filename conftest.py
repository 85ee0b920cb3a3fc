"""Repository-wide pytest hooks: ``gpu``-marked tests are skipped where CUDA is unavailable, and
one-time installs can run outside the per-test timeout.

``make test`` (CPU) therefore collects the GPU tier and reports it as skipped; ``make test-gpu``
runs only that tier (``-m gpu``) on a machine with CUDA (README, "Test tiers").

Every test (setup, call and teardown) ends after the ``timeout`` of the root ``pyproject.toml``
(pytest-timeout, thread method: every thread's stack is printed and pytest exits), so a hung
collective fails CI in minutes instead of blocking it. A session fixture whose first run installs
something (SGLang's own venv: ~15 min the first time, ~1 s once cached) wraps that step in the
``untimed`` fixture's context manager: the clock of the test that triggered it stops during the
install and restarts, with the full timeout, afterwards.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every ``gpu``-marked test when ``torch.cuda.is_available()`` is False."""
    if not any("gpu" in item.keywords for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu: needs a CUDA device (run `make test-gpu` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_RUNNING: list[pytest.Item] = []
"""The test being run (setup, call, teardown), for :func:`untimed`."""


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    """Remember the running test while pytest runs it."""
    _RUNNING.append(item)
    try:
        return (yield)
    finally:
        _RUNNING.pop()


@contextlib.contextmanager
def _untimed(config: pytest.Config) -> Iterator[None]:
    """Stop the running test's pytest-timeout clock inside the block; restart it (full timeout)
    after. Without pytest-timeout (or outside a test) a plain block."""
    plugin: Any = config.pluginmanager.get_plugin("timeout")
    if plugin is None or not _RUNNING:
        yield
        return
    item, hook = _RUNNING[-1], config.pluginmanager.hook
    settings = plugin.get_env_settings(config)
    armed = settings.timeout and not settings.func_only and getattr(item, "cancel_timeout", None)
    if armed:
        hook.pytest_timeout_cancel_timer(item=item)
    try:
        yield
    finally:
        if armed:
            hook.pytest_timeout_set_timer(item=item, settings=settings)


@pytest.fixture(scope="session")
def untimed(pytestconfig: pytest.Config) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``with untimed(): ...`` runs a one-time install (a session fixture's first run) outside the
    per-test timeout; the test that triggered it gets its full timeout again afterwards."""
    return lambda: _untimed(pytestconfig)
