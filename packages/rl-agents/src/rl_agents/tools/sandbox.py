"""Run untrusted Python (model-written code) in a subprocess with limits, for code-execution tools.

::

    box = Sandbox(Sandbox.Config(timeout_s=5, memory_mb=256))
    res = box.run("print(sum(range(10)))")
    res.ok, res.stdout        # True, "45\\n"

What is enforced, and how (``res.isolation`` says which mode ran):

=========================  =====================================================================
limit                      mechanism
=========================  =====================================================================
wall time                  the parent kills the whole process group (SIGKILL) after
                           ``timeout_s``; ``res.timed_out`` is set. Enforced.
CPU time                   ``RLIMIT_CPU`` (SIGXCPU at ``cpu_time_s``, SIGKILL one second later).
                           Enforced by the kernel.
memory                     ``RLIMIT_AS`` = ``memory_mb`` of address space: allocations beyond it
                           fail (``MemoryError`` in Python). Enforced by the kernel.
file size                  ``RLIMIT_FSIZE`` = ``file_size_mb`` per file, including the captured
                           stdout/stderr (so a runaway printer cannot fill the disk). Enforced.
open files, core dumps     ``RLIMIT_NOFILE`` = ``max_open_files``; ``RLIMIT_CORE`` = 0. Enforced.
no network                 ``namespace`` mode: the code runs in a new, empty network namespace
                           (``unshare --net`` inside a user namespace): no interface but a down
                           loopback, so nothing is reachable. Enforced by the kernel. In every
                           mode an audit hook also refuses ``socket`` connect/bind/sendto and
                           name lookups: best effort (native code can bypass audit hooks).
writes only in its         ``namespace`` mode: a private mount namespace where every mount is
directory                  remounted read-only except the run's fresh temporary directory (its
                           working directory and ``HOME``). Enforced by the kernel. In every mode
                           the audit hook also refuses opening for writing, removing, renaming,
                           creating or changing files outside that directory: best effort.
no child processes         the audit hook refuses ``subprocess``, ``os.system``, ``exec*``,
                           ``spawn*``, ``fork`` and ``ctypes`` (a child would run without the
                           hook): best effort.
environment                only ``PATH``, ``HOME``, ``LANG`` and ``Config.env`` are passed; the
                           interpreter runs isolated (``-I``: no ``PYTHON*`` variables, no user
                           site). Enforced.
=========================  =====================================================================

``namespace`` mode needs unprivileged user namespaces (``unshare -rnm`` must work); ``auto``
uses it when it does and falls back to ``rlimits`` (rlimits + audit hook only), which is *not*
a security boundary against hostile native code. Reading files outside the directory is not
prevented in either mode (the interpreter and its libraries must be readable).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Literal

from rl_core.config import PositiveFloat, PositiveInt
from rl_core.errors import ConfigError, DataError

__all__ = ["Sandbox", "SandboxResult", "namespaces_available"]

# Runs as root of a fresh user+mount+net namespace: keep the run directory writable (a bind
# mount of its own), make every other mount read-only, then exec the interpreter.
_NS_SCRIPT = r"""
set -e
wd="$1"; shift
mount --bind "$wd" "$wd"
awk '{print $2}' /proc/self/mounts | while read -r m; do
  m=$(printf '%b' "$m")
  [ "$m" = "$wd" ] && continue
  mount -o remount,bind,ro "$m" 2>/dev/null || true
done
exec "$@"
"""

# The child's first code: limits, audit hook, then the user's program as __main__.
_BOOTSTRAP = r"""
import json, os, resource, sys
cfg = json.loads(sys.argv[1])
wd = os.path.realpath(cfg["wd"])
for name, soft, hard in cfg["limits"]:
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.chdir(wd)
sys.path.insert(0, wd)
if cfg["check_ro"]:
    assert os.statvfs("/").f_flag & os.ST_RDONLY, "sandbox: / is not read-only"
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


@functools.cache
def namespaces_available() -> bool:
    """True when ``unshare -rnm`` works here (unprivileged user, network and mount
    namespaces): the ``namespace`` isolation mode can run."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return False
    try:
        proc = subprocess.run(
            [exe, "-rnm", "--propagation", "private", "true"],
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0


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
    """The mode that ran: ``namespace`` or ``rlimits``."""
    truncated: bool = False
    """stdout or stderr was longer than ``max_output_bytes`` and was cut."""

    @property
    def ok(self) -> bool:
        """Exited normally with status 0."""
        return self.exit_code == 0 and not self.timed_out


class Sandbox:
    """Runs Python code in a limited subprocess; see the module docstring for what is enforced."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Limits of one :meth:`Sandbox.run`."""

        timeout_s: PositiveFloat = 10.0
        """Wall-clock seconds before the process group is killed."""
        cpu_time_s: PositiveInt = 10
        """CPU seconds (``RLIMIT_CPU``)."""
        memory_mb: PositiveInt = 512
        """Address space in MiB (``RLIMIT_AS``); Python itself needs ~30 MiB."""
        file_size_mb: PositiveInt = 16
        """Largest file the code may write, in MiB (``RLIMIT_FSIZE``; also caps stdout/stderr)."""
        max_open_files: PositiveInt = 64
        """Open file descriptors at most (``RLIMIT_NOFILE``)."""
        max_output_bytes: PositiveInt = 65536
        """Bytes of stdout and of stderr kept in the result."""
        isolation: Literal["auto", "namespace", "rlimits"] = "auto"
        """``namespace``: user + network + mount namespaces (kernel-enforced no-network and
        read-only filesystem outside the run directory); ``rlimits``: resource limits and the
        audit hook only; ``auto``: ``namespace`` when available."""
        python: str = field(default_factory=lambda: sys.executable)
        """The interpreter that runs the code."""
        env: dict[str, str] = field(default_factory=dict)
        """Extra environment variables for the code."""

        def __post_init__(self) -> None:
            for name in ("timeout_s", "cpu_time_s", "memory_mb", "file_size_mb", "max_open_files"):
                if not getattr(self, name) > 0:
                    raise ConfigError(f"sandbox.{name}: must be > 0, got {getattr(self, name)}.")
            if self.isolation not in ("auto", "namespace", "rlimits"):
                raise ConfigError(
                    "sandbox.isolation: expected auto, namespace or rlimits, got "
                    f"{self.isolation!r}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or Sandbox.Config()
        mode = self.config.isolation
        if mode == "namespace" and not namespaces_available():
            raise ConfigError(
                "sandbox.isolation: 'namespace' needs unprivileged user namespaces (`unshare -rnm "
                "true` fails here); enable them (sysctl kernel.unprivileged_userns_clone=1) or use "
                "isolation: rlimits, which is best effort only."
            )
        self.isolation: str = (
            "namespace" if mode == "namespace" or (mode == "auto" and namespaces_available())
            else "rlimits"
        )  # fmt: skip
        """The mode runs use."""

    def run(
        self, code: str, *, stdin: str = "", files: Mapping[str, str | bytes] | None = None
    ) -> SandboxResult:
        """Run ``code`` as ``__main__`` in a fresh directory holding ``files`` (relative paths)."""
        wd = Path(tempfile.mkdtemp(prefix="rl-sandbox-")).resolve()
        try:
            for name, content in (files or {}).items():
                rel = PurePosixPath(name)
                if rel.is_absolute() or ".." in rel.parts or not rel.parts:
                    raise DataError(f"sandbox files: {name!r} must be a relative path inside it.")
                dest = wd / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                data = content.encode() if isinstance(content, str) else content
                dest.write_bytes(data)
            main = "__sandbox_main__.py"
            (wd / main).write_text(code, encoding="utf-8")
            return self._run(wd, main, stdin)
        finally:
            shutil.rmtree(wd, ignore_errors=True)

    async def arun(
        self, code: str, *, stdin: str = "", files: Mapping[str, str | bytes] | None = None
    ) -> SandboxResult:
        """:meth:`run` in a worker thread, for async rollouts."""
        return await asyncio.to_thread(self.run, code, stdin=stdin, files=files)

    def _run(self, wd: Path, main: str, stdin: str) -> SandboxResult:
        c = self.config
        mib = 1024 * 1024
        limits = [
            ("RLIMIT_CPU", c.cpu_time_s, c.cpu_time_s + 1),
            ("RLIMIT_AS", c.memory_mb * mib, c.memory_mb * mib),
            ("RLIMIT_FSIZE", c.file_size_mb * mib, c.file_size_mb * mib),
            ("RLIMIT_NOFILE", c.max_open_files, c.max_open_files),
            ("RLIMIT_CORE", 0, 0),
        ]
        ns = self.isolation == "namespace"
        cfg = {"wd": str(wd), "main": main, "limits": limits, "check_ro": ns}
        argv = [c.python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]
        if ns:
            unshare = shutil.which("unshare") or "unshare"
            argv = [unshare, "-rnm", "--propagation", "private", "sh", "-c", _NS_SCRIPT, "sh"]
            argv += [str(wd), *[c.python, "-I", "-c", _BOOTSTRAP, json.dumps(cfg)]]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(wd),
            "LANG": "C.UTF-8",
            "PYTHONDONTWRITEBYTECODE": "1",
            **c.env,
        }
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=err,
                cwd=wd,
                env=env,
                start_new_session=True,
            )
            timed_out = False
            try:
                proc.communicate(stdin.encode(), timeout=c.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc.pid)
                proc.wait()
            finally:
                _kill_group(proc.pid)  # children the code left behind
            duration = time.monotonic() - t0
            stdout, t1 = _read(out, c.max_output_bytes)
            stderr, t2 = _read(err, c.max_output_bytes)
        rc = proc.returncode
        sig = signal.Signals(-rc).name if rc is not None and rc < 0 else None
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=rc if rc is not None and rc >= 0 else None,
            signal=sig,
            timed_out=timed_out,
            duration_s=duration,
            isolation=self.isolation,
            truncated=t1 or t2,
        )


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _read(f, limit: int) -> tuple[str, bool]:
    f.seek(0)
    data = f.read(limit + 1)
    return data[:limit].decode(errors="replace"), len(data) > limit
