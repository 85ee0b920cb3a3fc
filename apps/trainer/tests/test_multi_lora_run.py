"""Multi-LoRA through the trainer (``policy.lora.adapters`` + ``rollout.adapter_key``): each
prompt samples with its own adapter, each adapter trains only on its own prompts, every sync
carries all adapters, checkpoints hold a peft directory per adapter and resume exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("peft")

from rl_buffer import rollout
from rl_core.errors import ConfigError
from rl_core.lora import adapter_of, split_adapters
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step import stages

STEPS = 2
ADAPTERS = ["solver", "critic"]


def spread_reward(prompt, response: str, rollout=None) -> float:
    """A reward that differs between samples (a tiny random model scores 0 on the task)."""
    return sum(map(ord, response)) % 7 / 7


def _data(path, roles) -> str:
    words = ["ab", "cd", "ef", "gh", "ij", "kl", "mn", "op"]
    path.write_text(
        "".join(
            json.dumps({"prompt": f"{w}=", "label": w[::-1], "meta": {"role": roles[i % 2]}}) + "\n"
            for i, w in enumerate(words)
        )
    )
    return str(path)


def _recipe(tiny_recipe_dict, run_dir, data, **kw):
    recipe = tiny_recipe_dict(
        run_dir,
        reward={"type": f"{__file__}:spread_reward"},
        policy={"type": "hf", "lr": 0.05, "lora": {"rank": 4, "alpha": 8, "adapters": ADAPTERS}},
        algorithm={"advantage": "grpo", "use_reference": True, "loss": {"kl_coef": 0.01}},
        rl={"steps": STEPS},
        eval={"every": 0},
        checkpoint={"every": 1},
        data={"train": {"type": "jsonl", "path": data, "metadata_key": "meta"}},
        **kw,
    )
    recipe.pop("task")
    recipe["rollout"]["adapter_key"] = "role"
    return recipe


def _run(tiny_recipe_dict, tmp_path, monkeypatch, roles, name="run"):
    """A multi-LoRA run; returns (run_dir, records, published tensors per update, requests)."""
    run_dir = tmp_path / name
    data = _data(tmp_path / f"{name}.jsonl", roles)
    seen = {"updates": [], "requests": []}
    publish_only, sample_requests = stages.publish_only, rollout.sample_requests

    def spy_publish(run, version, weights):
        weights = [(n, t.detach().clone()) for n, t in weights]
        update = publish_only(run, version, weights)
        seen["updates"].append((update, dict(weights)))
        return update

    def spy_requests(prompts, *a, **kw):
        reqs = sample_requests(prompts, *a, **kw)
        n = len(reqs) // len(prompts)
        seen["requests"].append(
            [(prompts[i // n].metadata["role"], q.adapter) for i, q in enumerate(reqs)]
        )
        return reqs

    monkeypatch.setattr(stages, "publish_only", spy_publish)
    monkeypatch.setattr(rollout, "sample_requests", spy_requests)
    trainer = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir, data)))
    records = trainer.run()
    return run_dir, trainer, records, seen


def test_two_adapters_each_train_on_their_own_prompts(
    tiny_recipe_dict, tmp_path, monkeypatch
) -> None:
    run_dir, trainer, records, seen = _run(tiny_recipe_dict, tmp_path, monkeypatch, ADAPTERS)
    # before the first adapter update the generator serves the base (= fresh adapters): the
    # first round names no adapter; every later request asks for its prompt's adapter
    first, *later = seen["requests"]
    assert all(adapter is None for _, adapter in first) and later
    assert all(role == adapter for round_ in later for role, adapter in round_)
    assert {a for round_ in later for _, a in round_} == set(ADAPTERS)
    # every sync carried both adapters, and the generator serves both at the current version
    assert len(seen["updates"]) == STEPS
    for update, tensors in seen["updates"]:
        info = adapter_of(update)
        assert info is not None and info.names == tuple(ADAPTERS) and info.name == "solver"
        assert set(split_adapters(tensors.items(), ADAPTERS)) == set(ADAPTERS)
    adapters = trainer.generator._adapters
    assert set(adapters.configs) == set(ADAPTERS)
    assert trainer.generator.weight_version == trainer.policy.version
    # per-adapter metrics, both adapters learned something
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert len(rl) == STEPS
    for a in ADAPTERS:
        assert any(f"rollout/reward_mean/{a}" in r and r[f"train/samples/{a}"] > 0 for r in rl)
        assert any(r[f"train/grad_norm/{a}"] > 0 for r in rl)
        # a step without the adapter's prompts gives it no gradient
        assert all(r[f"train/grad_norm/{a}"] == 0 for r in rl if f"train/samples/{a}" not in r)
    # a peft directory per adapter in the checkpoint and in the final export
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "policy"
    final = run_dir / "final_model" / "adapter"
    for a in ADAPTERS:
        assert (ckpt / a / "adapter_model.safetensors").is_file()
        assert (final / a / "adapter_config.json").is_file()

    # resuming from step 1 gives bitwise the same step 2
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    for step in sorted((copy / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(step)
    shutil.rmtree(copy / "final_model")
    data = str(tmp_path / "run.jsonl")
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, copy, data))
    again = [r for r in Trainer(cfg, resume=True).run() if r["phase"] == "rl"][-1]
    last = [r for r in records if r["phase"] == "rl"][-1]
    strip = {k: v for k, v in last.items() if not k.startswith("perf/")}
    assert {k: again[k] for k in strip} == strip


def test_an_adapter_without_prompts_stays_bitwise_unchanged(
    tiny_recipe_dict, tmp_path, monkeypatch
) -> None:
    _, _, records, seen = _run(
        tiny_recipe_dict, tmp_path, monkeypatch, ["solver", "solver"], name="solo"
    )
    first = split_adapters(seen["updates"][0][1].items(), ADAPTERS)
    last = split_adapters(seen["updates"][-1][1].items(), ADAPTERS)
    assert all(torch.equal(first["critic"][k], last["critic"][k]) for k in first["critic"])
    assert any(not torch.equal(first["solver"][k], last["solver"][k]) for k in first["solver"])
    # B starts at zero: the critic's is still exactly zero, the solver's moved
    for adapter, moved in (("critic", False), ("solver", True)):
        b = [t for k, t in last[adapter].items() if ".lora_B." in k]
        assert b and any(bool(t.any()) for t in b) == moved
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert all(r["train/grad_norm/critic"] == 0 for r in rl)


def test_inconsistent_multi_lora_settings_are_refused(tiny_recipe_dict, tmp_path) -> None:
    data = _data(tmp_path / "d.jsonl", ADAPTERS)
    recipe = _recipe(tiny_recipe_dict, tmp_path / "a", data)
    del recipe["rollout"]["adapter_key"]
    with pytest.raises(ConfigError, match="rollout.adapter_key"):
        Trainer(load_trainer_config(recipe)).run()
    recipe = _recipe(tiny_recipe_dict, tmp_path / "b", data)
    recipe["rl"]["lora_sync"] = "merged"
    with pytest.raises(ConfigError, match="policy.lora.adapters"):
        Trainer(load_trainer_config(recipe)).run()
    recipe = _recipe(tiny_recipe_dict, tmp_path / "c", data)
    recipe["policy"]["lora"] = {"rank": 4}
    with pytest.raises(ConfigError, match="rollout.adapter_key"):
        Trainer(load_trainer_config(recipe)).run()
    bad = _data(tmp_path / "bad.jsonl", ["solver", "planner"])
    with pytest.raises(ConfigError, match="planner"):
        Trainer(load_trainer_config(_recipe(tiny_recipe_dict, tmp_path / "d", bad))).run()
