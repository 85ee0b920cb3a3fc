"""The learning checks of ``make test``: each one's recipe, statistic and threshold, in one place.

A learning test asserts that a fixed-seed run's reward rose by a threshold. On another machine
(another CPU model, other float kernels) the same seed samples another trajectory, so each
threshold here is sized from ``benchmarks/learning_margins.py``, which runs the same recipe over
seeds 1-5 and records the statistic's mean, spread and minimum in
``benchmarks/results/learning_margins.json``. Rule: the threshold sits at least 2.5 standard
deviations below the seeds' mean and below every seed's value (the margin is stated beside each
check); a claim that needs a longer run than ``make test`` affords to clear that rule is checked
in ``make test-long`` instead. The tests and the benchmark both import this module, so they measure the same thing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The Ray end-to-end recipe (tests/test_e2e_ray.py runs it on Ray; the margins are measured on the
# local runtime, whose trajectories are the same runs: Ray with max_staleness 0 equals local).
RAY_RECIPE: dict[str, Any] = {
    "seed": 3,
    "model": {
        "init": {
            "arch": "qwen2",
            "hidden_size": 64,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
            "intermediate_size": 128,
        }
    },
    "task": {"type": "reverse", "n_train": 500, "n_eval": 16, "min_len": 2, "max_len": 3},
    "policy": {"type": "hf", "lr": 0.002},
    "generator": {"type": "hf"},
    "weight_transport": {"type": "disk_full"},
    "sft": {"steps": 20, "batch_size": 32, "lr": 0.005},
    "rollout": {
        "prompts_per_step": 8,
        "n_samples": 8,
        "sampling": {"temperature": 1.0, "max_new_tokens": 5},
    },
    "algorithm": {"advantage": "grpo"},
    "rl": {"steps": 60},
    "eval": {"every": 15, "sampling": {"temperature": 0.0, "max_new_tokens": 5}},
    "checkpoint": {"every": 30, "keep": 2},
    "logging": {"tensorboard": False, "progress": False},
    "runtime": {"type": "ray", "generator": {"count": 2}},
}


def rl_rewards(rows: list[dict]) -> list[float]:
    """The training reward of each RL step, in order."""
    return [
        r["rollout/reward_mean"]
        for r in rows
        if r.get("phase") == "rl" and "rollout/reward_mean" in r
    ]


def eval_rewards(rows: list[dict]) -> list[float]:
    """The held-out reward of each evaluation, in order."""
    return [r["eval/reward_mean"] for r in rows if r.get("eval/reward_mean") is not None]


def _evals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get(key) is not None and "eval/reward_mean" in r]


def _rl(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if r.get("phase") == "rl" and key in r]


def train_gain(rows: list[dict], window: int) -> float:
    """Mean training reward of the last ``window`` RL steps minus that of the first ``window``."""
    rl = rl_rewards(rows)
    return sum(rl[-window:]) / window - sum(rl[:window]) / window


def eval_gain(rows: list[dict]) -> float:
    """Last held-out reward minus the first (taken before the first RL update)."""
    ev = eval_rewards(rows)
    return ev[-1] - ev[0]


@dataclass(frozen=True)
class Check:
    """One learning check: how to run it from the CLI and which statistics must clear what."""

    doc: str
    recipe: str | dict[str, Any]  # a built-in recipe name, or a recipe dict
    overrides: tuple[str, ...]
    stats: dict[str, Callable[[list[dict]], float]]
    thresholds: dict[str, float] = field(default_factory=dict)

    def cli_args(self, run_dir: Path, seed: int) -> list[str]:
        """``rl-train`` arguments running this check's recipe into ``run_dir`` with ``seed``."""
        if isinstance(self.recipe, dict):
            import yaml

            run_dir.parent.mkdir(parents=True, exist_ok=True)
            path = run_dir.parent / f"{run_dir.name}.yaml"
            path.write_text(yaml.safe_dump(self.recipe))
            recipe = str(path)
        elif self.recipe != "template":
            from rl_trainer.cli import recipe_path

            recipe = str(recipe_path(self.recipe))
        if self.recipe == "template":  # the task `rl-train new` writes, run as is
            from rl_trainer.scaffold import write_task

            run_dir.parent.mkdir(parents=True, exist_ok=True)
            recipe = str(write_task(f"{run_dir.name}_task", run_dir.parent) / "recipe.yaml")
        sets = [f"run_dir={run_dir}", f"seed={seed}", *self.overrides]
        return ["run", recipe, "--no-report", *[a for s in sets for a in ("--set", s)]]


LOCAL = ("runtime.type=local", "logging.progress=false")

ASYNC1 = ("rl.async_generation=true", "rl.max_staleness=1")

CHECKS: dict[str, Check] = {
    "ray_sync": Check(
        doc="tests/test_e2e_ray.py: the disaggregated sync run, the colocated run and the "
        "policy-rank-killed run (the same trajectory)",
        recipe=RAY_RECIPE,
        overrides=LOCAL,
        stats={"train_gain_15": lambda rows: train_gain(rows, 15)},
        # seeds 1-8: 0.126 +- 0.031 (min 0.078): 3.1 sd
        thresholds={"train_gain_15": 0.03},
    ),
    "ray_async1": Check(
        doc="tests/test_e2e_ray.py::test_async_staleness_one_learns_and_survives_a_killed_generator",
        recipe=RAY_RECIPE,
        overrides=(*LOCAL, *ASYNC1),
        stats={"train_gain_15": lambda rows: train_gain(rows, 15)},
        # with the default TIS correction, seeds 1-8: 0.129 +- 0.033 (min 0.062): 3.0 sd
        # (30 steps, before: 0.037 +- 0.018 without TIS, the failure seen on another machine)
        thresholds={"train_gain_15": 0.03},
    ),
    "ray_partial": Check(
        doc="tests/test_e2e_ray.py::test_partial_rollouts_resume_on_new_weights_across_engines "
        "(abort timing differs run to run)",
        recipe=RAY_RECIPE,
        overrides=(*LOCAL, *ASYNC1, "rl.partial_rollouts=true", "generator.max_batch_size=1"),
        stats={"train_gain_15": lambda rows: train_gain(rows, 15)},
        # seeds 1-8: 0.114 +- 0.040 (min 0.022; where aborts land varies run to run): 2.7 sd
        thresholds={"train_gain_15": 0.005},
    ),
    "ray_megatron": Check(
        doc="tests/test_e2e_ray.py: the Megatron TP=2 and DP=2 runs (measured with one rank)",
        recipe=RAY_RECIPE,
        overrides=(*LOCAL, "policy.type=megatron", "model.init.num_kv_heads=2"),
        stats={"train_gain_15": lambda rows: train_gain(rows, 15)},
        # seeds 1-8: 0.157 +- 0.023 (min 0.126): 5.5 sd
        thresholds={"train_gain_15": 0.03},
    ),
    "demo150": Check(
        doc="tests/test_e2e_learning.py::test_demo_recipe_learns",
        recipe="demo",
        overrides=("rl.steps=150", "eval.every=50", "logging.progress=false"),
        stats={"eval_gain": eval_gain, "train_gain_20": lambda rows: train_gain(rows, 20)},
        # seeds 1-5: eval_gain 0.185 +- 0.055 (min 0.112): 2.6 sd; train_gain_20 0.238 +- 0.035
        # (min 0.189): 5.4 sd
        thresholds={"eval_gain": 0.04, "train_gain_20": 0.05},
    ),
    "template": Check(
        doc="tests/test_walkthrough.py::test_template_learns_in_a_short_run",
        recipe="template",
        overrides=("logging.progress=false",),
        stats={"eval_gain": eval_gain, "train_gain_20": lambda rows: train_gain(rows, 20)},
        # seeds 1-5: train_gain_20 0.292 +- 0.142 (min 0.081); the held-out gain is bimodal
        # (0.036 .. 0.354: the 80-step warm-up on 64 rows leaves some seeds at 0.19 held-out,
        # others at 0.66), so it is reported, not asserted. Below the 2.5 sd rule: the test is
        # in `make test-long`; demo150 is the learning check of `make test`.
        thresholds={"train_gain_20": 0.05},
    ),
    "calculator": Check(
        doc="tests/test_e2e_tools.py::test_calculator_tool_use_learns",
        recipe="calculator",
        overrides=(
            "sft.steps=200",
            "rollout.prompts_per_step=8",
            "task.n_eval=32",
            "rl.steps=20",
            "eval.every=10",
            "checkpoint.every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
        ),
        stats={
            "eval_gain": eval_gain,
            "tool_call_rise": lambda rows: (
                _evals(rows, "eval/tool_call_mean")[-1] - _evals(rows, "eval/tool_call_mean")[0]
            ),
            "tool_calls_last": lambda rows: _evals(rows, "eval/tool_call_mean")[-1],
            "train_tool_calls_last5": lambda rows: (
                sum(_rl(rows, "rollout/tool_call_mean")[-5:]) / 5
            ),
        },
        # seeds 1-5: eval_gain 0.386 +- 0.111 (min 0.194): 2.6 sd; tool_call_rise 0.578 +- 0.10
        # (min 0.453); tool_calls_last 0.994 +- 0.014 (min 0.969); train last5 0.994 (min 0.978)
        thresholds={
            "eval_gain": 0.1,
            "tool_call_rise": 0.2,
            "tool_calls_last": 0.9,
            "train_tool_calls_last5": 0.9,
        },
    ),
}


def statistic(name: str, rows: list[dict]) -> dict[str, float]:
    """Every statistic of check ``name`` on a run's metrics rows."""
    return {key: round(fn(rows), 4) for key, fn in CHECKS[name].stats.items()}


def assert_learns(name: str, rows: list[dict]) -> None:
    """Assert that a run of check ``name`` cleared each threshold (with the measured margins)."""
    check = CHECKS[name]
    values = statistic(name, rows)
    for key, threshold in check.thresholds.items():
        assert values[key] > threshold, (
            f"{name}: {key} = {values[key]:+.3f}, needs > {threshold:+.3f} "
            f"(margins over seeds: benchmarks/results/learning_margins.json); rewards "
            f"{[round(x, 3) for x in rl_rewards(rows)]}"
        )
