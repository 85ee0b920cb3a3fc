"""The ``smollm2_math`` recipe on the real model, 3 RL steps (kept short: 2 prompts x 4 samples,
6 new tokens, an eval of 4 held-out prompts before and after). benchmarks/real_model.py runs it
in full."""

from __future__ import annotations

import json

from rl_hf.convert import smollm2_135m_instruct
from rl_trainer.cli import main as rl_train
from rl_trainer.smollm2_math import SmolMathTask


def test_smollm2_math_task_scores_answer_and_format() -> None:
    task = SmolMathTask(SmolMathTask.Config(n_train=20, n_eval=4))
    ex = task.examples("eval")[0]
    assert ex["prompt"].startswith("<|im_start|>system\nSolve the problem.")
    assert ex["prompt"].endswith("<|im_start|>assistant\n")
    assert task.score(ex["label"] + "<|im_end|>", ex["label"])["reward"] == 1.0
    assert task.score("ANSWER: 99", ex["label"]) == {"reward": 0.3, "format": 1.0, "exact": 0.0}
    assert task.score("The answer is 7", ex["label"])["reward"] == 0.0
    train = {e["prompt"] for e in task.examples("train")}
    assert not train & {e["prompt"] for e in task.examples("eval")}


def test_smollm2_math_runs_three_steps_on_the_real_model(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    sets = {
        "model.path": str(smollm2_135m_instruct()),
        "run_dir": str(run_dir),
        "rl.steps": "3",
        "rollout.prompts_per_step": "2",
        "rollout.n_samples": "4",
        "rollout.sampling.max_new_tokens": "6",
        "eval.every": "3",
        "eval.max_prompts": "4",
        "eval.n_samples": "1",
        "eval.sampling.max_new_tokens": "6",
        "logging.progress": "false",
    }
    args = ["run", "smollm2_math", "--no-report"]
    args += [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert rl_train(args) == 0, capsys.readouterr().err[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "rl" and "perf/step_time" in r]
    assert len(steps) == 3
    for r in steps:  # a group of equal rewards has no advantage, so grad_norm may be 0
        assert 0.0 <= r["rollout/reward_mean"] <= 1.0
        assert r["train/grad_norm"] >= 0 and r["train/mismatch"] < 1e-3
        assert r["rollout/staleness_max"] == 0
    evals = [r for r in records if "eval/reward_mean" in r]
    assert [r["step"] for r in evals] == [0, 3]
