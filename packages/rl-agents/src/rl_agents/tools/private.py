"""Run a process where the machine's other processes cannot see it: for agent subprocesses,
whose environment holds their session key (``OPENAI_API_KEY``).

::

    argv = private_argv(["python", "agent.py"])   # unshare ... setpriv ... -- python agent.py

The guarantee. Every process of the trainer's user may read ``/proc/<pid>/environ`` of every
other one (the file is ``0400`` but owned by that user), so two agents started side by side
could read each other's session key and post turns into the other's session. A command wrapped
by :func:`private_argv` runs in a PID namespace of its own with a ``/proc`` of its own
(``unshare --pid --fork --kill-child --mount-proc``): the processes outside it, the other agents
included, have no pid there, so it cannot name them (no ``/proc/<pid>/environ``, ``cmdline``,
``mem``, no signal), and they cannot name it either, being wrapped the same way. The process
cannot undo this: the capabilities that would unmount its ``/proc`` (and reveal the machine's)
or join another namespace are dropped before the command runs (``setpriv``: all of them for an
unprivileged trainer, whose wrapper also needs a user namespace; as root ``sys_admin``,
``sys_ptrace``, ``dac_read_search`` and the device/module ones, so a root agent can still drop
to other uids, as :class:`~rl_agents.tools.Sandbox` does). When the wrapper is killed (a
timeout), the namespace's pid 1 gets SIGKILL and every process of it dies.

The key is not in the command line (``ps`` shows argv to everyone), and it travels to the
server over loopback TCP, which only root (``CAP_NET_RAW``) can sniff. Not covered: a process
of the trainer's user that is *not* wrapped (started outside the trainer) can still read the
agents' environments; where the wrapper cannot run here (:func:`private_available` is False:
no ``unshare``/``setpriv``, or user namespaces are off for an unprivileged trainer), commands
run as given and a warning says so.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

__all__ = ["private_argv", "private_available"]

logger = logging.getLogger(__name__)

# Dropped from a root agent's bounding set: what could unmount its /proc, enter or inspect
# other namespaces and processes, or reach the machine below the file system.
_ROOT_DROPS = ("sys_admin", "sys_ptrace", "dac_read_search", "sys_module", "sys_rawio",
               "sys_boot", "mknod", "syslog", "bpf", "perfmon", "checkpoint_restore")  # fmt: skip


def _prefix() -> list[str] | None:
    unshare, setpriv = shutil.which("unshare"), shutil.which("setpriv")
    if unshare is None or setpriv is None or not sys.platform.startswith("linux"):
        return None
    ns = [unshare, "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation", "private"]
    if os.geteuid() == 0:
        drops = ",".join(f"-{c}" for c in _ROOT_DROPS)
        return [*ns, setpriv, f"--bounding-set={drops}", "--no-new-privs", "--"]
    return [*ns[:1], "--user", "--map-current-user", *ns[1:], setpriv, "--bounding-set=-all",
            "--inh-caps=-all", "--no-new-privs", "--"]  # fmt: skip


@functools.cache
def _probe() -> list[str] | None:
    prefix = _prefix()
    if prefix is None:
        return None
    if os.geteuid() == 0:  # caps setpriv does not know (an older kernel's list) are skipped
        known = []
        for cap in _ROOT_DROPS:
            proc = subprocess.run(
                [shutil.which("setpriv") or "setpriv", f"--bounding-set=-{cap}", "true"],
                capture_output=True,
            )
            if proc.returncode == 0:
                known.append(cap)
        i = next(k for k, a in enumerate(prefix) if a.startswith("--bounding-set="))
        prefix[i] = "--bounding-set=" + ",".join(f"-{c}" for c in known)
    try:
        proc = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if proc.returncode == 0 else None


def private_available() -> bool:
    """True when :func:`private_argv` can wrap commands here."""
    return _probe() is not None


@functools.cache
def _warn_once() -> None:
    logger.warning(
        "agent commands run without a PID namespace of their own (`unshare --pid --fork "
        "--mount-proc` or `setpriv` does not work here%s): agents of this user can read each "
        "other's session keys from /proc/<pid>/environ.",
        "" if os.geteuid() == 0 else "; an unprivileged trainer also needs user namespaces",
    )


def private_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` wrapped to run in a PID namespace and ``/proc`` of its own (see the module
    docstring); ``argv`` itself, with a warning, where that cannot run here."""
    prefix = _probe()
    if prefix is None:
        _warn_once()
        return list(argv)
    return [*prefix, *argv]
