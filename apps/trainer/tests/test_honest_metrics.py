"""Metrics that tell the truth (issue 31): failed rollouts count in every reward mean shown, by
one convention (a failure scores 0) in training and eval, with their fraction logged and on the
progress bar; ``eval.every: 0`` disables eval (step 0 included); ``rl-train eval --help`` names
the real output path."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import yaml

from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.ops.metrics import MetricsLogger


@pytest.fixture
def half_failing(tmp_path, monkeypatch):
    """A reward module whose every second call raises; the others score 1.0."""
    (tmp_path / "half_reward.py").write_text(
        textwrap.dedent(
            """
            CALLS = [0]

            def score(prompt, response, rollout=None):
                CALLS[0] += 1
                if CALLS[0] % 2 == 0:
                    raise ValueError("flaky verifier")
                return 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "half_reward:score"
    sys.modules.pop("half_reward", None)


def _run(tmp_path, tiny_recipe_dict, **sections):
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(tiny_recipe_dict(tmp_path / "run", **sections)))
    return Trainer(load_trainer_config(path)).run()


def test_half_failing_reward_shows_in_training_and_eval_means(
    tmp_path, tiny_recipe_dict, half_failing
):
    """Half the rollouts fail: the training mean is 0.5, not the 1.0 of the survivors, as eval
    counts them, and both log the failed fraction."""
    records = _run(
        tmp_path,
        tiny_recipe_dict,
        reward={"type": half_failing},
        eval={"every": 2, "max_prompts": 4},
    )
    rl = [r for r in records if r["phase"] == "rl" and r["step"] > 0]
    assert len(rl) == 2
    for r in rl:
        assert r["rollout/failed/reward_error"] == 2
        assert r["rollout/failed_fraction"] == pytest.approx(0.5)
        assert r["rollout/reward_mean"] == pytest.approx(0.5)
        assert r["rollout/reward_mean_scored"] == pytest.approx(1.0)
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert r["eval/failed_fraction"] == pytest.approx(0.5)
        assert r["eval/reward_mean"] == pytest.approx(0.5)
    from rl_trainer.ops.report import build_figure  # the report draws the fraction by the mean

    reward = next(ax for ax in build_figure({"run": records}).axes if ax.get_title() == "Reward")
    labels = {line.get_label() for line in reward.get_lines()}
    assert {"rollout/failed_fraction", "eval/failed_fraction"} <= labels, labels


def test_progress_bar_shows_failures(tmp_path):
    logger = MetricsLogger(
        tmp_path, tensorboard=False, progress=True, phase_steps={"rl": 4}, resume_lines=None
    )
    try:
        logger.log(
            {
                "phase": "rl",
                "step": 1,
                "rollout/reward_mean": 0.5,
                "rollout/failed_fraction": 0.5,
            },
            global_step=1,
        )
        (task,) = logger._progress.tasks
        assert "reward 0.500" in task.fields["info"] and "failed 50%" in task.fields["info"]
        logger.log(
            {"phase": "rl", "step": 2, "rollout/reward_mean": 1.0, "rollout/failed_fraction": 0.0},
            global_step=2,
        )
        assert "failed" not in logger._progress.tasks[0].fields["info"]
    finally:
        logger.close()


def test_eval_every_0_disables_eval_at_step_0_too(tmp_path, tiny_recipe_dict):
    records = _run(tmp_path, tiny_recipe_dict, eval={"every": 0})
    assert not any(k.startswith("eval/") for r in records for k in r)
    assert [r["step"] for r in records if r["phase"] == "rl" and r["step"] > 0] == [1, 2]


def test_eval_help_names_the_real_output_path():
    out = subprocess.run(
        [sys.executable, "-m", "rl_trainer.cli", "eval", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "RUN/eval/NAME/eval.json" in flat
    assert "CHECKPOINT/eval.json" not in flat


def test_one_step_counter_across_phases(tmp_path, tiny_recipe_dict, capsys):
    """SFT then RL: every record carries its phase's ``step`` and the ``global_step`` that
    checkpoint names use; sample traces, ``rl-train show`` and ``rl-train eval`` name it too."""
    from rl_trainer.cli import main
    from rl_trainer.show import show_samples

    records = _run(
        tmp_path,
        tiny_recipe_dict,
        sft={"steps": 2, "batch_size": 8},
        eval={"every": 1, "max_prompts": 2},
        checkpoint={"every": 1, "keep": 10},
        logging={"tensorboard": False, "progress": False, "samples_every": 2},
    )
    run = tmp_path / "run"
    seen = [(r["phase"], r["step"], r["global_step"]) for r in records]
    assert seen == [("sft", 1, 1), ("sft", 2, 2), ("rl", 0, 2), ("rl", 1, 3), ("rl", 2, 4)]
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == [f"step_{g:06d}" for g in (1, 2, 3, 4)]
    (line,) = [json.loads(x) for x in (run / "samples.jsonl").read_text().splitlines()][:1]
    assert (line["step"], line["global_step"]) == (2, 4)
    show_samples(run, step=2)
    assert "RL step 2 (global step 4)" in capsys.readouterr().out
    assert main(["eval", str(run / "checkpoints" / "step_000003")]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["step"], summary["global_step"]) == (1, 3)
