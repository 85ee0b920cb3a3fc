"""SIGTERM/SIGINT stop a run cleanly (checkpoint, resume command, exit status 75) and the resumed
run ends with the same records and bitwise the same final weights as an uninterrupted one; a
second signal exits at once. Also: a normal run is free of third-party FutureWarnings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_trainer.cli import EXIT_STOPPED


def _records(run_dir: Path) -> list[dict]:
    p = run_dir / "metrics.jsonl"
    if not p.exists():
        return []
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.endswith("}")]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _finish(proc: subprocess.Popen, code: int = 0) -> str:
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == code, out
    return out


def _signal_when(
    proc: subprocess.Popen, run_dir: Path, phase: str, step: int, signum: int, group: bool = False
):
    """Send ``signum`` once ``metrics.jsonl`` holds the record of ``phase`` step ``step`` (to
    the process group ``proc`` leads with ``group``, as Ctrl-C in a terminal does)."""
    deadline = time.time() + 600
    while not any(r["phase"] == phase and r["step"] >= step for r in _records(run_dir)):
        assert proc.poll() is None, "run ended before the signal: " + proc.stdout.read()
        assert time.time() < deadline, f"no {phase} step {step} after 600 s"
        time.sleep(0.01)
    if group:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)


def _assert_same_run(run_a: Path, run_b: Path) -> None:
    a, b = _records(run_a), _records(run_b)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    assert a == b
    wa = load_file(str(run_a / "final_model" / "model.safetensors"))
    wb = load_file(str(run_b / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _stop_and_resume(
    tiny_recipe, cli, phase: str, step: int, signum: int, *overrides: str, group: bool = False
):
    """Run a straight and a stopped-then-resumed copy of the tiny recipe (the stopped one in a
    session of its own, its process group signalled, with ``group``); returns the stopped
    run's output and its summary."""
    recipe_a, run_a = tiny_recipe("straight", rl_steps=8)
    recipe_b, run_b = tiny_recipe("stopped", rl_steps=8)
    straight = cli("run", str(recipe_a), "--no-report", *overrides)
    proc = cli("run", str(recipe_b), "--no-report", *overrides, start_new_session=group)
    _signal_when(proc, run_b, phase, step, signum, group=group)
    out = _finish(proc, EXIT_STOPPED)
    _finish(straight)
    name = signal.Signals(signum).name
    assert f"{name}: finishing the current step" in out
    assert f"stopped by {name}" in out
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    resume = out.split("resume with: ", 1)[1].splitlines()[0]
    assert resume.split() == [
        "rl-train", "run", str(recipe_b), "--resume", *overrides, "--no-report"
    ]  # fmt: skip
    assert not (run_b / "final_model").exists()
    assert (run_b / "checkpoints").is_dir()
    proc = cli(*resume.split()[1:])
    _finish(proc)
    _assert_same_run(run_a, run_b)
    return out, summary


def test_sigterm_mid_rl_then_resume_is_exact(tiny_recipe, cli):
    # checkpoint.every=0: the stop writes the only checkpoint
    _, summary = _stop_and_resume(
        tiny_recipe, cli, "rl", 2, signal.SIGTERM, "--set", "checkpoint.every=0"
    )
    assert summary["sft_steps_this_run"] == summary["sft_step"] == 3
    assert 2 <= summary["rl_step"] < 8
    assert summary["rl_steps_this_run"] == summary["rl_step"]


def test_sigint_mid_sft_then_resume_is_exact(tiny_recipe, cli):
    out, summary = _stop_and_resume(
        tiny_recipe,
        cli,
        "sft",
        2,
        signal.SIGINT,
        "--set",
        "sft.steps=150",
        "--set",
        "checkpoint.every=0",
    )
    assert 2 <= summary["sft_step"] < 150 and summary["rl_step"] == 0
    assert "RL step 0/8" in out


def test_sigterm_async_mid_rl_then_resume_is_exact(tiny_recipe, cli):
    _stop_and_resume(
        tiny_recipe,
        cli,
        "rl",
        2,
        signal.SIGTERM,
        "--set",
        "rl.async_generation=true",
        "--set",
        "rl.max_staleness=1",
    )


def test_ctrl_c_to_the_process_group_stops_a_generator_process_run_cleanly(tiny_recipe, cli):
    """Ctrl-C in a terminal signals the whole foreground process group, the generator child of
    ``runtime.generator_process`` too: the child ignores it (the trainer closes it), so the run
    stops after the current step as without the child, and resumes exactly."""
    _stop_and_resume(
        tiny_recipe,
        cli,
        "rl",
        2,
        signal.SIGINT,
        *("--set", "rl.async_generation=true", "--set", "rl.max_staleness=1"),
        *("--set", "runtime.generator_process=true"),
        group=True,
    )


def test_second_signal_exits_at_once(tiny_recipe, cli):
    recipe, run_dir = tiny_recipe("twice", rl_steps=200)
    # big rounds: the step the first signal lets finish outlasts the second signal
    slow = ("--set", "rollout.prompts_per_step=64", "--set", "rollout.n_samples=16")
    proc = cli("run", str(recipe), "--no-report", "--set", "checkpoint.every=0", *slow)
    _signal_when(proc, run_dir, "rl", 1, signal.SIGTERM)
    first = proc.stdout.readline()
    while first and "SIGTERM: finishing the current step" not in first:
        first = proc.stdout.readline()
    proc.send_signal(signal.SIGTERM)
    out = _finish(proc, 128 + signal.SIGTERM)
    assert "SIGTERM again: exiting now without a checkpoint" in out
    assert "stopped by" not in out
    assert not (run_dir / "final_model").exists()
    assert not (run_dir / "checkpoints").exists()


def test_checkpoint_at_the_end_of_sft_resumes_exactly(tiny_recipe, cli, kill_after_checkpoint):
    """A checkpoint due at the warm-up's last step is taken in the RL phase (before, it held the
    SFT optimizer and a resume from it could not start RL)."""
    recipe_a, run_a = tiny_recipe("straight", rl_steps=4)
    recipe_b, run_b = tiny_recipe("killed", rl_steps=4)
    straight = cli("run", str(recipe_a), "--no-report", "--set", "checkpoint.every=3")
    kill_after_checkpoint(recipe_b, run_b, 3, "--set", "checkpoint.every=3")
    _finish(straight)
    _finish(cli("run", str(recipe_b), "--resume", "--no-report", "--set", "checkpoint.every=3"))
    _assert_same_run(run_a, run_b)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_demo_has_no_future_warning(tmp_path, mode):
    """transformers' deprecations (e.g. ``past_key_values``) are errors here."""
    proc = subprocess.run(
        [
            sys.executable,
            "-W",
            "error::FutureWarning",
            "-m",
            "rl_trainer.cli",
            "run",
            "demo",
            "--no-report",
            *("--set", f"run_dir={tmp_path / 'demo'}"),
            *("--set", "sft.steps=1", "--set", "rl.steps=2", "--set", "eval.every=1"),
            *("--set", "rollout.prompts_per_step=4", "--set", "task.n_eval=8"),
            *("--set", f"rl.async_generation={mode == 'async'}".lower()),
            *("--set", "logging.progress=false", "--set", "logging.tensorboard=false"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    summary = json.loads(proc.stdout.splitlines()[0])
    assert (summary["sft_steps_this_run"], summary["rl_steps_this_run"]) == (1, 2)
