"""The own-task walkthrough of the README, end to end with the real CLI, starting from nothing.

In an empty directory: ``rl-train new mytask``, ``rl-train check mytask/recipe.yaml``, then a short
``rl-train run`` from ANOTHER working directory (the recipe's relative data and reward paths must
resolve against the recipe), stopped with SIGTERM mid-run and resumed with ``--resume`` to the
end; its final weights must equal, bit for bit, those of the same run left alone.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_trainer.cli import EXIT_STOPPED

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_checks import assert_learns

# A short version of the template's run: a few SFT and RL steps, checkpoints every 2 steps.
SHORT = (
    "sft.steps=4",
    "sft.batch_size=16",
    "rl.steps=10",
    "rollout.prompts_per_step=4",
    "rollout.n_samples=4",
    "eval.every=5",
    "checkpoint.every=2",
    "logging.progress=false",
)


def _ok(cli, *args: str, cwd: Path) -> str:
    """``rl-train ARGS`` (the ``cli`` fixture: one torch thread) in ``cwd``; its output."""
    proc = cli(*args, cwd=cwd)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, f"rl-train {' '.join(args)} exited {proc.returncode}:\n{out}"
    return out


def _run_args(recipe: Path, run_dir: Path) -> list[str]:
    sets = [a for s in (*SHORT, f"run_dir={run_dir}") for a in ("--set", s)]
    return ["run", str(recipe), "--no-report", *sets]


def _rl_steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r.get("phase") == "rl" and r.get("step", 0) > 0 for r in rows)


def test_new_check_run_stop_resume(tmp_path, cli):
    home = tmp_path / "home"  # where the user creates the task
    elsewhere = tmp_path / "elsewhere"  # where the user runs it from
    home.mkdir()
    elsewhere.mkdir()

    _ok(cli, "new", "mytask", cwd=home)
    task = home / "mytask"
    assert sorted(p.name for p in task.iterdir()) == [
        "README.md",
        "eval.jsonl",
        "recipe.yaml",
        "reward.py",
        "train.jsonl",
    ]
    out = _ok(cli, "check", "mytask/recipe.yaml", cwd=home)
    assert "check passed" in out and "<|im_start|>assistant" in out

    recipe = task / "recipe.yaml"
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    _ok(cli, *_run_args(recipe, straight), cwd=elsewhere)

    # Stop the second run with SIGTERM once it is two RL steps in (8 steps still to go).
    proc = cli(*_run_args(recipe, stopped), cwd=elsewhere)
    deadline = time.time() + 300
    while _rl_steps_logged(stopped) < 2:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be stopped:\n{proc.stdout.read()}")
        assert time.time() < deadline, "no RL step after 300 s"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    # A clean stop: a checkpoint at the current step, the resume command, exit status 75.
    assert proc.returncode == EXIT_STOPPED, f"exit {proc.returncode}:\n{out}"
    assert "resume with: rl-train run" in out and "--resume" in out
    assert not (stopped / "final_model").exists(), "the stopped run must not look finished"
    assert 2 <= _rl_steps_logged(stopped) < 10

    _ok(cli, *_run_args(recipe, stopped), "--resume", cwd=elsewhere)

    wa = load_file(str(straight / "final_model" / "model.safetensors"))
    wb = load_file(str(stopped / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), (
        "resumed weights differ from the straight run"
    )
    init = load_file(str(straight / "init_model" / "model.safetensors"))
    assert any(not torch.equal(wa[k], init[k]) for k in wa), "the run did not train"


@pytest.mark.slow
@pytest.mark.long
def test_template_learns_in_a_short_run(tmp_path, cli):
    """The generated recipe as is: the training reward rises (tests/learning_checks.py
    ``template``: its margin over seeds is too thin for ``make test``, where the demo recipe's
    learning test checks that GRPO learns the same task)."""
    _ok(cli, "new", "mytask", cwd=tmp_path)
    run_dir = tmp_path / "run"
    sets = ["--set", f"run_dir={run_dir}", "--set", "logging.progress=false"]
    _ok(cli, "run", "mytask/recipe.yaml", "--no-report", *sets, cwd=tmp_path)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert_learns("template", rows)
