"""Shared fixtures of rl-megatron's tests: tiny Hugging Face models and the ``gpu`` skip."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest
import torch

from rl_hf import TinyModelSpec, build_tiny_model


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``gpu``-marked tests when CUDA is unavailable."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def build_qwen3_model(save_dir: Path, *, tie: bool = False, seed: int = 0) -> Path:
    """A tiny random Qwen3 (QK-norm, explicit head_dim) with the local test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_hf.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        # Non-trivial norm weights, so a mis-mapped norm shows up in the log-probs.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
    save_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(save_dir))
    tok.save_pretrained(str(save_dir))
    return save_dir


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny models by name: ``qwen2`` (tied), ``llama`` (untied), ``qwen3`` (QK-norm, untied)."""
    root = tmp_path_factory.mktemp("models")
    return {
        "qwen2": build_tiny_model(
            root / "qwen2", TinyModelSpec(hidden_size=32, intermediate_size=64)
        ),
        "llama": build_tiny_model(
            root / "llama",
            TinyModelSpec(
                arch="llama",
                hidden_size=32,
                intermediate_size=64,
                tie_word_embeddings=False,
                seed=1,
            ),
        ),
        "qwen3": build_qwen3_model(root / "qwen3", seed=2),
    }


@pytest.fixture(scope="module", autouse=True)
def _isolate_process_state():
    """After each module: tear down Megatron's parallel state, the default process group and
    the CPU redirections, so other packages' tests in the same pytest run see a clean process."""
    yield
    if torch.distributed.is_initialized():
        if "megatron.core.parallel_state" in sys.modules:
            sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
        torch.distributed.destroy_process_group()
    if "rl_megatron._cpu_support" in sys.modules:
        sys.modules["rl_megatron._cpu_support"].disable_cpu_support()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Zygote:
    """Client of ``_zygote.py``: one process per test session that imported torch,
    transformers and megatron-core once and forks the ranks of every job from itself (a rank's
    ~4.6 s of imports, 8 of them in an 8-rank job, on 2 cores). ``RL_TEST_NO_ZYGOTE=1``, a
    command that is not ``python script.py ...`` or a zygote that fails to start: plain
    processes, as before."""

    _instance: _Zygote | None = None
    _failed = False

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("_zygote.py"))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            text=True,
        )
        ready = self.proc.stdout.readline()
        if not ready or not json.loads(ready).get("ready"):
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the rank zygote did not start")

    @classmethod
    def get(cls) -> _Zygote | None:
        """The session's zygote (started on first use), or ``None`` where it cannot be used."""
        if cls._failed or os.environ.get("RL_TEST_NO_ZYGOTE") == "1":
            return None
        if cls._instance is None or cls._instance.proc.poll() is not None:
            try:
                cls._instance = cls()
            except (OSError, RuntimeError, ValueError):
                cls._failed = True
                return None
        return cls._instance

    def call(self, **req: object) -> dict:
        """One request, its reply."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the rank zygote exited (code {self.proc.poll()})")
        return json.loads(line)


class _ForkedRank:
    """A rank forked by the zygote, with the part of ``subprocess.Popen`` the launcher uses."""

    def __init__(self, zygote: _Zygote, argv: Sequence[str], env: Mapping[str, str], log: Path):
        self.zygote = zygote
        self.pid = int(
            zygote.call(op="spawn", argv=list(argv), env=dict(env), cwd=os.getcwd(), log=str(log))[
                "pid"
            ]
        )
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.call(op="poll", pid=self.pid)["code"]
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.zygote.call(op="kill", pid=self.pid)

    def wait(self) -> int:
        while self.poll() is None:
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode


def _start_rank(argv: Sequence[str], env: Mapping[str, str], log: Path) -> object:
    """Rank process for ``argv``: forked from the zygote when ``argv`` is ``python script.py
    ...`` (and the zygote runs), else a plain process."""
    zygote = _Zygote.get()
    script = len(argv) >= 2 and argv[0] == sys.executable and str(argv[1]).endswith(".py")
    if zygote is not None and script:
        return _ForkedRank(zygote, argv, env, log)
    with log.open("wb") as out:
        return subprocess.Popen(list(argv), env=dict(env), stdout=out, stderr=subprocess.STDOUT)


def _launch_ranks(
    cmd: Sequence[str] | Callable[[int], Sequence[str]],
    world_size: int,
    *,
    timeout: float = 600.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    log_dir: Path | None = None,
) -> list[tuple[int, str]]:
    """Run ``cmd`` (or ``cmd(rank)``) as ``world_size`` torchrun-style ranks (gloo on 127.0.0.1,
    a free port, one torch thread each) and wait for all; returns each rank's (return code,
    output).

    Output goes to ``rank<N>.log`` files (in ``log_dir``, else a temporary directory), so a
    chatty rank never blocks on a full pipe. When a rank fails the others (blocked in a
    collective) are killed at once, and all are killed after ``timeout`` seconds; only the
    processes started here are ever killed. With ``check`` a failed job fails the test with the
    tail of every rank's log.
    """
    port = _free_port()
    with contextlib.ExitStack() as stack:
        if log_dir is None:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logs = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
        procs = []
        for rank in range(world_size):
            rank_env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "OMP_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore",
                **(env or {}),
            }
            procs.append(_start_rank(cmd(rank) if callable(cmd) else cmd, rank_env, logs[rank]))
        failure = ""
        deadline = time.monotonic() + timeout
        try:
            while None in (codes := [p.poll() for p in procs]):  # poll every rank each time
                if any(codes):
                    failure = "a rank failed; the others were stopped"
                    break
                if time.monotonic() > deadline:
                    failure = f"timed out after {timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out = [(p.returncode, log.read_text(errors="replace")) for p, log in zip(procs, logs)]
    if check and (failure or any(code for code, _ in out)):
        pytest.fail(
            f"{world_size}-rank job: {failure or 'a rank failed'}\n"
            + "\n----\n".join(f"rank {r}:\n{log[-4000:]}" for r, (_, log) in enumerate(out))
        )
    return out


@pytest.fixture(scope="session")
def launch_ranks() -> Callable[..., list[tuple[int, str]]]:
    """``launch_ranks(cmd, world_size, timeout=600, env=None, check=True, log_dir=None)``: run
    ``cmd`` as a torchrun-style job of ``world_size`` CPU ranks; each rank's (return code,
    output)."""
    return _launch_ranks


def _assert_same_update(
    mine: dict[str, torch.Tensor],
    theirs: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    *,
    max_abs: float | None = None,
) -> None:
    """Same weights as the reference after a step: the step moved them, the mean difference is
    below 0.1 % of the mean update, at most 0.1 % of the entries differ by more than 1e-5 (Adam's
    first steps amplify rounding where a gradient is ~eps), and with ``max_abs`` no entry differs
    by more than that."""
    assert sorted(mine) == sorted(theirs)
    update = torch.cat([(theirs[n] - before[n]).abs().flatten() for n in theirs])
    diff = torch.cat([(mine[n] - theirs[n]).abs().flatten() for n in theirs])
    assert update.mean() > 1e-4, "the reference step did not move the weights"
    assert diff.mean() <= 1e-3 * update.mean(), (float(diff.mean()), float(update.mean()))
    assert float((diff > 1e-5).float().mean()) <= 1e-3
    if max_abs is not None:
        assert float(diff.max()) <= max_abs


@pytest.fixture(scope="session")
def assert_same_update() -> Callable[..., None]:
    """``assert_same_update(mine, theirs, before, max_abs=None)``: weights after a step equal the
    reference's after the same step (see ``_assert_same_update``)."""
    return _assert_same_update
