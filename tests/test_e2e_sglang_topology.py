"""Two SGLang server groups from one recipe, end to end through the trainer on CPU: the
``sglang_topology`` recipe launches a ``policy`` group and a ``judge`` group (one server each),
its rollout function calls both on every prompt, and only the policy group receives the weight
updates. Two RL steps; the servers' start-up (about a minute, in parallel) dominates."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from rl_trainer.cli import recipe_path


def _generator_type() -> str:
    """``sglang_topology`` once rl-sglang is installed with its entry points; a venv installed
    before the entry point existed resolves the same class by module reference."""
    names = {ep.name for ep in importlib.metadata.entry_points(group="rl.generators")}
    return "sglang_topology" if "sglang_topology" in names else "rl_sglang.topology:SGLangTopology"


@pytest.mark.slow
def test_rollout_function_calls_two_groups_and_only_the_policy_group_is_updated(tmp_path, cli):
    run_dir, dumps, logs = tmp_path / "run", tmp_path / "dumps", tmp_path / "logs"
    sets = {
        "run_dir": run_dir,
        "generator.type": _generator_type(),
        "generator.defaults.log_dir": logs,
        "rollout.dump_dir": dumps,
    }
    args = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = cli("run", str(recipe_path("sglang_topology")), "--no-report", *args)
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-5000:]

    # One server per group, each launched with its own log directory.
    for group in ("policy", "judge"):
        assert len(list((logs / group).glob("sglang-0-*.log"))) == 1, group
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0 and "perf/step_time" in r]
    assert len(rl) == 2
    for step, policy_version in ((1, 0), (2, 1)):
        lines = (dumps / f"step_{step:06d}.jsonl").read_text().splitlines()
        rollouts = [r for line in lines[1:] for r in json.loads(line)["rollouts"]]
        assert len(rollouts) == 8
        for r in rollouts:
            judge = r["metadata"]["judge"]
            assert judge["group"] == "judge" and judge["tokens"], r["metadata"]
            # The judge group keeps its weights; the policy group got step 1's update.
            assert judge["weight_version"] == 0
            assert set(r["versions"]) == {policy_version}, (step, r["versions"])
