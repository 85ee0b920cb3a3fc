"""Bounds on the reward, user code that may never return (issue 31): a hung call is abandoned
after ``rollout.reward_timeout_s`` and counted as ``reward_timeout``; the round's deadline
(``rollout.reward_round_timeout_s``) ends what is left; SIGTERM stops a run whose reward hangs
with the resumable exit status within seconds."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import yaml

from rl_buffer.failures import RolloutStats
from rl_buffer.scoring import Scorer
from rl_trainer.cli import EXIT_STOPPED
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

_FOREVER = threading.Event()  # never set: waiting on it is a call that never returns


def _hang_on(*texts: str):
    def reward(prompt, response, rollout=None):
        if response in texts:
            _FOREVER.wait()
        return 1.0

    return reward


def test_hung_sync_reward_is_abandoned_and_counted(text_group, char_tokenizer):
    """Two of four calls never return: each is given up after 0.3 s, its rollout fails with
    reward_timeout (cause: the time limit), the others are scored, in well under a second."""
    scorer = Scorer(_hang_on("x", "z"), char_tokenizer, timeout_s=0.3, reward_name="reward")
    g = text_group("p0", ["x", "y", "z", "w"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    took = time.monotonic() - t0
    assert 0.5 < took < 2.0, took
    assert stats.failed == {"reward_timeout": 2}
    assert (
        "did not return within 0.3 s (rollout.reward_timeout_s)"
        in stats.first["reward_timeout"].describe()
    )
    assert [r.reward for r in g.rollouts] == [None, 1.0, None, 1.0]
    assert scorer.caller.abandoned_threads == 2


def test_hung_async_reward_and_round_deadline(text_group, char_tokenizer):
    """An async reward that never returns is cancelled at the round's deadline even without a
    per-call limit."""

    async def reward(prompt, response, rollout=None):
        if response == "y":
            await asyncio.Event().wait()
        return 0.5

    scorer = Scorer(reward, char_tokenizer, timeout_s=None, round_timeout_s=0.4)
    g = text_group("p0", ["x", "y"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 2.0
    assert stats.failed == {"reward_timeout": 1}
    assert "round's deadline" in stats.first["reward_timeout"].error
    assert [r.reward for r in g.rollouts] == [0.5, None]


def test_sync_rewards_still_run_in_rollout_order(text_group, char_tokenizer):
    seen: list[str] = []
    scorer = Scorer(lambda p, t, r=None: seen.append(t) or 1.0, char_tokenizer, timeout_s=5)
    asyncio.run(scorer.score([text_group("p0", list("abcdef"))], RolloutStats()))
    assert seen == list("abcdef")


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


def test_hung_async_reward_hits_its_per_call_limit(text_group, char_tokenizer):
    async def reward(prompt, response, rollout=None):
        if response == "x":
            await asyncio.Event().wait()
        return 1.0

    scorer = Scorer(reward, char_tokenizer, timeout_s=0.3, round_timeout_s=None)
    g = text_group("p0", ["x", "y"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 1.5
    assert "did not return within 0.3 s" in stats.first["reward_timeout"].error


def test_calls_queued_behind_a_hung_one_meet_the_round_deadline(text_group, char_tokenizer):
    """Synchronous calls queue behind a hung one; at the round's deadline the running one and
    the queued ones are given up together."""
    scorer = Scorer(_hang_on("a"), char_tokenizer, timeout_s=None, round_timeout_s=0.4)
    g = text_group("p0", ["a", "b", "c"])
    stats = RolloutStats()
    t0 = time.monotonic()
    asyncio.run(scorer.score([g], stats))
    assert time.monotonic() - t0 < 1.5
    assert stats.failed == {"reward_timeout": 3}


def test_main_thread_rewards_run_inline(text_group, char_tokenizer):
    """math_equiv's own timeout is SIGALRM (main thread only): it is called on the main thread;
    other synchronous rewards in the worker thread."""
    from rl_core.rewards.math_answer import MathEquiv

    assert MathEquiv.main_thread
    threads: list[str] = []

    class Inline:
        main_thread = True

        def __call__(self, prompt, response, rollout=None):
            threads.append(threading.current_thread().name)
            return 1.0

    asyncio.run(
        Scorer(Inline(), char_tokenizer, timeout_s=5).score(
            [text_group("p", ["a"])], RolloutStats()
        )
    )
    asyncio.run(
        Scorer(
            lambda p, t, r=None: threads.append(threading.current_thread().name) or 1.0,
            char_tokenizer,
            timeout_s=5,
        ).score([text_group("p", ["a"])], RolloutStats())
    )
    assert threads == ["MainThread", "rl-user-call"]
