"""Algorithm presets (``rl_trainer/presets/*.yaml``) as overlays under a recipe.

Every preset's overlay recipe (``rl-train run grpo`` ... ``opd``: the demo under the preset) runs
two RL steps with finite metrics and its algorithm's own; ``--preset dapo`` runs on the demo and
on the ``rl-train new`` template; the recipe's values win over the preset's and ``--set`` over
both; an unknown preset is refused naming the known ones; every preset loads on the demo and on
the template; ``check`` shows the merged sections; ``rl-train recipes`` lists examples and
presets apart."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from rl_core.errors import ConfigError
from rl_hf import TinyModelSpec, build_tiny_model
from rl_trainer.cli import main, recipe_path
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.presets import list_examples, list_presets, load_preset
from rl_trainer.scaffold import write_task


def parity_reward(prompt, response, rollout) -> float:
    """A reward that varies across a random model's samples, so no group is dropped as flat."""
    return float(sum(rollout.tokens[rollout.response_start :]) % 3) / 2


# preset -> metrics that must be in every RL step's record (besides the common ones)
PRESETS = {
    "grpo": ["train/kl", "train/pg_clipfrac"],
    "dr_grpo": ["train/pg_clipfrac"],
    "dapo": ["rollout/overlong_penalty_mean", "rollout/dynamic_filter/keep_rate"],
    "gspo": ["train/pg_clipfrac", "train/ppo_kl"],
    "reinforce_pp": ["train/kl"],
    "rloo": ["train/kl"],
    "ppo": ["critic/value_error", "critic/value_mean", "critic/clipfrac", "train/pg_clipfrac"],
    "opd": ["distill/reverse_kl", "distill/teacher_logp_mean"],
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_runs_two_steps(name, tmp_path, tiny_recipe_dict):
    tiny = tiny_recipe_dict(tmp_path)["model"]["init"]  # the trainer tests' one-layer model
    teacher = []
    if name == "opd":  # a teacher of the student's shape with other weights
        spec = TinyModelSpec(**{**tiny, "seed": int(tiny.get("seed", 0)) + 1})
        teacher = [f"teacher.path={build_tiny_model(tmp_path / 'teacher', spec)}"]
    preset = load_trainer_config(recipe_path(name), teacher)
    minis = preset.rl.mini_batches_per_step
    init = ", ".join(f"{k}: {v}" for k, v in tiny.items())
    overrides = [
        f"run_dir={tmp_path}",
        "rl.steps=2",
        "sft.steps=0",
        f"model.init={{{init}}}",
        "task.n_train=64",
        "task.n_eval=4",
        f"rollout.prompts_per_step={2 * minis}",
        "rollout.n_samples=2",
        "rollout.sampling.max_new_tokens=6",
        "eval.every=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"reward.type={__file__}:parity_reward",
    ]
    if preset.rollout.overlong_penalty is not None:
        overrides.append("rollout.overlong_penalty.band=2")
    overrides += teacher
    cfg = load_trainer_config(recipe_path(name), overrides)
    trainer = Trainer(cfg)
    steps = [r for r in trainer.run() if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in steps] == [1, 2]
    assert trainer.policy.version == 2 * preset.rl.updates_per_step
    for r in steps:
        assert r["train/optimizer_steps"] == preset.rl.updates_per_step
        for key in ["train/loss", "train/grad_norm", "rollout/reward_mean", *PRESETS[name]]:
            assert key in r, (name, key, sorted(r))
            assert math.isfinite(r[key]), (name, key, r[key])


def _tiny_overrides(tmp_path, tiny_recipe_dict, prompts=4):
    """Overrides that make any recipe a two-step run of the trainer tests' one-layer model on
    a reward that varies over a random model's samples (so DAPO's filter keeps groups)."""
    tiny = tiny_recipe_dict(tmp_path)["model"]["init"]
    init = ", ".join(f"{k}: {v}" for k, v in tiny.items())
    return [
        f"run_dir={tmp_path / 'run'}",
        "rl.steps=2",
        "sft.steps=0",
        f"model.init={{{init}}}",
        "model.path=null",
        f"rollout.prompts_per_step={prompts}",
        "rollout.n_samples=2",
        "rollout.sampling.max_new_tokens=6",
        "eval.every=0",
        "logging.tensorboard=false",
        "logging.progress=false",
        f"reward.type={__file__}:parity_reward",
    ]


def _assert_dapo(cfg):
    """The settings the dapo preset brings (the demo and the template set none of them)."""
    assert cfg.preset == "dapo"
    assert [f.type for f in cfg.rollout.filters] == ["reward_std"]
    assert cfg.rollout.over_sampling_factor == 1.5
    assert cfg.rollout.overlong_penalty is not None and cfg.rollout.overlong_penalty.band == 4
    assert cfg.rl.mini_batches_per_step == 4
    assert cfg.algorithm.loss["eps_clip_high"] == 0.28
    assert cfg.rollout.surplus_groups == "discard"


def test_cli_run_demo_with_preset_dapo(tmp_path, tiny_recipe_dict, capsys):
    """`rl-train run demo --preset dapo` runs and its stored config has DAPO's settings."""
    overrides = [*_tiny_overrides(tmp_path, tiny_recipe_dict), "task.n_train=64", "task.n_eval=4"]
    argv = ["run", "demo", "--preset", "dapo", "--no-report"]
    for o in overrides:
        argv += ["--set", o]
    assert main(argv) == 0
    stored = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert stored["preset"] == "dapo"
    assert stored["rollout"]["filters"] == [{"type": "reward_std"}]
    assert stored["rl"]["mini_batches_per_step"] == 4
    _assert_dapo(load_trainer_config(recipe_path("demo"), ["preset=dapo", *overrides]))
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r.get("phase") == "rl" and r.get("step")]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["train/optimizer_steps"] == 4
        assert "rollout/dynamic_filter/keep_rate" in r and "rollout/overlong_penalty_mean" in r
        assert r["rollout/dynamic_filter/surplus"] == 0  # none carried over
    # over-sampling by 1.5 overshoots the batch: what it kept beyond it was discarded
    assert sum(r.get("rollout/dynamic_filter/surplus_discarded", 0) for r in steps) > 0


def test_preset_on_the_new_template_runs(tmp_path, tiny_recipe_dict):
    """`preset: dapo` written into the `rl-train new` template loads and trains two steps."""
    recipe = write_task("mytask", tmp_path) / "recipe.yaml"
    recipe.write_text("preset: dapo\n" + recipe.read_text())
    cfg = load_trainer_config(recipe, _tiny_overrides(tmp_path, tiny_recipe_dict))
    _assert_dapo(cfg)
    assert cfg.data.train is not None  # still the template's own task
    trainer = Trainer(cfg)
    steps = [r for r in trainer.run() if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(math.isfinite(r["train/loss"]) for r in steps)


def test_recipe_values_win_over_the_preset_and_set_over_both(tmp_path, tiny_recipe_dict):
    recipe = tiny_recipe_dict(
        tmp_path,
        preset="dapo",
        algorithm={"loss": {"eps_clip_high": 0.3}},
        rollout={
            "prompts_per_step": 4,
            "n_samples": 2,
            "sampling": {"max_new_tokens": 6},
            "over_sampling_factor": 2.0,
        },
    )
    cfg = load_trainer_config(recipe)
    assert cfg.algorithm.loss == {"variant": "ppo", "eps_clip_low": 0.2, "eps_clip_high": 0.3}
    assert cfg.rollout.over_sampling_factor == 2.0  # the recipe's
    assert [f.type for f in cfg.rollout.filters] == ["reward_std"]  # the preset's, not set
    cfg = load_trainer_config(
        recipe, ["algorithm.loss.eps_clip_high=0.4", "rl.mini_batches_per_step=2"]
    )
    assert cfg.algorithm.loss["eps_clip_high"] == 0.4
    assert cfg.rl.mini_batches_per_step == 2
    # --preset (as `preset=` first in the overrides) replaces the recipe's preset: field
    cfg = load_trainer_config(recipe, ["preset=gspo"])
    assert cfg.preset == "gspo" and cfg.algorithm.loss["variant"] == "gspo"
    assert cfg.rollout.filters == []


def test_unknown_preset_is_refused_naming_the_known_ones(tmp_path, tiny_recipe_dict):
    with pytest.raises(ConfigError) as e:
        load_trainer_config(tiny_recipe_dict(tmp_path, preset="dappo"))
    for name in ["dappo", *list_presets()]:
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="known presets: dapo"):
        load_trainer_config(recipe_path("demo"), ["preset=nope"])
    assert main(["check", "demo", "--preset", "nope"]) == 1


@pytest.mark.parametrize("name", list_presets())
def test_every_preset_loads_on_the_demo_and_the_template(name, tmp_path):
    preset = load_preset(name)
    extra = [f"teacher.path={tmp_path}"] if name == "opd" else []
    template = write_task("t", tmp_path) / "recipe.yaml"
    # (the parity reward: one template's reward.py per process imports as module `reward`)
    reward = [f"reward.type={__file__}:parity_reward"]
    for recipe in [recipe_path("demo"), template]:
        cfg = load_trainer_config(recipe, [f"preset={name}", *extra, *reward])
        assert cfg.preset == name
        # the demo and the template set no algorithm fields but the demo's clip-high and
        # reference, so the preset's estimator, aggregation and update settings apply
        assert cfg.algorithm.advantage == preset["algorithm"]["advantage"]
        alg = preset["algorithm"]
        assert cfg.algorithm.aggregation == alg.get("aggregation", "token")
        assert cfg.algorithm.loss["variant"] == alg["loss"]["variant"]
        for key, value in preset.get("rl", {}).items():
            assert getattr(cfg.rl, key) == value
        assert (cfg.critic is not None) == ("critic" in preset)
        assert (cfg.teacher is not None) == ("teacher" in preset)


def test_old_preset_recipes_are_overlays_on_the_demo():
    demo = load_trainer_config(recipe_path("demo"))
    for name in list_presets():
        text = recipe_path(name).read_text()
        body = [x for x in text.splitlines() if x and not x.startswith("#")]
        assert body[:2] == ["extends: demo", f"preset: {name}"], (name, body)
        extra = [f"teacher.path={recipe_path('demo').parent}"] if name == "opd" else []
        cfg = load_trainer_config(recipe_path(name), extra)
        assert cfg.preset == name and cfg.task == demo.task and cfg.model == demo.model
        # below the preset: the demo's clip-high does not leak into a symmetric-clip preset
        assert cfg.algorithm.loss.get("eps_clip_high") == load_preset(name)["algorithm"][
            "loss"
        ].get("eps_clip_high")


def test_check_shows_the_merged_config(capsys):
    assert main(["check", "demo", "--preset", "dr_grpo", "--rows", "1"]) == 0
    out = capsys.readouterr().out
    assert "merged config under preset 'dr_grpo'" in out
    assert "advantage: dr_grpo" in out and "aggregation: constant" in out
    # the demo's own clip-high and reference win, and check says so
    assert "algorithm.loss.eps_clip_high" in out and "algorithm.use_reference" in out


def test_recipes_lists_examples_and_presets_apart(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    examples, presets = out.split("presets")
    assert "demo" in examples and "calculator" in examples and "dapo" not in examples
    assert all(f"  {name}\n" in presets for name in list_presets())
    assert "demo" in list_examples() and "dapo" not in list_examples()


@pytest.mark.parametrize("surplus", ["carry", "discard"])
def test_surplus_groups_are_carried_or_discarded(surplus, text_group):
    """The sampler keeps 5 groups for a batch of 2: ``carry`` keeps 3 for the next step (the
    default), ``discard`` (the dapo preset: DAPO's paper and verl's recipe) drops them."""
    from rl_buffer.sampler import DynamicSampler

    sampler = DynamicSampler(DynamicSampler.Config(batch_size=2, surplus=surplus))
    sampler.add([text_group(f"p{i}", ["ab", "ba"]) for i in range(5)])
    assert [g.prompt.uid for g in sampler.pop_batch()] == ["p0", "p1"]
    m = sampler.last_step_metrics
    if surplus == "carry":
        assert sampler.num_kept == 3 and m["rollout/dynamic_filter/surplus"] == 3
    else:
        assert sampler.num_kept == 0 and m["rollout/dynamic_filter/surplus"] == 0
        assert m["rollout/dynamic_filter/surplus_discarded"] == 3
        assert sampler.totals["surplus_discarded"] == 3
    assert load_trainer_config(recipe_path("dapo")).rollout.surplus_groups == "discard"
    assert load_trainer_config(recipe_path("demo")).rollout.surplus_groups == "carry"


def test_extends_a_recipe_beside_it_below_the_preset(tmp_path, tiny_recipe_dict):
    """`extends:` a relative path: base < preset < the extending recipe's own values; a loop
    and a missing base are ConfigErrors naming the file or the bundled names."""
    base = tiny_recipe_dict(tmp_path / "run", algorithm={"advantage": "rloo"})
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(base))
    (tmp_path / "mine.yaml").write_text(
        "extends: base.yaml\npreset: dr_grpo\nrl: {steps: 3}\nalgorithm: {aggregation: token}\n"
    )
    cfg = load_trainer_config(tmp_path / "mine.yaml")
    assert cfg.algorithm.advantage == "dr_grpo"  # the preset over the base
    assert cfg.algorithm.aggregation == "token"  # the recipe's own value over the preset
    assert cfg.rl.steps == 3 and cfg.task == load_trainer_config(base).task
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_trainer_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nothere\n")
    with pytest.raises(ConfigError, match="no bundled recipe of that name.*demo"):
        load_trainer_config(tmp_path / "c.yaml")


def test_every_preset_sets_only_preset_sections_and_cites_its_source():
    from rl_trainer.presets import PRESET_SECTIONS, _folder

    for name in list_presets():
        assert set(load_preset(name)) <= set(PRESET_SECTIONS), name
        text = (_folder("presets") / f"{name}.yaml").read_text()
        assert text.startswith("# Preset: "), name
        assert any(peer in text for peer in ("verl", "slime", "OpenRLHF", "TRL")), name
