"""A pre-imported parent for the ``rl-train`` runs of the end-to-end tests (``conftest.cli``).

Every ``python -m rl_trainer.cli ...`` of a test imports torch, transformers and the trainer
before it does anything: ~2.5 s per run, about 45 runs in ``make test``. This process imports
them once per test session and forks each run from itself; the run then executes
``rl_trainer.cli`` as ``__main__`` as ``python -m rl_trainer.cli args`` would: its argv,
environment (``PYTHONPATH`` entries on ``sys.path``), working directory, session (a new one
where asked), stdin ``/dev/null``, stdout and stderr on the pipe the test reads; fresh seeds for
Python's and NumPy's global generators and torch's default seed; the warnings the preloaded
imports printed, printed again on its stderr; and the interpreter's own exit (atexit hooks,
non-daemon threads joined, ``SystemExit``/``KeyboardInterrupt`` handled as Python does).

Protocol: one ``SOCK_SEQPACKET`` socket on file descriptor ``argv[1]``, one JSON packet per
request and per reply. ``{"op": "spawn", "argv": [...], "env": {...}, "cwd": ...,
"new_session": bool}`` with the pipe's write end attached (``SCM_RIGHTS``) -> ``{"pid": N}``;
``{"op": "poll", "pid": N}`` -> ``{"code": None | int}`` (negative: killed by that signal, as
``subprocess``). End of input: the children left are killed and the process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import warnings

PRELOAD = (
    "torch",
    "numpy",
    "safetensors.torch",
    "yaml",
    "transformers",
    "transformers.activations",
    "transformers.masking_utils",
    "transformers.modeling_layers",
    "transformers.models.qwen2.modeling_qwen2",
    "rl_core",
    "rl_hf",
    "rl_trainer.config",
    "rl_trainer.loop",
)
"""What every run imports first (``rl_trainer.cli`` itself runs fresh in each child)."""

_WARNED: list[str] = []
"""The warnings printed while preloading (formatted), printed again by every child."""


def _preload() -> None:
    import importlib

    with warnings.catch_warnings(record=True) as caught:
        # The filters stay as a fresh interpreter has them: what is recorded is what it prints.
        for name in PRELOAD:
            importlib.import_module(name)
    _WARNED.extend(
        warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught
    )


def _become_run(req: dict, out_fd: int, control: socket.socket) -> None:
    """In the forked child: set up the process as ``python -m rl_trainer.cli`` would have it."""
    control.close()
    if req.get("new_session"):
        os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(null)
    os.close(out_fd)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.getcwd(), *extra, *sys.path[1:]]
    for name in list(sys.modules):  # the entry module runs fresh, as under ``python -m``
        if name == "rl_trainer.cli":
            del sys.modules[name]
    import importlib
    import random

    importlib.invalidate_caches()  # modules the test wrote after the zygote listed their folder
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(67280421310721)  # a fresh interpreter's default seed
    for text in _WARNED:
        sys.stderr.write(text)
    sys.argv = list(req["argv"])


def main() -> dict | None:
    """Preload, then serve requests. Returns the request to run in a forked child (in that
    child only), ``None`` in the parent when the input ends."""
    control = socket.socket(fileno=int(sys.argv[1]))
    _preload()
    control.send(json.dumps({"ready": True}).encode())
    children: set[int] = set()
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(control, 1 << 20, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            break
        req = json.loads(data)
        op = req.get("op")
        if op == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _become_run(req, fds[0], control)
                return req
            for fd in fds:
                os.close(fd)
            children.add(pid)
            reply: dict = {"pid": pid}
        elif op == "poll":
            pid = int(req["pid"])
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done == 0:
                reply = {"code": None}
            else:
                children.discard(pid)
                reply = {"code": os.waitstatus_to_exitcode(status)}
        else:
            reply = {"error": f"unknown op {op!r}"}
        control.send(json.dumps(reply).encode())
    for pid in children:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    return None


if __name__ == "__main__":
    if main() is not None:
        import runpy

        # At module level, outside any handler of the server loop: the run's exceptions and
        # its exit reach the interpreter exactly as under ``python -m rl_trainer.cli``.
        runpy.run_module("rl_trainer.cli", run_name="__main__", alter_sys=True)
