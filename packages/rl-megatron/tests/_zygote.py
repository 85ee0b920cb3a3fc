"""A pre-imported parent for the multi-rank test jobs (``conftest._launch_ranks``).

Every rank of a job is a fresh ``python worker.py ...`` that imports torch, transformers and
megatron-core before it does anything: ~4.6 CPU-seconds per rank, 37 for an 8-rank job on a
2-core machine. This process imports them once per test session and forks each rank from
itself; the rank then runs its script as ``__main__`` exactly as ``python script args`` would
(its argv, environment, working directory and ``sys.path[0]``), with its output in its log
file. Nothing else is shared: the CPU patches of ``rl_megatron._cpu_support``, the process
groups and the models are made in each rank, after the fork.

Protocol (JSON lines on stdin/stdout): ``{"op": "spawn", "argv": [...], "env": {...}, "cwd":
..., "log": ...}`` -> ``{"pid": N}``; ``{"op": "poll", "pid": N}`` -> ``{"code": None | int}``
(negative: killed by that signal, as ``subprocess``); ``{"op": "kill", "pid": N}`` -> ``{}``.
End of input: the children left are killed and the process exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys

PRELOAD = (
    "torch",
    "torch.distributed",
    "transformers",
    "safetensors.torch",
    "rl_core.testing.policy",
    "rl_megatron.parallel",
    "rl_megatron.policy",
    "megatron.core",
    "megatron.core.dist_checkpointing.core",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.distributed",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.models.gpt",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.pipeline_parallel",
    "megatron.core.tensor_parallel",
    "megatron.core.transformer",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router_replay",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.torch_norm",
    "megatron.core.transformer.utils",
)
"""What every rank would import first (rl_megatron imports megatron-core lazily)."""


def _run_rank(req: dict) -> None:
    """In the forked child: become ``python argv[1:]`` and exit with its code."""
    import io
    import random
    import runpy
    import traceback
    import warnings

    code = 1
    try:
        log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        sys.stdin = open(os.devnull)  # noqa: SIM115 - the process ends with os._exit
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        script = req["argv"][1]
        sys.argv = list(req["argv"][1:])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        random.seed()  # a fresh interpreter seeds from the OS; so does each rank
        if req["env"].get("PYTHONWARNINGS") == "ignore":
            warnings.simplefilter("ignore")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def main() -> None:
    """Import :data:`PRELOAD`, say ready, then serve requests until stdin closes."""
    import importlib
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in PRELOAD:
            importlib.import_module(name)
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    children: set[int] = set()
    for line in sys.stdin:
        req = json.loads(line)
        op = req["op"]
        if op == "spawn":
            out.flush()
            pid = os.fork()
            if pid == 0:
                _run_rank(req)
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
        elif op == "kill":
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(req["pid"]), signal.SIGKILL)
            reply = {}
        else:
            reply = {"error": f"unknown op {op!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


if __name__ == "__main__":
    main()
