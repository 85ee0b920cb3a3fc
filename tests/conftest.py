"""Shared fixtures of the end-to-end tests: run the real CLI in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "rl_trainer.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


@pytest.fixture
def cli():
    """Start ``rl-train`` (in a subprocess, one torch thread): ``cli("run", recipe)`` -> Popen."""
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
