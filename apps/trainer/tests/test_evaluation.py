"""Evaluation sets: several datasets, per-dataset sampling/reward/schedule, pass@k."""

from __future__ import annotations

import pytest

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer


def test_eval_datasets_schedule_reward_and_pass_at_k(tmp_path, tiny_recipe_dict):
    run_dir = tmp_path / "run"
    eval_file = run_dir / "data" / "eval.jsonl"  # written by the task before the sets are built
    cfg = load_trainer_config(
        tiny_recipe_dict(
            run_dir,
            seed=5,
            eval=dict(
                every=1,
                datasets=[
                    {
                        "name": "sampled",
                        "data": {"type": "jsonl", "path": str(eval_file), "shuffle": False},
                        "n_samples": 4,
                        "pass_k": [1, 2, 4],
                        "correct_threshold": 0.5,
                        "sampling": {"temperature": 1.0, "max_new_tokens": 4},
                        "every": 2,
                    },
                    {
                        "name": "const",
                        "data": {"type": "jsonl", "path": str(eval_file), "shuffle": False},
                        "max_prompts": 3,
                        "reward": {"type": "tests_eval_reward:constant"},
                        "every": 5,
                    },
                    {  # every 0 disables a set, step 0 included
                        "name": "off",
                        "data": {"type": "jsonl", "path": str(eval_file), "shuffle": False},
                        "max_prompts": 1,
                        "every": 0,
                    },
                ],
            ),
        )
    )
    import sys
    import types

    mod = types.ModuleType("tests_eval_reward")
    mod.constant = lambda prompt, response, rollout: 0.25
    sys.modules["tests_eval_reward"] = mod
    try:
        records = Trainer(cfg).run()
    finally:
        del sys.modules["tests_eval_reward"]
    by_step = {r["step"]: r for r in records if r["phase"] == "rl" and "eval/reward_mean" in r}
    assert sorted(by_step) == [0, 1, 2]
    # step 0: every set but "off"; step 1: only the default set (every=1); step 2 (last):
    # default + sampled + const (every 5: step 0 and the last step)
    assert "eval/sampled/pass@4" in by_step[0] and "eval/const/reward_mean" in by_step[0]
    assert not any(k.startswith(("eval/sampled/", "eval/const/")) for k in by_step[1])
    assert "eval/sampled/pass@1" in by_step[2] and "eval/const/reward_mean" in by_step[2]
    assert not any(k.startswith("eval/off/") for r in by_step.values() for k in r)
    # the dataset's own reward, not the task's
    assert by_step[0]["eval/const/reward_mean"] == pytest.approx(0.25)
    assert by_step[0]["eval/const/accuracy"] == 0.0  # 0.25 < default threshold 1.0
    for step in (0, 2):
        rec = by_step[step]
        p1, p2, p4 = (rec[f"eval/sampled/pass@{k}"] for k in (1, 2, 4))
        assert 0.0 <= p1 <= p2 <= p4 <= 1.0
        # pass@1 is the per-sample accuracy when every prompt has the same n
        assert p1 == pytest.approx(rec["eval/sampled/accuracy"])
        assert 0.0 <= rec["eval/sampled/exact_mean"] <= p1  # exact implies >= 0.5
    assert "eval/pass@1" not in by_step[0]  # the default set reports pass@k only if asked


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"n_samples": 2, "pass_k": [4]}, r"eval.pass_k: \[4\] outside 1..n_samples \(2\)"),
        (
            {"datasets": [{"name": "a/b", "data": {"type": "jsonl", "path": "x"}}]},
            r"eval.datasets\[0\].name",
        ),
        (
            {
                "datasets": [
                    {"name": "a", "data": {"type": "jsonl", "path": "x"}},
                    {"name": "a", "data": {"type": "jsonl", "path": "x"}},
                ]
            },
            r"eval.datasets\[1\].name: 'a' must be a non-empty, unique name",
        ),
        (
            {"pass_k": [8], "datasets": [{"name": "a", "data": {"type": "jsonl", "path": "x"}}]},
            r"eval.pass_k",
        ),
    ],
)
def test_eval_config_errors_name_the_field(tmp_path, tiny_recipe_dict, section, message):
    with pytest.raises(ConfigError, match=message):
        load_trainer_config(tiny_recipe_dict(tmp_path, eval=section))


@pytest.mark.parametrize("every", [0, 2])
def test_async_run_ends_with_the_generator_at_the_final_weights(tmp_path, tiny_recipe_dict, every):
    """An async run serves each round the version it was scheduled with; at the end the
    generator holds the final policy's weights, with or without an eval at the last step."""
    cfg = load_trainer_config(
        tiny_recipe_dict(
            tmp_path / "run",
            rl={"steps": 3, "async_generation": True, "max_staleness": 1},
            eval={"every": every},
        )
    )
    trainer = Trainer(cfg)
    trainer.run()
    assert trainer.policy.version == 3
    assert trainer.generator.weight_version == trainer.policy.version
