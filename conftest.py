"""Repository-wide pytest hooks: ``gpu``-marked tests are skipped where CUDA is unavailable, and
one-time installs can run outside the per-test timeout, and the release builds of the packages
are made once per session.

``make test`` (CPU) therefore collects the GPU tier and reports it as skipped; ``make test-gpu``
runs only that tier (``-m gpu``) on a machine with CUDA (README, "Test tiers").

Every test (setup, call and teardown) ends after the ``timeout`` of the root ``pyproject.toml``
(pytest-timeout, thread method: every thread's stack is printed and pytest exits), so a hung
collective fails CI in minutes instead of blocking it. A session fixture whose first run installs
something (SGLang's own venv: ~15 min the first time, ~1 s once cached) wraps that step in the
``untimed`` fixture's context manager: the clock of the test that triggered it stops during the
install and restarts, with the full timeout, afterwards.

Every SGLang server the tests launch (directly or through an ``rl-train`` subprocess) inherits
this process's environment with SGLang's crash diagnostics off (see :data:`_SGLANG_TEST_ENV`).
"""

from __future__ import annotations

import contextlib
import os
import tarfile
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import pytest

_SGLANG_TEST_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
"""SGLang's crash diagnostics, off in tests. The generator stops a server by SIGTERM to its
process group, so the scheduler exits before the launcher and the launcher takes it for a crash:
with these on (SGLang's default) it sleeps 5 s "to let GPU activity settle" before looking for a
scheduler to py-spy (there is none left by then), so every server stop took ~5.5 s instead of
~0.5 s. Only the diagnostics of a crash are skipped; the crash itself is still logged."""
for _key, _value in _SGLANG_TEST_ENV.items():
    os.environ.setdefault(_key, _value)


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


class ReleaseBuilds:
    """Each project's sdist and its wheel built from that sdist, the way ``python -m build``
    builds a release, into one folder; every project is built at most once per session.

    The build runs in an isolated environment (a fresh venv holding only what the project's
    ``[build-system] requires`` and its backend's ``get_requires_for_build_*`` ask for), as
    ``python -m build`` does; that environment is created once and shared: a project whose
    requirements are already installed there gets exactly the environment its own would be (all
    of this repository's projects require the same ``hatchling``). ``python -m build`` would
    create two per project (sdist, then wheel): 18 venvs and pip runs for the nine projects."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out = out
        self._work = work
        self._built: dict[Path, tuple[Path, Path]] = {}
        self._stack = contextlib.ExitStack()
        self._env: Any = None
        self._installed: set[str] = set()

    def _builder(self, srcdir: Path) -> Any:
        import pyproject_hooks
        from build import ProjectBuilder
        from build.env import DefaultIsolatedEnv

        if self._env is None:
            self._env = self._stack.enter_context(DefaultIsolatedEnv())
        builder = ProjectBuilder.from_isolated_env(
            self._env, srcdir, runner=pyproject_hooks.quiet_subprocess_runner
        )
        self._install(builder.build_system_requires)
        return builder

    def _install(self, requirements: Any) -> None:
        missing = sorted(set(requirements) - self._installed)
        if missing:
            self._env.install(missing)
            self._installed.update(missing)

    def __call__(self, project: Path) -> tuple[Path, Path]:
        """``(sdist, wheel)`` of the project in ``project`` (its folder with pyproject.toml)."""
        project = project.resolve()
        if project not in self._built:
            builder = self._builder(project)
            self._install(builder.get_requires_for_build("sdist"))
            sdist = Path(builder.build("sdist", self.out))
            # The wheel is built from the unpacked sdist (what a release publishes), as
            # ``python -m build`` does without --sdist/--wheel.
            with tarfile.open(sdist) as tf:
                (top,) = {n.split("/", 1)[0] for n in tf.getnames()}
                tf.extractall(self._work, filter="data")
            from_sdist = self._builder(self._work / top)
            self._install(from_sdist.get_requires_for_build("wheel"))
            wheel = Path(from_sdist.build("wheel", self.out))
            self._built[project] = (sdist, wheel)
        return self._built[project]

    def close(self) -> None:
        """Remove the shared build environment."""
        self._stack.close()


@pytest.fixture(scope="session")
def release_builds(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReleaseBuilds]:
    """``release_builds(project_dir) -> (sdist, wheel)``: the project's release build, made once
    per session into the folder ``release_builds.out`` (shared by every project built)."""
    builds = ReleaseBuilds(tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("sdists"))
    try:
        yield builds
    finally:
        builds.close()


_FORK_SITE = '''"""Test-only (root conftest.py, ``sglang_forked_start``): SGLang's CPU patches, then its
server processes forked from the launcher instead of spawned."""

import multiprocessing
import runpy

runpy.run_path({original!r}, run_name="sitecustomize")
_set_start_method = multiprocessing.set_start_method


def set_start_method(method, force=False):
    return _set_start_method("fork" if method == "spawn" else method, force=force)


multiprocessing.set_start_method = set_start_method
'''


@pytest.fixture(scope="session")
def sglang_forked_start(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[], contextlib.AbstractContextManager[None]]:
    """``with sglang_forked_start(): SGLangGenerator(...)``: the CPU servers launched inside the
    block fork their scheduler and detokenizer from the launcher, which has imported SGLang,
    instead of spawning them (SGLang forces ``spawn``): each then skips its own import of SGLang,
    torch and transformers, ~20 s of a ~38 s server start on two loaded cores (measured with the
    tiny model: 37.7 s -> 17-18 s). The launch is otherwise SGLang's: the block swaps
    ``rl_sglang._cpu_support.cpu_site_dir`` for a folder whose ``sitecustomize`` runs rl-sglang's
    own (the CPU patches) and then maps ``set_start_method("spawn")`` to ``"fork"``. For tests of
    what a server computes (routing, log-prob parity); the session server of rl-sglang's tests
    and the servers ``rl-train`` launches keep SGLang's spawned processes (the path users run)."""
    from rl_sglang import _cpu_support

    site = tmp_path_factory.mktemp("sglang-fork-site")
    original = _cpu_support.cpu_site_dir() / "sitecustomize.py"
    (site / "sitecustomize.py").write_text(_FORK_SITE.format(original=str(original)))

    @contextlib.contextmanager
    def forked() -> Iterator[None]:
        patch = pytest.MonkeyPatch()
        patch.setattr(_cpu_support, "cpu_site_dir", lambda: site)
        try:
            yield
        finally:
            patch.undo()

    return forked


def _link_installed(source: Path, target: Path, root: str, skip: set[str]) -> int:
    """Hard-link the installed distribution ``root`` and, transitively, every requirement of it
    that ``source`` (a site-packages) holds, except the names in ``skip``, into the site-packages
    ``target``, file by file from their RECORDs (a copy where a link fails). Returns the files
    placed. pip then sees them as installed (what it reads is the same .dist-info). A name
    ``target`` already holds is left as it is there. The source's files are never written: a
    later install or uninstall in ``target`` replaces or removes links, not the files."""
    import importlib.metadata
    import os
    import shutil

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    source = source.resolve()
    installed = {
        canonicalize_name(d.metadata["Name"]): d
        for d in importlib.metadata.distributions(path=[str(source)])
    }
    skip = skip | {
        canonicalize_name(d.metadata["Name"])
        for d in importlib.metadata.distributions(path=[str(target)])
    }
    todo, seen, linked, placed = [(canonicalize_name(root), frozenset[str]())], set(), set(), 0
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen or name in skip or name not in installed:
            continue
        seen.add((name, extras))
        dist = installed[name]
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in {"", *extras}):
                todo.append((canonicalize_name(req.name), frozenset(req.extras)))
        if name in linked:
            continue  # reached before with other extras: its files are there
        linked.add(name)
        for file in dist.files or []:
            src = (source / file).resolve()
            if not src.is_relative_to(source) or not src.is_file():
                continue  # console scripts in bin/ (their shebang names the other venv)
            dst = target / file
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            placed += 1
    return placed


@pytest.fixture(scope="session")
def link_installed() -> Callable[[Path, Path, str, set[str]], int]:
    """``link_installed(source_site, target_site, root, skip) -> files``: an installed package and
    its installed requirements hard-linked from one site-packages into another venv's (seconds
    where pip would unpack gigabytes of torch again); see :func:`_link_installed`."""
    return _link_installed
