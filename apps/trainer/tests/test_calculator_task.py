"""The calculator tool-use task: splits, labels with and without a tool call, scoring."""

from __future__ import annotations

import pytest

from rl_agents.examples.calculator import CALL_PATTERN, evaluate
from rl_core.errors import ConfigError
from rl_trainer.tasks import CalculatorTask


def test_splits_labels_and_held_out_prompts():
    task = CalculatorTask(CalculatorTask.Config(n_train=400, n_eval=20, direct_fraction=0.5))
    train, evals = task.examples("train"), task.examples("eval")
    assert len(train) == 400 and len(evals) == 20
    assert not {e["prompt"] for e in evals} & {e["prompt"] for e in train}
    direct = [e for e in train if not e["label"].startswith("CALC:")]
    assert 120 < len(direct) < 280  # about half answer without the tool
    for e in train[:50]:
        expr = e["prompt"].removesuffix("=")
        a, b = map(int, expr.split("*"))
        assert 10 <= a <= 99 and 10 <= b <= 99
        assert e["label"].endswith(f"ANSWER: {a * b}")
        if e["label"].startswith("CALC:"):
            # The transcript's call and observation are what the tool rollout produces.
            assert CALL_PATTERN.findall(e["label"]) == [expr]
            assert f"= {evaluate(expr)}\n" in e["label"]


def test_score():
    task = CalculatorTask(CalculatorTask.Config(n_train=1, n_eval=1))
    label = "CALC: 23*47\n= 1081\nANSWER: 1081"
    right = task.score("CALC: 23*47\n= 1081\nANSWER: 1081", label)
    assert right == {"reward": 1.0, "exact": 1.0, "tool_call": 1.0}
    guess = task.score("ANSWER: 1051", "ANSWER: 1081")
    assert guess == {"reward": 0.75, "exact": 0.0, "tool_call": 0.0}
    assert task.score("CALC: 23*47\n= 1081\n", label)["reward"] == 0.0  # no answer
    with pytest.raises(ValueError, match="ANSWER"):
        task.score("ANSWER: 1", "1081")
    with pytest.raises(ConfigError, match="direct_fraction"):
        CalculatorTask(CalculatorTask.Config(direct_fraction=1.5))
