"""Launching SGLang servers and the SGLang router as owned child processes.

Every process starts in its own session (so its process group holds the launcher and all the
workers SGLang forks) with ``PR_SET_PDEATHSIG`` set to SIGKILL, so it dies with the process that
launched it even on a hard crash. :meth:`ManagedProcess.stop` sends SIGTERM to the whole group,
then SIGKILL; an ``atexit`` hook stops whatever is still running when the interpreter exits::

    args = ServerArgs.validate({"max_total_tokens": 8192, "log_level": "warning"}, python=py)
    proc = launch_server(model_path="runs/tiny", python=py, port=free_port(), server_args=args,
                         device="cpu", log_dir=Path("runs/sglang-logs"))
    wait_healthy(proc, f"http://127.0.0.1:{proc.port}", timeout_s=300)
    ...
    proc.stop()

Server arguments are a dictionary of SGLang ``ServerArgs`` fields (``max_total_tokens``,
``attention_backend``, ...). :meth:`ServerArgs.validate` checks them against SGLang's own argument
parser, read once from the SGLang interpreter and cached next to it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import difflib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.errors import ConfigError, GenerationError

__all__ = [
    "RESERVED_SERVER_ARGS",
    "ManagedProcess",
    "ServerArgs",
    "free_port",
    "launch_router",
    "launch_server",
    "live_processes",
    "server_argv",
    "wait_healthy",
]

RESERVED_SERVER_ARGS: frozenset[str] = frozenset(
    {"model_path", "host", "port", "device", "skip_tokenizer_init", "weight_version", "nccl_port"}
)
"""``ServerArgs`` fields the generator sets itself; ``server_args`` may not name them."""

QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
"""Set in a launched server's environment unless it names them. SGLang treats every SIGTERM (the
way :meth:`ManagedProcess.stop` ends a server) as a possible crash: with its defaults it logs
"Sleeping 5 seconds before crash diagnostics", then py-spies the schedulers and, on CUDA, asks for
core dumps and waits up to 60 s for them. A deliberate stop then took ~5.6 s instead of ~0.5 s
(CPU, tiny model). Set either variable to ``1`` in the environment to have the diagnostics."""

_KEY = re.compile(r"^[a-z][a-z0-9_]*$")
_LIVE: set[ManagedProcess] = set()
_LIVE_LOCK = threading.Lock()
_PORTS_GIVEN: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now and not handed out before by this process."""
    with _LIVE_LOCK:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
            if port not in _PORTS_GIVEN and port + 1 not in _PORTS_GIVEN:
                _PORTS_GIVEN.add(port)
                return port
    raise GenerationError(f"free_port: no free TCP port found on {host}.")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    # Best effort, and nothing can be logged between fork and exec: without libc's prctl the
    # child simply does not die with its parent (stop() still stops its process group).
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ManagedProcess:
    """A child process in its own process group, stopped as a group (no orphans)."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        log_path: Path,
        cwd: Path,
        port: int,
        name: str,
    ) -> None:
        """Start ``argv`` with stdout and stderr appended to ``log_path``."""
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cwd.mkdir(parents=True, exist_ok=True)
        self.name = name
        """Short label for messages (``sglang-0``, ``router``)."""
        self.port = port
        """The HTTP port it serves on."""
        self.log_path = log_path
        """File holding its stdout and stderr."""
        self.argv = list(argv)
        """The command line."""
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.argv,
                env=dict(env),
                cwd=str(cwd),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        self.pid = self.popen.pid
        """Process id (and process-group id) of the launcher."""
        with _LIVE_LOCK:
            _LIVE.add(self)

    def alive(self) -> bool:
        """True while the launcher process runs."""
        return self.popen.poll() is None

    def group_pids(self) -> list[int]:
        """Pids of all live processes in its process group (``/proc`` scan; Linux)."""
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] != "Z" and int(fields[2]) == self.pid:  # state, ppid, pgrp
                out.append(int(entry.name))
        return out

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM the whole process group, wait, then SIGKILL what is left. Idempotent."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                if self.popen.poll() is not None and not self.group_pids():
                    break
                time.sleep(0.05)
            else:
                continue
            break
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=1)
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def log_tail(self, n: int = 30) -> str:
        """The last ``n`` lines of its log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def __repr__(self) -> str:
        return f"ManagedProcess({self.name}, pid={self.pid}, port={self.port})"


def live_processes() -> list[ManagedProcess]:
    """Processes launched by this module and not stopped yet."""
    with _LIVE_LOCK:
        return list(_LIVE)


@atexit.register
def _stop_all() -> None:
    for proc in live_processes():
        proc.stop(timeout_s=5.0)


@dataclass(frozen=True, slots=True)
class _Option:
    flag: str
    store_true: bool
    choices: tuple[str, ...] | None
    nargs: str | int | None


_DUMP_PARSER = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
p = argparse.ArgumentParser()
ServerArgs.add_cli_args(p)
out = {}
for a in p._actions:
    longs = [s for s in a.option_strings if s.startswith("--")]
    if not longs or a.dest == "help":
        continue
    want = "--" + a.dest.replace("_", "-")
    out[a.dest] = {
        "flag": want if want in longs else longs[0],
        "store_true": isinstance(a, argparse._StoreTrueAction),
        "choices": [str(c) for c in a.choices] if a.choices else None,
        "nargs": a.nargs,
    }
json.dump(out, sys.stdout)
"""


def _write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file of its own and a rename, so concurrent
    writers (threads or processes) and readers never see a partial file. A cache: an
    ``OSError`` (read-only venv, full disk) leaves ``path`` as it was."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f"{path.name}.", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


class ServerArgs:
    """Validation of SGLang server arguments given as a dictionary of ``ServerArgs`` fields."""

    _cache: dict[str, dict[str, _Option]] = {}

    @classmethod
    def options(
        cls, python: str | Path, env: Mapping[str, str] | None = None
    ) -> dict[str, _Option]:
        """SGLang's options by field name, from the parser of the SGLang at ``python``.

        Read once (about 10 s) and cached in ``<venv>/.rl-sglang-server-args.json``.
        """
        key = str(python)
        if key in cls._cache:
            return cls._cache[key]
        cache = Path(python).resolve().parent.parent / ".rl-sglang-server-args.json"
        raw: dict[str, Any] | None = None
        if cache.is_file():
            with contextlib.suppress(ValueError, OSError):
                raw = json.loads(cache.read_text())
        if raw is None:
            proc = subprocess.run(
                [str(python), "-c", _DUMP_PARSER],
                env=dict(env or os.environ),
                capture_output=True,
                text=True,
                timeout=300,
                cwd=str(cache.parent),
            )
            if proc.returncode != 0:
                raise ConfigError(
                    f"SGLangGenerator.Config.python: {python} cannot import SGLang's server "
                    f"arguments:\n{proc.stderr[-2000:]}\nRun packages/rl-sglang/scripts/"
                    "setup_sglang_env.sh or point `python` at an interpreter with sglang."
                )
            raw = json.loads(proc.stdout)
            _write_atomic(cache, json.dumps(raw))
        opts = {
            k: _Option(v["flag"], v["store_true"], v["choices"] and tuple(v["choices"]), v["nargs"])
            for k, v in raw.items()
        }
        cls._cache[key] = opts
        return opts

    @staticmethod
    def check_keys(server_args: Mapping[str, Any]) -> dict[str, Any]:
        """Normalise keys (``-`` to ``_``) and refuse malformed or generator-owned ones."""
        out: dict[str, Any] = {}
        for key, value in server_args.items():
            k = str(key).replace("-", "_")
            if not _KEY.match(k):
                raise ConfigError(
                    f"SGLangGenerator.Config.server_args: {key!r} is not a ServerArgs field name "
                    "(lower-case words joined by '_', e.g. 'max_total_tokens')."
                )
            if k in RESERVED_SERVER_ARGS:
                raise ConfigError(
                    f"SGLangGenerator.Config.server_args.{k}: set by the generator itself; use "
                    "the generator's own Config fields (model_path, host, device, ...) instead."
                )
            if isinstance(value, Mapping):
                value = json.dumps(dict(value))
            out[k] = value
        return out

    @classmethod
    def validate(
        cls,
        server_args: Mapping[str, Any],
        *,
        python: str | Path,
        env: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Check ``server_args`` against SGLang's own parser; returns the normalised dict."""
        args = cls.check_keys(server_args)
        opts = cls.options(python, env)
        for k, v in args.items():
            opt = opts.get(k)
            if opt is None:
                close = difflib.get_close_matches(k, list(opts), n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                raise ConfigError(
                    f"SGLangGenerator.Config.server_args.{k}: SGLang has no such server "
                    f"argument.{hint}"
                )
            if opt.store_true and not isinstance(v, bool):
                raise ConfigError(
                    f"SGLangGenerator.Config.server_args.{k}: a switch; give true or false, "
                    f"not {v!r}."
                )
            if opt.choices and not isinstance(v, list | tuple) and str(v) not in opt.choices:
                raise ConfigError(
                    f"SGLangGenerator.Config.server_args.{k}: {v!r} is not one of "
                    f"{list(opt.choices)}."
                )
        return args

    @staticmethod
    def to_argv(args: Mapping[str, Any], options: Mapping[str, _Option] | None = None) -> list[str]:
        """Command-line flags for ``args`` (``True`` switches on, ``False``/``None`` omitted)."""
        argv: list[str] = []
        for k, v in args.items():
            flag = options[k].flag if options and k in options else "--" + k.replace("_", "-")
            if v is None or v is False:
                continue
            if v is True:
                argv.append(flag)
            elif isinstance(v, list | tuple):
                argv += [flag, *(str(x) for x in v)]
            else:
                argv += [flag, str(v)]
        return argv


def server_argv(
    *,
    model_path: str,
    python: str | Path,
    port: int,
    server_args: Mapping[str, Any],
    device: str,
    host: str = "127.0.0.1",
    nccl_port: int,
    weight_version: int | None = None,
) -> list[str]:
    """The command line of an SGLang server, token-in/token-out (``--skip-tokenizer-init``).

    ``server_args`` must already be validated (:meth:`ServerArgs.validate`) and hold the CPU
    defaults where ``device == "cpu"`` (:func:`launch_server` adds them). A process on another
    node (e.g. a Ray actor) can run this command and be attached with ``server_urls``.
    """
    argv = [
        str(python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--device",
        device,
        "--skip-tokenizer-init",
        "--nccl-port",
        str(nccl_port),
    ]
    if weight_version is not None:
        argv += ["--weight-version", str(weight_version)]
    return argv + ServerArgs.to_argv(server_args)


def launch_server(
    *,
    model_path: str,
    python: str | Path,
    port: int,
    server_args: Mapping[str, Any],
    device: str,
    log_dir: Path,
    host: str = "127.0.0.1",
    name: str = "sglang",
    weight_version: int | None = None,
    env: Mapping[str, str] | None = None,
) -> ManagedProcess:
    """Start :func:`server_argv`'s command as an owned process group.

    ``server_args`` must already be validated (:meth:`ServerArgs.validate`). On CPU the stub
    driver, the CPU patches and the CPU defaults of :mod:`rl_sglang._cpu_support` are applied.
    """
    from rl_sglang import _cpu_support

    run_env = dict(env if env is not None else os.environ)
    args = dict(server_args)
    if device == "cpu":
        run_env = _cpu_support.cpu_environment(run_env)
        args = _cpu_support.cpu_server_args(args)
    run_env.setdefault("OMP_NUM_THREADS", "1")
    for key, value in QUIET_STOP_ENV.items():  # the caller's or the user's setting wins
        run_env.setdefault(key, value)
    argv = server_argv(
        model_path=model_path,
        python=python,
        port=port,
        server_args=args,
        device=device,
        host=host,
        nccl_port=free_port(host),
        weight_version=weight_version,
    )
    return ManagedProcess(
        argv,
        env=run_env,
        log_path=log_dir / f"{name}-{port}.log",
        cwd=log_dir,
        port=port,
        name=name,
    )


def launch_router(
    *,
    worker_urls: Sequence[str],
    python: str | Path,
    port: int,
    log_dir: Path,
    host: str = "127.0.0.1",
    policy: str = "round_robin",
    extra_args: Sequence[str] = (),
) -> ManagedProcess:
    """Start the SGLang router (``sglang_router.launch_router``) in front of ``worker_urls``."""
    argv = [
        str(python),
        "-m",
        "sglang_router.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        policy,
        "--worker-urls",
        *worker_urls,
        *extra_args,
    ]
    return ManagedProcess(
        argv,
        env=dict(os.environ),
        log_path=log_dir / f"router-{port}.log",
        cwd=log_dir,
        port=port,
        name="router",
    )


def _get(url: str, timeout_s: float) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (OSError, ValueError):
        return 0


def wait_healthy(
    proc: ManagedProcess | None,
    url: str,
    *,
    timeout_s: float,
    path: str = "/health_generate",
    stop: threading.Event | None = None,
) -> None:
    """Poll ``url + path`` until it answers 200; fail early if ``proc`` exits.

    Raises :class:`~rl_core.errors.GenerationError` with the tail of the process log.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if stop is not None and stop.is_set():
            raise GenerationError(f"wait_healthy: cancelled while waiting for {url}.")
        if proc is not None and not proc.alive():
            raise GenerationError(
                f"{proc.name} (pid {proc.pid}) exited with code {proc.popen.returncode} before "
                f"it became healthy. Last lines of {proc.log_path}:\n{proc.log_tail()}"
            )
        if _get(url + "/health", 5.0) == 200 and _get(url + path, 30.0) == 200:
            return
        time.sleep(0.5)
    tail = f" Last lines of {proc.log_path}:\n{proc.log_tail()}" if proc is not None else ""
    raise GenerationError(
        f"{url} did not answer {path} within {timeout_s:.0f} s; raise "
        f"SGLangGenerator.Config.startup_timeout_s or check the server.{tail}"
    )


def _python_default() -> str:
    from rl_sglang import _cpu_support

    py = _cpu_support.default_python()
    return str(py) if py.exists() else sys.executable
