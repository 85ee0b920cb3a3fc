"""Off-policy correction is on by default where rollouts can be stale.

Asynchronous generation with ``rl.max_staleness >= 1`` trains on tokens sampled by an older
policy; unless the recipe chooses ``algorithm.loss.correction`` itself, the trainer weighs them
by truncated importance sampling (``tis``). The synchronous loop, staleness 0, an explicit choice
and truncated sampling (whose log-probs the config cannot vouch for) are left as they are.
"""

from __future__ import annotations

import json

import pytest

from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer

ASYNC = {"async_generation": True, "max_staleness": 1, "steps": 3}


def _loss(recipe: dict) -> dict:
    return load_trainer_config(recipe).algorithm.loss


def test_async_with_staleness_defaults_to_tis(tiny_recipe_dict, tmp_path):
    assert _loss(tiny_recipe_dict(tmp_path / "r", rl=ASYNC))["correction"] == "tis"
    continuous = {**ASYNC, "async_mode": "continuous"}
    assert _loss(tiny_recipe_dict(tmp_path / "r", rl=continuous))["correction"] == "tis"


@pytest.mark.parametrize(
    "sections",
    [
        {"rl": {"steps": 3}},  # synchronous
        {"rl": {**ASYNC, "max_staleness": 0}},  # async that reproduces the synchronous run
    ],
    ids=["sync", "staleness0"],
)
def test_on_policy_runs_get_no_correction(tiny_recipe_dict, tmp_path, sections):
    assert "correction" not in _loss(tiny_recipe_dict(tmp_path / "r", **sections))


def test_an_explicit_choice_wins(tiny_recipe_dict, tmp_path):
    recipe = tiny_recipe_dict(
        tmp_path / "r", rl=ASYNC, algorithm={"loss": {"correction": "none", "kl_coef": 0.0}}
    )
    assert _loss(recipe)["correction"] == "none"
    recipe = tiny_recipe_dict(tmp_path / "r", rl=ASYNC, algorithm={"loss": {"correction": "mis"}})
    assert _loss(recipe)["correction"] == "mis"


def test_truncated_sampling_is_left_to_the_recipe(tiny_recipe_dict, tmp_path):
    rollout = {
        "prompts_per_step": 2,
        "n_samples": 2,
        "sampling": {"temperature": 1.0, "max_new_tokens": 4, "top_p": 0.9},
    }
    assert "correction" not in _loss(tiny_recipe_dict(tmp_path / "r", rl=ASYNC, rollout=rollout))


def test_an_async_run_trains_with_the_importance_weights(tiny_recipe_dict, tmp_path):
    """The default reaches the loss: the async run logs TIS weights on its stale steps."""
    run_dir = tmp_path / "async"
    Trainer(load_trainer_config(tiny_recipe_dict(run_dir, rl=ASYNC))).run()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rl = [r for r in rows if r["phase"] == "rl" and "train/loss" in r]
    assert len(rl) == 3
    assert all("train/tis_weight_mean" in r for r in rl)
    assert all(0 < r["train/tis_weight_mean"] <= 2.0 for r in rl)
