"""Bounds on the reward, user code that may never return (issue 31): a hung call is abandoned
after ``rollout.reward_timeout_s`` and counted as ``reward_timeout``; the round's deadline
(``rollout.reward_round_timeout_s``) ends what is left; SIGTERM stops a run whose reward hangs
with the resumable exit status within seconds. (The Scorer's own bound tests, without a run, are
in packages/rl-buffer/tests/test_scoring.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from rl_trainer.cli import EXIT_STOPPED
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def test_run_with_a_hanging_reward_counts_it_and_goes_on(tmp_path, tiny_recipe_dict, monkeypatch):
    """In a run, a reward that never returns on some rollouts: the run finishes, the metrics
    count the hung calls (rollout/failed/reward_timeout, rollout/failed_fraction)."""
    mod = tmp_path / "hang_reward.py"
    mod.write_text(
        textwrap.dedent(
            """
            import threading
            CALLS = [0]

            def score(prompt, response, rollout=None):
                CALLS[0] += 1
                if CALLS[0] % 4 == 1:  # one call in four never returns
                    threading.Event().wait()
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tiny_recipe_dict(
        tmp_path / "run",
        reward={"type": "hang_reward:score"},
        eval={"every": 0, "max_prompts": 0},
    )
    recipe["rollout"]["reward_timeout_s"] = 0.3
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    records = Trainer(load_trainer_config(path)).run()
    rl = [r for r in records if r.get("phase") == "rl" and "rollout/reward_mean" in r]
    assert [r["step"] for r in rl] == [1, 2]
    for r in rl:
        assert r["rollout/failed/reward_timeout"] == 1
        assert r["rollout/failed_fraction"] == pytest.approx(0.25)
    sys.modules.pop("hang_reward", None)


def test_sigterm_stops_a_run_whose_reward_hangs(tmp_path, tiny_recipe_dict):
    """SIGTERM while the reward hangs (per-call limit 300 s, the default): the hung call is
    abandoned after the stop's grace, the step finishes, a checkpoint is written and the run
    exits with the resumable status (75) within seconds."""
    marker = tmp_path / "hanging"
    (tmp_path / "stuck_reward.py").write_text(
        textwrap.dedent(
            f"""
            import pathlib, threading
            CALLS = [0]

            def score(prompt, response, rollout=None):
                CALLS[0] += 1
                if CALLS[0] == 6:  # a call of step 2 never returns
                    pathlib.Path({str(marker)!r}).write_text("x")
                    threading.Event().wait()
                return float(len(response) % 2)
            """
        )
    )
    recipe = tiny_recipe_dict(
        tmp_path / "run", reward={"type": "stuck_reward:score"}, eval={"every": 0}
    )
    recipe["rl"] = {"steps": 50}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "rl_trainer.cli", "run", str(path), "--no-report"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_STOPPED, out
    assert took < 10, took
    assert "stopped by SIGTERM" in out
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if r.get("phase") == "rl"][-1]
    assert last["step"] == 2 and last["rollout/failed/reward_timeout"] == 1
