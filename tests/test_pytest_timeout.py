"""The per-test timeout of the root pytest settings (pytest-timeout, thread method) and the root
``conftest.py``'s ``untimed`` fixture, in a child pytest with a 1 s timeout: a hung test is ended
with every thread's stack printed; a one-time install inside ``untimed()`` does not count, and
the clock restarts after it."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import threading
import time

import pytest


@pytest.fixture
def installed(untimed):
    with untimed():
        time.sleep(1.5)  # a one-time install, longer than the timeout
    return "venv"


def test_install_does_not_count(installed):
    time.sleep(0.3)
    assert installed == "venv"


def test_hang_after_an_install_is_stopped(installed):
    threading.Thread(target=time.sleep, args=(10,), name="stuck-rank", daemon=True).start()
    time.sleep(10)
"""


@pytest.fixture
def child(pytester: pytest.Pytester) -> pytest.Pytester:
    """A scratch project with the repository's conftest.py and timeout settings (1 s)."""
    pytester.makeconftest((ROOT / "conftest.py").read_text())
    pytester.makeini("[pytest]\ntimeout = 1\ntimeout_method = thread\n")
    pytester.makepyfile(test_child=CHILD)
    return pytester


def test_untimed_install_passes_and_a_hang_is_stopped_with_stacks(child: pytest.Pytester) -> None:
    """Under a 1 s timeout, a test with a 1.5 s install inside ``untimed`` then 0.3 s of work
    passes; a test that hangs after the same install is ended (the clock restarted after the
    install): pytest exits non-zero after printing the stack of every thread, the extra one
    included."""
    result = child.runpytest_subprocess("-p", "no:cacheprovider", "-v", timeout=60)
    out = result.stdout.str() + result.stderr.str()
    assert "test_install_does_not_count PASSED" in out, out
    assert "Timeout" in out and "Stack of stuck-rank" in out, out
    assert result.ret != 0
