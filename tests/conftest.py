"""Shared fixtures of the end-to-end tests: run the real CLI in subprocesses."""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

TINY_RECIPE = """
run_dir: {run_dir}
seed: 3
model:
  init: {{arch: qwen2, hidden_size: 32, num_layers: 1, num_heads: 2, num_kv_heads: 1, intermediate_size: 64}}
task: {{type: reverse, n_train: 200, n_eval: 16, min_len: 2, max_len: 4}}
policy: {{type: hf, lr: 0.001}}
generator: {{type: hf}}
sft: {{steps: 3, batch_size: 16, lr: 0.003}}
rollout: {{prompts_per_step: 4, n_samples: 4, sampling: {{temperature: 1.0, max_new_tokens: 6}}}}
algorithm: {{advantage: grpo, use_reference: true, loss: {{kl_coef: 0.01}}}}
rl: {{steps: {rl_steps}}}
eval: {{every: 2}}
checkpoint: {{every: 2, keep: 2}}
logging: {{tensorboard: false, progress: false}}
"""


@pytest.fixture
def tiny_recipe(tmp_path):
    """Write a tiny recipe; returns a function (name, rl_steps) -> (recipe path, run dir)."""

    def make(name: str, rl_steps: int = 8) -> tuple[Path, Path]:
        run_dir = tmp_path / name
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(TINY_RECIPE.format(run_dir=run_dir, rl_steps=rl_steps))
        return recipe, run_dir

    return make


_CLI_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

_IMPORT_TIME_ENV = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "CUDA", "OMP_", "MKL")
"""Prefixes of variables that the preloaded modules may read when imported: a run whose value
of one differs from the zygote's starts as a plain process (``PYTHON*`` too, ``PYTHONPATH``
aside, which a forked run puts on its ``sys.path``)."""


class _Zygote:
    """Client of ``_cli_zygote.py``: one process per test session that imported torch,
    transformers and the trainer once and forks every ``rl-train`` run of these tests from
    itself (~2.5 s of imports per run, ~45 runs in ``make test``). ``RL_TEST_NO_ZYGOTE=1``, a
    zygote that fails to start, Popen arguments other than ``cwd``/``start_new_session`` or an
    environment that differs in what the imports read: plain processes, as before."""

    _instance: _Zygote | None = None
    _failed = False

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = {**os.environ, **_CLI_ENV}
        self.lock = threading.Lock()
        with theirs:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("_cli_zygote.py")),
                    str(theirs.fileno()),
                ],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
            )
        self.sock = mine
        self.sock.settimeout(300)
        try:
            ready = json.loads(self.sock.recv(1 << 16) or b"{}")
        except (OSError, ValueError):
            ready = {}
        if not ready.get("ready"):
            self.close()
            raise RuntimeError("the rl-train zygote did not start")
        atexit.register(self.close)

    @classmethod
    def get(cls) -> _Zygote | None:
        """The session's zygote (started on first use), or ``None`` where it cannot be used."""
        if cls._failed or os.environ.get("RL_TEST_NO_ZYGOTE") == "1":
            return None
        if cls._instance is None or cls._instance.proc.poll() is not None:
            try:
                cls._instance = cls()
            except (OSError, RuntimeError):
                cls._failed = True
                return None
        return cls._instance

    def fits(self, env: dict[str, str]) -> bool:
        """Whether a run with ``env`` may be forked (the imports saw the same variables)."""
        keys = {k for k in (*env, *self.env) if k.startswith(_IMPORT_TIME_ENV)}
        keys |= {k for k in (*env, *self.env) if k.startswith("PYTHON") and k != "PYTHONPATH"}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def call(self, req: dict, fds: tuple[int, ...] = ()) -> dict:
        """One request (with file descriptors attached), its reply."""
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(req).encode()], list(fds))
            data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the rl-train zygote exited (code {self.proc.poll()})")
        return json.loads(data)

    def close(self) -> None:
        """End the zygote (it kills the runs still going)."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class _ForkedRun:
    """An ``rl-train`` run forked by the zygote, with the part of ``subprocess.Popen`` (text
    mode, stdout piped, stderr on stdout) the tests use: ``pid``, ``stdout``, ``returncode``,
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, zygote: _Zygote, args: list[str], env: dict[str, str], cwd, session: bool):
        self.args = args
        self._zygote = zygote
        read, write = os.pipe()
        try:
            req = {
                "op": "spawn",
                "argv": ["rl_trainer.cli", *args[3:]],
                "env": env,
                "cwd": os.path.abspath(cwd if cwd is not None else os.getcwd()),
                "new_session": session,
            }
            self.pid = int(zygote.call(req, (write,))["pid"])
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        # As Popen(text=True) reads it: the locale's encoding, universal newlines.
        self.stdout = io.TextIOWrapper(
            io.BufferedReader(io.FileIO(read, "r")), encoding=locale.getpreferredencoding(False)
        )
        self.stdin = self.stderr = None
        self.returncode: int | None = None
        self._out: list[str] = []
        self._reader: threading.Thread | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.call({"op": "poll", "pid": self.pid})["code"]
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def communicate(self, input=None, timeout: float | None = None) -> tuple[str, None]:
        assert input is None, "a forked run has no stdin"
        if self._reader is None:
            self._reader = threading.Thread(
                target=lambda: self._out.append(self.stdout.read()), daemon=True
            )
            self._reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        self._reader.join(timeout)
        if self._reader.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.stdout.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return "".join(self._out), None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _cli(*args: str, **kwargs) -> subprocess.Popen | _ForkedRun:
    env = {**os.environ, **_CLI_ENV}
    argv = [sys.executable, "-m", "rl_trainer.cli", *args]
    zygote = _Zygote.get() if set(kwargs) <= {"cwd", "start_new_session"} else None
    if zygote is not None and zygote.fits(env):
        cwd, session = kwargs.get("cwd"), bool(kwargs.get("start_new_session"))
        return _ForkedRun(zygote, argv, env, cwd, session)
    return subprocess.Popen(
        argv,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.fixture
def cli():
    """Start ``rl-train`` (one torch thread): ``cli("run", recipe)`` -> a Popen (text, stdout
    piped, stderr on it). The run is forked from a session process that imported torch,
    transformers and the trainer once (``_cli_zygote.py``; ``RL_TEST_NO_ZYGOTE=1``: a plain
    ``python -m rl_trainer.cli`` process), and behaves as that process would."""
    return _cli


def _kill_after_checkpoint(recipe: Path, run_dir: Path, step: int, *overrides: str) -> Path:
    proc = _cli("run", str(recipe), "--no-report", *overrides)
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    deadline = time.time() + 600
    while not (ckpt / "COMPLETE").exists():
        assert proc.poll() is None, "run ended before it could be killed: " + proc.stdout.read()
        assert time.time() < deadline, f"no checkpoint {ckpt} after 600 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert not (run_dir / "final_model").exists()
    return ckpt


@pytest.fixture
def kill_after_checkpoint():
    """``kill_after_checkpoint(recipe, run_dir, step, *overrides)``: start ``rl-train run`` and
    SIGKILL it as soon as the checkpoint of global step ``step`` (SFT and RL steps count alike)
    is complete; returns that checkpoint directory."""
    return _kill_after_checkpoint
