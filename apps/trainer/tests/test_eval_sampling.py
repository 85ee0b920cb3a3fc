"""Eval samples like training (lengths, stop tokens) unless it sets its own, greedy by default;
greedy eval with repeated samples is refused at load."""

from __future__ import annotations

import pytest

from rl_buffer.scoring import Scorer
from rl_core.errors import ConfigError
from rl_trainer.config import EvalSamplingConfig, SamplingConfig, load_trainer_config
from rl_trainer.loop import Trainer


def test_resolve_layers_fields_and_keeps_greedy_default():
    train = SamplingConfig(
        temperature=0.9, top_p=0.8, top_k=5, max_new_tokens=7, stop_token_ids=[3]
    )
    got = EvalSamplingConfig().resolve(train)
    assert got == SamplingConfig(
        temperature=0.0, top_p=0.8, top_k=5, max_new_tokens=7, stop_token_ids=[3]
    )
    eval_level = EvalSamplingConfig(temperature=0.5, max_new_tokens=11)
    dataset = EvalSamplingConfig(stop_token_ids=[])
    got = dataset.resolve(train, eval_level)
    assert (got.temperature, got.max_new_tokens, got.stop_token_ids) == (0.5, 11, [])
    assert dataset.resolve(train, EvalSamplingConfig()).temperature == 0.0


def test_eval_sets_inherit_rollout_sampling(tmp_path, tiny_recipe_dict):
    run_dir = tmp_path / "run"
    eval_file = run_dir / "data" / "eval.jsonl"  # written by the task before the sets are built
    recipe = tiny_recipe_dict(
        run_dir,
        eval={
            "datasets": [
                {
                    "name": "long",
                    "data": {"type": "jsonl", "path": str(eval_file)},
                    "sampling": {"max_new_tokens": 9},
                },
                {
                    "name": "sampled",
                    "data": {"type": "jsonl", "path": str(eval_file)},
                    "n_samples": 3,
                    "pass_k": [1, 3],
                    "sampling": {"temperature": 0.7},
                },
            ]
        },
    )
    recipe["rollout"]["sampling"] = {"temperature": 1.0, "max_new_tokens": 3, "stop_token_ids": [7]}
    trainer = Trainer(load_trainer_config(recipe))
    by_name = {s.name: s.sampling for s in trainer.eval_sets}
    default = by_name[None]
    # not the old eval default of 32 tokens and no stops: the training lengths and stops
    assert (default.max_new_tokens, default.stop_token_ids, default.temperature) == (3, (7,), 0.0)
    assert (by_name["long"].max_new_tokens, by_name["long"].stop_token_ids) == (9, (7,))
    assert (by_name["sampled"].temperature, by_name["sampled"].max_new_tokens) == (0.7, 3)


def test_eval_responses_are_cut_at_the_training_length(tmp_path, tiny_recipe_dict):
    recipe = tiny_recipe_dict(tmp_path / "run")
    recipe["rollout"]["sampling"] = {"temperature": 1.0, "max_new_tokens": 2}
    recipe["rl"] = {"steps": 1}
    trainer = Trainer(load_trainer_config(recipe))
    seen: list[int] = []

    def length_reward(prompt, response, rollout):
        seen.append(rollout.response_length)
        return 0.0

    trainer.eval_sets[0].scorer = Scorer(length_reward, trainer.tokenizer)
    trainer.run()
    assert seen and max(seen) <= 2


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"n_samples": 4, "pass_k": [1, 4]},
            r"eval.n_samples: 4 samples per prompt under greedy decoding "
            r"\(eval.sampling.temperature is the eval default\).*Set eval.sampling.temperature "
            r"above 0",
        ),
        (
            {"n_samples": 2, "sampling": {"temperature": 0.0}},
            r"eval.n_samples: 2 .*\(eval.sampling.temperature is set to 0\)",
        ),
        (
            {"datasets": [{"name": "a", "data": {"type": "jsonl", "path": "x"}, "n_samples": 4}]},
            r"eval.datasets\[0\].n_samples: 4 samples per prompt under greedy decoding",
        ),
    ],
)
def test_greedy_eval_with_repeated_samples_is_refused(tmp_path, tiny_recipe_dict, section, message):
    with pytest.raises(ConfigError, match=message):
        load_trainer_config(tiny_recipe_dict(tmp_path, eval=section))


@pytest.mark.parametrize(
    "section",
    [
        {"n_samples": 4, "pass_k": [1, 4], "sampling": {"temperature": 1.0}},
        # a dataset inherits eval.sampling's temperature
        {
            "sampling": {"temperature": 0.6},
            "datasets": [{"name": "a", "data": {"type": "jsonl", "path": "x"}, "n_samples": 4}],
        },
        {"n_samples": 1, "pass_k": [1]},
    ],
)
def test_sampled_or_single_sample_eval_is_accepted(
    tmp_path, tiny_recipe_dict, section, monkeypatch
):
    (tmp_path / "x").write_text('{"prompt": "ab=", "label": "ba"}\n')
    monkeypatch.chdir(tmp_path)  # the dataset's relative path "x" resolves against the cwd
    load_trainer_config(tiny_recipe_dict(tmp_path, eval=section))
