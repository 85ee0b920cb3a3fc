"""The coding-agent recipe end to end through the trainer on the tiny model: one RL step in
which an unmodified openai-client agent program (a subprocess per sample) talks to the policy
through the agent server, its shell tool sandboxed and its reward from hidden tests; the
episodes are on disk afterwards."""

from __future__ import annotations

import json

from rl_trainer.cli import recipe_path


def test_coding_agent_recipe_runs_and_records_episodes(tmp_path, cli):
    run_dir = tmp_path / "coding"
    sets = [
        f"run_dir={run_dir}",
        f"rollout.generate_fn.episodes_dir={run_dir / 'episodes'}",
        "rl.steps=1",  # the recipe runs 2; one keeps `make test` short
    ]
    proc = cli("run", str(recipe_path("coding_agent")), *[a for s in sets for a in ("--set", s)])
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    assert [r["step"] for r in rl] == [1]
    for r in rl:
        assert not any(k.startswith("rollout/failed/") for k in r), r
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
    episodes = [json.loads(p.read_text()) for p in sorted((run_dir / "episodes").iterdir())]
    train = [ep for ep in episodes if ep["prompt_uid"].startswith("train")]
    assert len(train) == 2 * 2  # prompts x samples (the rest: the step-0 evaluation)
    for ep in episodes:
        assert ep["failure"] is None and ep["tests_total"] >= 2
        assert 0 <= ep["tests_passed"] <= ep["tests_total"]
        assert ep["reward"] == ep["tests_passed"] / ep["tests_total"]
        assert ep["sandbox"] in ("bwrap", "namespace", "rlimits")
        assert 1 <= len(ep["turns"]) <= 3
        for turn in ep["turns"]:
            assert 1 <= turn["output_tokens"] <= 24 and turn["prompt_tokens"] > 0
            assert len(turn["output_ids"]) == turn["output_tokens"]
        assert "solution.py" in ep["task"]
        assert json.loads(ep["agent"]["stdout"].splitlines()[-1])["turns"] == len(ep["turns"])
