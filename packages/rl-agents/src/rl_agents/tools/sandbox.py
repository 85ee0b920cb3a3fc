"""Run untrusted code (model-written Python, an agent's shell commands) in a subprocess with
limits, for code-execution tools.

::

    box = Sandbox(Sandbox.Config(timeout_s=5, memory_mb=256))
    res = box.run("print(sum(range(10)))")
    res.ok, res.stdout, res.isolation      # True, "45\\n", "bwrap"

    with box.episode() as ep:              # one private root for a whole agent episode
        ep.write_file("sol.py", "print(6 * 7)")
        ep.shell("python3 sol.py").stdout  # "42\\n"

Every :meth:`Sandbox.run` and every command of an :class:`Episode` is a fresh process (tree)
under the limits below, in a private temporary root: a fresh directory (its working
directory, ``HOME`` and ``TMPDIR``) that only that run or episode uses and that is deleted
afterwards. ``res.isolation`` (and :attr:`Sandbox.isolation`) says which mechanism ran:

- ``bwrap`` (`bubblewrap <https://github.com/containers/bubblewrap>`_, Debian package
  ``bubblewrap``): new user, PID, network, IPC, UTS and cgroup namespaces, the host's ``/``
  read-only, a private empty ``/tmp`` (and root's parent directory), fresh ``/proc`` and
  ``/dev``, the root bound writable.
- ``namespace`` (``unshare -rnm --pid --fork --mount-proc``, ``setpriv``): new user, PID,
  network and mount namespaces; a fresh ``/proc``; ``/tmp`` and the root's parent directory
  hidden under empty mounts; every mount read-only except the root; every capability dropped
  before the code runs (it cannot unmount what hides the host).
- ``rlimits``: resource limits, plus an audit hook for Python code (best effort). As root, each
  episode runs as a uid of its own (:data:`EPISODE_UIDS`); otherwise the code would run as the
  trainer's user and the mode is refused unless ``Config.accept_weak_isolation`` is set.

Edges (``tests/test_sandbox_edges.py`` proves each in every mode the machine has, with the
trainer as root and as an unprivileged user):

- *Signals*: the code cannot signal the trainer or any process outside its episode (``kill``,
  ``os.kill``, ``pidfd_send_signal``): ``bwrap``/``namespace``: no process outside the PID
  namespace has a pid there; ``rlimits`` as root: another uid. Weak ``rlimits``: not held.
- *Survivors*: every process a command started ends when it exits or times out, ``setsid`` or
  not: the PID namespace dies with its pid 1; ``rlimits`` as root kills every process of the
  episode's uid; weak ``rlimits``: the processes carrying the run's environment mark (best
  effort: code that clears its environment escapes).
- *Trainer's environment*: ``/proc/<trainer>/environ`` is out of reach (a fresh ``/proc``; or
  another uid). Weak ``rlimits``: readable.
- *Other episodes' files*: hidden (empty ``/tmp`` and parent) in the namespace modes; ``0700``
  roots owned by another uid in ``rlimits`` as root. Weak ``rlimits``: readable.

``isolation: auto`` picks the first that works here, in that order.

=========================  =====================================================================
limit                      mechanism
=========================  =====================================================================
wall time                  the parent kills the whole process group (SIGKILL) after
                           ``timeout_s``; ``res.timed_out`` is set (``bwrap``: the PID namespace
                           dies with it). Enforced in every mode.
CPU time                   ``RLIMIT_CPU`` (SIGXCPU at ``cpu_time_s``). Enforced.
memory                     ``RLIMIT_AS`` = ``memory_mb`` of address space per process:
                           allocations beyond it fail (``MemoryError`` in Python). Enforced.
processes                  ``RLIMIT_NPROC`` = ``max_processes`` tasks (a fork bomb gets EAGAIN).
                           The kernel ignores it for root, so a trainer running as root runs the
                           code as an episode uid (``Config.drop_root``). Enforced; inside a user
                           namespace it counts only the sandbox's own tasks.
file size                  ``RLIMIT_FSIZE`` = ``file_size_mb`` per file, including the captured
                           stdout/stderr. Enforced.
open files, core dumps     ``RLIMIT_NOFILE`` = ``max_open_files``; ``RLIMIT_CORE`` = 0. Enforced.
no network                 ``bwrap``/``namespace``: an empty network namespace (only a down
                           loopback). Enforced by the kernel. ``rlimits``: Python code only, by an
                           audit hook refusing socket connect/bind/sendto and name lookups (best
                           effort); shell commands are not restricted.
writes only in the root    ``bwrap``/``namespace``: everything else is mounted read-only
                           (``bwrap`` also hides the host's ``/tmp``). Enforced by the kernel.
                           ``rlimits``: Python code only, by the audit hook (best effort); shell
                           commands only by file permissions (an episode uid when dropping root).
no child processes         Python code run with :meth:`Sandbox.run`: the audit hook refuses
(Python code)              ``subprocess``, ``exec*``, ``fork`` and ``ctypes`` (best effort).
                           Shell commands may start processes, up to ``max_processes``.
environment                only ``PATH``, ``HOME``, ``TMPDIR``, ``LANG`` and ``Config.env``; Python
                           runs isolated (``-I``). Enforced.
=========================  =====================================================================

Reading world-readable files outside the root is not prevented (the interpreter and its
libraries must be readable); the other episodes' roots are hidden (see *Edges*). The commands
of one episode run one at a time (a command's end kills what the episode's uid still runs).

The command line ``python -m rl_agents.tools --root DIR [--config JSON] -- ARGV...``
runs one command in an existing root (an agent's shell tool), passing its output through and
exiting with its status (128 + signal number when killed; 124 on timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from rl_core.config import PositiveFloat, PositiveInt
from rl_core.errors import ConfigError, DataError

__all__ = [
    "Episode",
    "Sandbox",
    "SandboxResult",
    "bwrap_available",
    "isolation_modes",
    "namespaces_available",
]

NOBODY = 65534
"""The uid that probes whether an unprivileged user can run the interpreter (``drop_root``)."""

EPISODE_UIDS = range(0x60000000, 0x60000000 + (1 << 24))
"""The uids (and gids) sandboxed code runs as when the trainer is root (``Config.drop_root``):
each episode gets one of its own, unused by any running process, so episodes cannot signal or
read each other (or the trainer), and the episode's processes are found by their uid."""

_RUN_MARK = "RL_SANDBOX_RUN"
_uids_taken: set[int] = set()
_uids_lock = threading.Lock()

# Runs as pid 1 and root of fresh user, PID, mount and network namespaces (``unshare --pid
# --fork --mount-proc``: a /proc that shows only this namespace's processes). Hides the episode
# roots' directories (/tmp and the root's parent) under empty tmpfs mounts and binds the root
# back (through the working directory, which still holds it), makes every other mount
# read-only, then drops every capability (so the code cannot unmount what hides the host's
# /proc or the other roots) and runs the interpreter; it exits with its status (128 + n when
# signal n killed it). When pid 1 exits or is killed, the kernel kills every other process of
# the namespace, ``setsid`` or not.
_NS_SCRIPT = r"""
set -e
wd="$1"; shift
cd "$wd"
while [ "$1" != "--" ]; do mount -t tmpfs -o mode=755,size=1m none "$1"; shift; done
shift
if [ -d "$wd" ]; then
  mount --bind "$wd" "$wd"
else
  mkdir -p "$wd"
  mount --no-canonicalize --bind /proc/self/cwd "$wd"
fi
cd "$wd"
awk '{print $2}' /proc/self/mounts | while read -r m; do
  m=$(printf '%b' "$m")
  [ "$m" = "$wd" ] && continue
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
setpriv --bounding-set=-all --inh-caps=-all --no-new-privs -- "$@" || exit $?
"""

# The child's first code: limits, audit hook, then the user's program as __main__.
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
wd = os.path.realpath(cfg["wd"])
for name, soft, hard in cfg["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
if cfg["nproc"]:
    # RLIMIT_NPROC counts the real user's tasks: all of them without a user namespace of our own
    # (then allow the ones already running), only the namespace's own inside one.
    base = 0
    if not cfg["own_userns"]:
        uid = os.getuid()
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                    base += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    resource.setrlimit(resource.RLIMIT_NPROC, (base + cfg["nproc"], base + cfg["nproc"]))
os.chdir(wd)
sys.path.insert(0, wd)
if cfg["check_ro"]:
    assert os.statvfs("/").f_flag & os.ST_RDONLY, "sandbox: / is not read-only"
if cfg.get("exec"):  # a command (the shell tool): limits only, no audit hook
    os.execvp(cfg["exec"][0], cfg["exec"])
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove": 1, "os.rename": 2, "os.mkdir": 1, "os.rmdir": 1, "os.chmod": 1,
                "os.chown": 1, "os.link": 2, "os.symlink": 2, "os.truncate": 1, "os.utime": 1,
                "shutil.rmtree": 1, "shutil.copyfile": 2, "shutil.move": 2, "os.mkfifo": 1,
                "os.mknod": 1}
_DENY = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "pty.spawn", "os.kill", "os.killpg", "socket.connect", "socket.bind",
         "socket.sendto", "socket.sendmsg", "socket.getaddrinfo", "socket.gethostbyname",
         "socket.gethostbyaddr", "ctypes.", "winreg.")

def _inside(p):
    if isinstance(p, int):
        return True
    try:
        p = os.fsdecode(p)
    except TypeError:
        return False
    if p == os.devnull:
        return True
    real = os.path.realpath(os.path.join(wd, p))
    return real == wd or real.startswith(wd + os.sep)

def _hook(event, args):
    if event.startswith(_DENY):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox directory")
    elif event in _PATH_EVENTS:
        for p in args[:_PATH_EVENTS[event]]:
            if p is not None and not _inside(p):
                raise PermissionError(f"sandbox: {event} on {p!r} outside the sandbox directory")

sys.addaudithook(_hook)
del json, resource
_code = open(os.path.join(wd, cfg["main"]), encoding="utf-8").read()
_g = {"__name__": "__main__", "__file__": cfg["main"], "__builtins__": __builtins__}
del cfg
exec(compile(_code, _g["__file__"], "exec"), _g)
"""


def _is_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def _drop_root_kwargs(drop: bool, uid: int = NOBODY) -> dict:
    """``Popen`` arguments that run the child as ``uid`` when we are root."""
    if drop and _is_root():
        return {"user": uid, "group": uid, "extra_groups": []}
    return {}


def _uid_in_use(uid: int) -> bool:
    """True when a live (not zombie) process runs as ``uid``."""
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rpartition(")")[2].split()[0] not in ("Z", "X"):
                        return True
        except (OSError, IndexError):
            pass
    return False


def _new_episode_uid() -> int:
    """A uid from :data:`EPISODE_UIDS` that no running process and no other episode of this
    process uses."""
    rng = random.SystemRandom()
    with _uids_lock:
        while True:
            uid = rng.choice(EPISODE_UIDS)
            if uid not in _uids_taken and not _uid_in_use(uid):
                _uids_taken.add(uid)
                return uid


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` (``kill -KILL -1`` run as ``uid`` reaches exactly the
    processes that uid owns, however they detached: ``setsid``, double forks)."""
    kill = shutil.which("kill", path="/usr/bin:/bin") or "kill"
    for _ in range(20):
        if not _uid_in_use(uid):
            return
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(
                [kill, "-KILL", "-1"],
                capture_output=True,
                timeout=10,
                **_drop_root_kwargs(True, uid),
            )
        time.sleep(0.05)


def _kill_marked(mark: str) -> None:
    """SIGKILL this user's processes whose environment holds ``RL_SANDBOX_RUN=mark`` (best
    effort: code that clears its environment escapes this)."""
    needle = f"{_RUN_MARK}={mark}".encode()
    me, quiet = os.getpid(), 0
    for _ in range(50):  # until two passes find none (a process mid-exec shows no environ)
        found = False
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == me:
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        os.kill(int(pid), signal.SIGKILL)
                        found = True
            except OSError:
                pass
        quiet = 0 if found else quiet + 1
        if quiet >= 2:
            return
        time.sleep(0.02)


@functools.cache
def _nobody_can_run(python: str) -> bool:
    try:
        proc = subprocess.run(
            [python, "-I", "-c", "import json, resource"],
            capture_output=True,
            timeout=30,
            **_drop_root_kwargs(True),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def _interpreter(python: str, drop: bool) -> tuple[str, bool]:
    """The interpreter to run and whether to drop root: as root, code runs as ``nobody``, so
    the interpreter must be runnable by ``nobody`` (a virtual environment under ``/root`` is
    not): fall back to the system's ``python3``, or keep root when none is."""
    if not (drop and _is_root()) or _nobody_can_run(python):
        return python, drop
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system is not None and _nobody_can_run(system):
        return system, True
    return python, False


def _hidden_dirs(wd: str, python: str) -> list[str]:
    """The directories the namespace modes hide under empty mounts: ``/tmp`` and the root's
    parent (where other episodes' roots live), except ``/`` and any that holds the
    interpreter's installation (a virtual environment beside the root stays visible)."""
    exe = os.path.abspath(python)
    keep = {os.path.dirname(os.path.dirname(p)) for p in (exe, os.path.realpath(exe))}

    def holds_interpreter(d: str) -> bool:
        return any(k == d or k.startswith(d.rstrip("/") + "/") for k in keep)

    out: list[str] = []
    for d in ("/tmp", os.path.dirname(wd)):
        if d == "/" or holds_interpreter(d) or d in out:
            continue
        if any(d.startswith(h + "/") for h in out):  # already under a hidden one
            continue
        out.append(d)
    return out


def _unshare_argv(exe: str) -> list[str]:
    return [exe, "-rnm", "--pid", "--fork", "--kill-child", "--mount-proc", "--propagation",
            "private"]  # fmt: skip


@functools.cache
def namespaces_available(drop_root: bool = True) -> bool:
    """True when ``unshare -rnm --pid --fork --mount-proc`` and ``setpriv`` work here
    (unprivileged user, network, mount and PID namespaces): the ``namespace`` isolation mode
    can run."""
    exe = shutil.which("unshare")
    if exe is None or shutil.which("setpriv") is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run(
            [*_unshare_argv(exe), "setpriv", "--bounding-set=-all", "--", "true"],
            capture_output=True,
            timeout=10,
            **_drop_root_kwargs(drop_root),
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


@functools.cache
def bwrap_available(drop_root: bool = True) -> bool:
    """True when bubblewrap (``bwrap``) is installed and can create its namespaces here: the
    ``bwrap`` isolation mode can run."""
    exe = shutil.which("bwrap")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run(
            [exe, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--unshare-all",
             "--die-with-parent", "true"],
            capture_output=True,
            timeout=10,
            **_drop_root_kwargs(drop_root),
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


def isolation_modes() -> list[str]:
    """The isolation modes that run on this machine, strongest first (``rlimits`` always)."""
    return [
        m for m, ok in (("bwrap", bwrap_available()), ("namespace", namespaces_available())) if ok
    ] + ["rlimits"]


@dataclass(frozen=True, slots=True)
class SandboxResult:
    """What a sandboxed run did."""

    stdout: str
    """Captured standard output (at most ``max_output_bytes``, decoded with replacement)."""
    stderr: str
    """Captured standard error (same cap); a Python traceback ends up here."""
    exit_code: int | None
    """The process's exit status; ``None`` when it was ended by a signal."""
    signal: str | None
    """Name of the signal that ended it (``SIGKILL`` after a timeout, ``SIGXCPU``, ...)."""
    timed_out: bool
    """The wall-time limit was hit and the process group killed."""
    duration_s: float
    """Wall time from start to exit."""
    isolation: str
    """The mode that ran: ``bwrap``, ``namespace`` or ``rlimits``."""
    truncated: bool = False
    """stdout or stderr was longer than ``max_output_bytes`` and was cut."""

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """Runs code in limited subprocesses; see the module docstring for what is enforced."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Limits of one :meth:`Sandbox.run` (or of each command of an :class:`Episode`)."""

        timeout_s: PositiveFloat = 10.0
        """Wall-clock seconds before the process group is killed."""
        cpu_time_s: PositiveInt = 10
        """CPU seconds per process (``RLIMIT_CPU``)."""
        memory_mb: PositiveInt = 512
        """Address space per process in MiB (``RLIMIT_AS``); Python itself needs ~30 MiB."""
        max_processes: PositiveInt = 32
        """Processes (and threads) at most (``RLIMIT_NPROC``): stops fork bombs."""
        file_size_mb: PositiveInt = 16
        """Largest file the code may write, in MiB (``RLIMIT_FSIZE``; also caps stdout/stderr)."""
        max_open_files: PositiveInt = 64
        """Open file descriptors at most (``RLIMIT_NOFILE``)."""
        max_output_bytes: PositiveInt = 65536
        """Bytes of stdout and of stderr kept in the result."""
        isolation: Literal["auto", "bwrap", "namespace", "rlimits"] = "auto"
        """``bwrap`` (bubblewrap), ``namespace`` (``unshare``), ``rlimits`` (limits and the audit
        hook only), or ``auto``: the first of these that works here."""
        drop_root: bool = True
        """When the trainer runs as root, run each episode's code as a uid of its own from
        :data:`EPISODE_UIDS` (the kernel does not apply the process limit to root, and a uid
        of its own keeps the code away from the trainer's and other episodes' processes and
        files)."""
        accept_weak_isolation: bool = False
        """Let the ``rlimits`` mode run where it cannot keep the code from signalling the
        trainer, reading its environment (``/proc/<pid>/environ``) and other episodes' files
        (the trainer is not root, so the code runs as the trainer's own user; or ``drop_root``
        is off). Off: such a sandbox is refused with a ConfigError."""
        python: str = field(default_factory=lambda: sys.executable)
        """The interpreter that runs Python code (and the launcher of shell commands)."""
        env: dict[str, str] = field(default_factory=dict)
        """Extra environment variables for the code."""
        max_concurrent: PositiveInt | None = None
        """Sandboxed commands running at once at most, over every episode of this
        :class:`Sandbox` (the others wait their turn: agent sessions share the machine);
        ``None``: no limit besides the sessions running (``generate_fn.max_sessions``)."""

        def __post_init__(self) -> None:
            for name in ("timeout_s", "cpu_time_s", "memory_mb", "max_processes",
                         "file_size_mb", "max_open_files", "max_output_bytes"):  # fmt: skip
                if not getattr(self, name) > 0:
                    raise ConfigError(f"sandbox.{name}: must be > 0, got {getattr(self, name)}.")
            n = self.max_concurrent
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ConfigError(
                    f"sandbox.max_concurrent: a whole number >= 1 or null, got {n!r}."
                )
            if self.isolation not in ("auto", "bwrap", "namespace", "rlimits"):
                raise ConfigError(
                    "sandbox.isolation: expected auto, bwrap, namespace or rlimits, got "
                    f"{self.isolation!r}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Sandbox.Config()
        mode, drop = self.config.isolation, self.config.drop_root
        if mode == "bwrap" and not bwrap_available(drop):
            raise ConfigError(
                "sandbox.isolation: 'bwrap' needs bubblewrap working here (`bwrap --ro-bind / / "
                "--unshare-all true` fails or bwrap is not installed); install it (apt-get install "
                "bubblewrap) or use isolation: auto."
            )
        if mode == "namespace" and not namespaces_available(drop):
            raise ConfigError(
                "sandbox.isolation: 'namespace' needs unprivileged user namespaces (`unshare -rnm "
                "true` fails here); enable them (sysctl kernel.unprivileged_userns_clone=1) or use "
                "isolation: auto, which falls back to rlimits (best effort only)."
            )
        if mode == "auto":
            mode = (
                "bwrap" if bwrap_available(drop)
                else "namespace" if namespaces_available(drop) else "rlimits"
            )  # fmt: skip
        self.isolation: str = mode
        """The mode runs use: ``bwrap``, ``namespace`` or ``rlimits``."""
        n = self.config.max_concurrent
        self._slots = threading.BoundedSemaphore(n) if n is not None else None
        self._lock = threading.Lock()
        self.running = 0
        """Commands running now (at most ``Config.max_concurrent``)."""
        self.peak_running = 0
        """The most commands that ran at once."""
        self.python, drops = _interpreter(self.config.python, drop)
        self.drops_root: bool = drops and _is_root()
        """The interpreter runs use, and whether they run as an episode uid of their own (see
        ``Config.drop_root``: as root, a ``python`` that ``nobody`` cannot run is replaced by
        the system's ``python3``; without one, runs stay root and the process limit is not
        enforced)."""
        self.strong: bool = mode != "rlimits" or self.drops_root
        """The code cannot signal the trainer, read its environment or other episodes' files,
        and no process of it outlives its command: a namespace mode, or ``rlimits`` with a uid
        of its own per episode."""
        if not self.strong and not self.config.accept_weak_isolation:
            why = (
                "the trainer is not root (so the code would run as the trainer's own user)"
                if not _is_root()
                else "drop_root is off" if not drop
                else "no Python here is runnable by an unprivileged user"
            )  # fmt: skip
            raise ConfigError(
                f"sandbox.isolation: the 'rlimits' mode cannot isolate the code here: {why}, so "
                "it could signal or kill the trainer, read the trainer's environment through "
                "/proc and other episodes' files. Make user namespaces available (the "
                "'namespace' mode: `unshare -rnm --pid --fork --mount-proc true` must work) or "
                "install bubblewrap, run the trainer as root (each episode then runs as a uid "
                "of its own), or accept this explicitly with sandbox.accept_weak_isolation: true."
            )

    # ------------------------------------------------------------------------------ public
    def run(
        self, code: str, *, stdin: str = "", files: Mapping[str, str | bytes] | None = None
    ) -> SandboxResult:
        """Run Python ``code`` as ``__main__`` in a fresh root holding ``files`` (relative
        paths), with the audit hook on top of the isolation."""
        with self.episode(files) as ep:
            return ep.run(code, stdin=stdin)

    async def arun(
        self, code: str, *, stdin: str = "", files: Mapping[str, str | bytes] | None = None
    ) -> SandboxResult:
        """:meth:`run` in a worker thread, for async rollouts."""
        return await asyncio.to_thread(self.run, code, stdin=stdin, files=files)

    @contextlib.contextmanager
    def episode(
        self, files: Mapping[str, str | bytes] | None = None, *, root: Path | None = None
    ) -> Iterator[Episode]:
        """A private root for several runs (an agent episode), deleted on exit; ``root``
        uses an existing directory instead (kept on exit)."""
        ep = Episode(self, root)
        try:
            for name, content in (files or {}).items():
                ep.write_file(name, content)
            yield ep
        finally:
            ep.close()

    # ------------------------------------------------------------------------------ launch
    def launch(
        self,
        root: Path,
        *,
        code_file: str | None = None,
        argv: Sequence[str] = (),
        stdin: str = "",
        uid: int | None = None,
    ) -> SandboxResult:
        """Run ``code_file`` (Python, audit hook on) or ``argv`` (a command) in ``root``, as
        ``uid`` when the sandbox drops root (an :class:`Episode`'s own; ``None``: a fresh one).
        Every process the command started is killed when it ends or times out. With
        ``Config.max_concurrent``, waits for a free slot first (the time limit starts when the
        command does)."""
        with self._slots if self._slots is not None else contextlib.nullcontext():
            with self._lock:
                self.running += 1
                self.peak_running = max(self.peak_running, self.running)
            try:
                return self._launch(root, code_file=code_file, argv=argv, stdin=stdin, uid=uid)
            finally:
                with self._lock:
                    self.running -= 1

    def _launch(
        self,
        root: Path,
        *,
        code_file: str | None,
        argv: Sequence[str],
        stdin: str,
        uid: int | None,
    ) -> SandboxResult:
        if uid is None and self.drops_root:
            uid = _new_episode_uid()
            _give_away(root, uid)
        c = self.config
        mib = 1024 * 1024
        limits = [
            ("RLIMIT_CPU", c.cpu_time_s, c.cpu_time_s + 1),
            ("RLIMIT_AS", c.memory_mb * mib, c.memory_mb * mib),
            ("RLIMIT_FSIZE", c.file_size_mb * mib, c.file_size_mb * mib),
            ("RLIMIT_NOFILE", c.max_open_files, c.max_open_files),
            ("RLIMIT_CORE", 0, 0),
        ]
        wd = str(root)
        mode = self.isolation
        cfg = {
            "wd": wd,
            "main": code_file,
            "exec": list(argv) if code_file is None else None,
            "limits": limits,
            "nproc": c.max_processes,
            "own_userns": mode != "rlimits",
            "check_ro": mode != "rlimits",
        }
        inner = [self.python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
        if mode == "bwrap":
            hide = [a for d in _hidden_dirs(wd, self.python) for a in ("--tmpfs", d)]
            argv_ = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev",
                     "--proc", "/proc", *hide, "--bind", wd, wd,
                     "--unshare-all", "--die-with-parent", "--chdir", wd, "--",
                     *inner]  # fmt: skip
        elif mode == "namespace":
            unshare = shutil.which("unshare") or "unshare"
            argv_ = [*_unshare_argv(unshare), "sh", "-c", _NS_SCRIPT, "sh"]
            argv_ += [wd, *_hidden_dirs(wd, self.python), "--", *inner]
        else:
            argv_ = inner
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": wd,
            "TMPDIR": wd,
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **c.env,
        }
        mark = uuid.uuid4().hex
        if mode == "rlimits" and not self.drops_root:
            env[_RUN_MARK] = mark
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv_,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=wd,
                env=env,
                start_new_session=True,
                **_drop_root_kwargs(self.drops_root, NOBODY if uid is None else uid),
            )
            timed_out = False
            ns_init = _ns_init(proc.pid) if mode == "namespace" else None
            try:
                proc.communicate(stdin.encode(), timeout=c.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            finally:
                _kill_group(proc.pid)  # children the code left behind
                # ... and those that left the group (setsid): the namespace modes' PID
                # namespace died with its pid 1; here, by uid, or by the run's mark.
                if ns_init is not None:  # killing unshare does not wait for its namespace
                    _end_namespace(*ns_init)
                if mode == "rlimits" and self.drops_root and uid is not None:
                    _kill_uid(uid)
                elif mode == "rlimits":
                    _kill_marked(mark)
            duration = time.monotonic() - t0
            stdout, t1 = _read(out, c.max_output_bytes)
            stderr, t2 = _read(err, c.max_output_bytes)
        rc = proc.returncode
        if mode in ("bwrap", "namespace") and rc is not None and rc > 128:
            # bwrap's init (our pid 1 shell) exits 128 + n when the command died of signal n.
            with contextlib.suppress(ValueError):
                rc = -signal.Signals(rc - 128).value
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
        if timed_out:
            sig = "SIGKILL"
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=rc if rc is not None and rc >= 0 and not timed_out else None,
            signal=sig,
            timed_out=timed_out,
            duration_s=duration,
            isolation=mode,
            truncated=t1 or t2,
        )


class Episode:
    """A private root shared by several sandboxed runs (one agent episode): files written
    by one command are there for the next. Made by :meth:`Sandbox.episode`."""

    def __init__(self, sandbox: Sandbox, root: Path | None = None) -> None:
        self.sandbox = sandbox
        self._owned = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="rl-sandbox-")).resolve()
        """The episode's directory (working directory, ``HOME`` and ``TMPDIR`` of its runs)."""
        self._runs = 0
        self.uid: int | None = _new_episode_uid() if sandbox.drops_root else None
        """The uid the episode's code runs as (its own, from :data:`EPISODE_UIDS`), or ``None``
        when it runs as the trainer's user (see ``Sandbox.Config.drop_root``)."""
        if self._owned:
            self.root.chmod(0o700)
        _give_away(self.root, self.uid)

    def path(self, name: str) -> Path:
        """``root / name`` for a relative path inside the root; DataError otherwise."""
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise DataError(f"sandbox files: {name!r} must be a relative path inside it.")
        return self.root / rel

    def write_file(self, name: str, content: str | bytes) -> Path:
        """Write a file into the root (a file-write tool); returns its path."""
        dest = self.path(name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(content.encode() if isinstance(content, str) else content)
        _give_away(self.root, self.uid)
        return dest

    def read_file(self, name: str) -> str | None:
        """A file's text, or ``None`` when it does not exist."""
        p = self.path(name)
        return p.read_text(errors="replace") if p.is_file() else None

    def run(self, code: str, *, stdin: str = "") -> SandboxResult:
        """Run Python ``code`` in the root (audit hook on)."""
        self._runs += 1
        name = f".sandbox_main_{self._runs}.py"
        self.write_file(name, code)
        try:
            return self.sandbox.launch(self.root, code_file=name, stdin=stdin, uid=self.uid)
        finally:
            with contextlib.suppress(OSError):
                (self.root / name).unlink()

    def exec(self, argv: Sequence[str], *, stdin: str = "") -> SandboxResult:
        """Run a command (``argv``) in the root."""
        if not argv:
            raise DataError("sandbox exec: empty command.")
        return self.sandbox.launch(self.root, argv=argv, stdin=stdin, uid=self.uid)

    def shell(self, command: str, *, stdin: str = "") -> SandboxResult:
        """Run a shell command (``sh -c``) in the root (a shell tool)."""
        return self.exec(["sh", "-c", command], stdin=stdin)

    def close(self) -> None:
        """Kill what is left of the episode's processes; delete the root (when the episode
        made it)."""
        if self.uid is not None:
            _kill_uid(self.uid)
            with _uids_lock:
                _uids_taken.discard(self.uid)
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)


def _give_away(root: Path, uid: int | None) -> None:
    """Make the root the code's own when it runs as ``uid`` (an episode's own)."""
    if uid is None or not _is_root():
        return
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [dirpath, *(os.path.join(dirpath, n) for n in dirnames + filenames)]:
            with contextlib.suppress(OSError):
                os.chown(name, uid, uid, follow_symlinks=False)


def _ns_init(unshare_pid: int) -> tuple[int, str] | None:
    """The pid 1 of the PID namespace ``unshare --fork`` (``unshare_pid``) made, and the
    namespace's id (``/proc/<pid>/ns/pid``); ``None`` when it already ended."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{unshare_pid}/task/{unshare_pid}/children") as f:
                kids = f.read().split()
            if kids:
                return int(kids[0]), os.readlink(f"/proc/{kids[0]}/ns/pid")
        except (OSError, ValueError):
            return None
        time.sleep(0.001)
    return None


def _end_namespace(pid: int, ns: str) -> None:
    """SIGKILL the namespace's pid 1 and wait until the namespace is empty: the kernel kills
    and reaps every other process of it before pid 1 becomes a zombie."""
    deadline = time.monotonic() + 10.0
    killed = False
    while time.monotonic() < deadline:
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") != ns:
                return  # gone, and the pid taken by another process
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            return
        if state in ("Z", "X"):
            return
        if not killed:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            killed = True
        time.sleep(0.002)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read(f, limit: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rl_agents.tools --root DIR [--config JSON] -- ARGV...``: run one
    command in ``DIR`` under the sandbox; print its output; exit with its status."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m rl_agents.tools")
    parser.add_argument("--root", required=True, help="the episode's root directory")
    parser.add_argument("--config", default="{}", help="Sandbox.Config fields as JSON")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = parser.parse_args(argv)
    cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not cmd:
        parser.error("give a command after --")
    try:
        config = Sandbox.Config(**json.loads(args.config))
    except (TypeError, json.JSONDecodeError) as e:
        parser.error(f"--config: {e}")
    box = Sandbox(config)
    with box.episode(root=Path(args.root)) as ep:
        res = ep.exec(cmd, stdin="" if sys.stdin.isatty() else sys.stdin.read())
    sys.stdout.write(res.stdout)
    sys.stderr.write(res.stderr)
    if res.timed_out:
        sys.stderr.write(f"sandbox: killed after {config.timeout_s}s\n")
        return 124
    if res.signal is not None:
        return 128 + signal.Signals[res.signal].value
    return int(res.exit_code or 0)


def config_json(config: Sandbox.Config) -> str:
    """``config`` as the JSON the command line's ``--config`` takes."""
    return json.dumps(asdict(config))
