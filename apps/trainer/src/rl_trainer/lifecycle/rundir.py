"""A run owns its directory: one run at a time, and a new run never mixes with an old one.

:func:`claim` is called before anything of a run is built:

- It takes an exclusive ``fcntl.flock`` on ``<run_dir>/.lock`` for the run's life and writes the
  holder (pid, host, start time) into it. A second run on the directory is refused with a
  :class:`ConfigError` naming the holder. The lock is the kernel's: it ends with the process,
  however the process ends (a stale ``.lock`` file of a killed run is taken over silently).
  Within one process a later claim takes the lock over from an earlier one.
- A new run (no ``--resume``) into a directory that holds an earlier run (checkpoints, metrics,
  a final model...) is refused unless ``overwrite`` is set, which moves the earlier run's files
  aside into ``<run_dir>.old-<UTC timestamp>`` (never deletes them).
- The resolved config is written to ``<run_dir>/config.yaml`` (:func:`write_config`); every
  checkpoint holds it too.

A directory that cannot be created or written (read-only, no permission) is a
:class:`ConfigError` naming it and the cause.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

import yaml

from rl_core.errors import ConfigError

__all__ = ["RUN_FILES", "RunLock", "claim", "config_text", "earlier_run_files", "write_config"]

LOCK = ".lock"
CONFIG = "config.yaml"
RUN_FILES = (
    "checkpoints",
    "metrics.jsonl",
    "final_model",
    "sft_model",
    "samples.jsonl",
    "failures.jsonl",
)
"""Entries whose presence means the directory holds an earlier run (an empty file or directory
does not count: a run that failed before its first step left nothing to mix with; the tiny
``init_model``, a task's data and ``config.yaml`` are rewritten by the next run)."""


def _cause(e: OSError) -> str:
    name = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "error"
    return f"{name}: {e.strerror or e}"


class RunLock:
    """The exclusive lock a run holds on its directory (:func:`claim`); :meth:`release` ends it
    (so does the process's exit)."""

    def __init__(self, run_dir: Path, handle: IO[str]) -> None:
        self.run_dir = run_dir
        """The locked directory."""
        self._handle: IO[str] | None = handle

    @property
    def held(self) -> bool:
        """Whether the lock is still held."""
        return self._handle is not None

    def _take(self) -> IO[str]:
        """Hand the open, locked file over to a later claim of this process."""
        handle, self._handle = self._handle, None
        assert handle is not None
        return handle

    def release(self) -> None:
        """Unlock and close ``.lock`` (idempotent); the file stays, naming the last holder."""
        if self._handle is not None:
            try:
                fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            finally:
                self._handle.close()
                self._handle = None


_HELD: dict[str, RunLock] = {}
"""This process's locks by resolved directory: a later claim in the same process (a run built
after an earlier one that was never run or closed) takes the lock over instead of waiting for
itself; one process runs one run on a directory at a time."""


def earlier_run_files(run_dir: Path) -> list[str]:
    """The names in ``run_dir`` that belong to an earlier run (:data:`RUN_FILES`)."""
    out = []
    for name in RUN_FILES:
        p = run_dir / name
        try:
            if p.is_dir() and not any(p.iterdir()):
                continue  # an empty directory holds nothing of a run
            if p.is_file() and p.stat().st_size == 0:
                continue
        except OSError:
            pass  # unreadable: it is there, count it
        if p.exists():
            out.append(name)
    return out


def _move_aside(run_dir: Path) -> Path:
    """Move every entry of ``run_dir`` but the lock into ``<run_dir>.old-<timestamp>``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = run_dir.with_name(f"{run_dir.name}.old-{stamp}")
    n = 1
    while target.exists():
        n += 1
        target = run_dir.with_name(f"{run_dir.name}.old-{stamp}-{n}")
    try:
        target.mkdir()
        for entry in sorted(run_dir.iterdir()):
            if entry.name != LOCK:
                entry.rename(target / entry.name)
    except OSError as e:
        raise ConfigError(
            f"run_dir: cannot move the earlier run in {run_dir} aside to {target} "
            f"({_cause(e)}); move it yourself or choose another run_dir."
        ) from e
    return target


def claim(
    run_dir: str | Path, *, resume: bool, overwrite: bool = False, new_run: bool = True
) -> RunLock:
    """Create ``run_dir`` if needed and lock it for this run (see the module docstring).

    ``new_run``: whether to refuse (or, with ``overwrite``, move aside) an earlier run's files
    when not resuming; eval-only runs write into a shared ``eval/`` directory and skip it.

    Raises:
        ConfigError: the directory cannot be created or written, another run holds it, or it
            holds an earlier run and neither ``resume`` nor ``overwrite`` is set.
    """
    d = Path(run_dir)
    try:
        d.mkdir(parents=True, exist_ok=True)
        key = str(d.resolve())
        earlier = _HELD.get(key)
        if earlier is not None and earlier.held:
            handle = earlier._take()  # this process's earlier run on it: taken over
        else:
            handle = open(d / LOCK, "a+")  # noqa: SIM115 (held for the run's life)
    except OSError as e:
        raise ConfigError(
            f"run_dir: {d} cannot be created or written ({_cause(e)}); make it writable or set "
            "run_dir to a writable directory."
        ) from e
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a no-op when held
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            handle.close()
            raise ConfigError(f"run_dir: cannot lock {d / LOCK} ({_cause(e)}).") from e
        handle.seek(0)
        holder = handle.read().strip() or "unknown holder"
        handle.close()
        raise ConfigError(
            f"run_dir: {d} is in use by another run ({holder}); wait for it to end, stop it, or "
            "set run_dir to another directory."
        ) from None
    lock = RunLock(d, handle)
    _HELD[key] = lock
    try:
        handle.seek(0)
        handle.truncate()
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        handle.write(json.dumps(info) + "\n")
        handle.flush()
        if new_run and not resume:
            found = earlier_run_files(d)
            if found and not overwrite:
                raise ConfigError(
                    f"run_dir: {d} holds an earlier run ({', '.join(found)}); a new run would mix "
                    "with it. Continue it with --resume, move it aside with --overwrite (kept as "
                    f"{d.name}.old-<time>, nothing is deleted), or set run_dir to a new directory."
                )
            if found:
                _move_aside(d)
    except OSError as e:
        lock.release()
        raise ConfigError(f"run_dir: {d} cannot be written ({_cause(e)}).") from e
    except BaseException:
        lock.release()
        raise
    return lock


def config_text(config: dict[str, Any]) -> str:
    """The resolved config as YAML (loads back with ``rl-train run``)."""
    return yaml.safe_dump(config, sort_keys=False, allow_unicode=True)


def write_config(run_dir: Path, config: dict[str, Any]) -> Path:
    """Write the resolved config to ``<run_dir>/config.yaml`` atomically."""
    path = run_dir / CONFIG
    tmp = run_dir / f".{CONFIG}.tmp"
    try:
        tmp.write_text(config_text(config))
        tmp.replace(path)
    except OSError as e:
        raise ConfigError(f"run_dir: cannot write {path} ({_cause(e)}).") from e
    return path
