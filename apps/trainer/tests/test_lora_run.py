"""A LoRA run (``policy.lora``): adapters train with the base frozen, the KL reference is the
policy's base view (no second model), the generator receives adapter-only updates, the final
model comes as merged weights plus a peft adapter, and a resumed run continues exactly."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("peft")

from rl_core.errors import ConfigError
from rl_core.lora import adapter_of
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.phases import sft as sft_phase
from rl_trainer.step import stages
from rl_trainer.step.lora import BaseReference

STEPS = 3


def spread_reward(prompt, response: str, rollout=None) -> float:
    """A reward that differs between samples (a tiny random model scores 0 on the task)."""
    return sum(map(ord, response)) % 7 / 7


def _recipe(tiny_recipe_dict, run_dir, **rl):
    return tiny_recipe_dict(
        run_dir,
        reward={"type": f"{__file__}:spread_reward"},
        policy={"type": "hf", "lr": 0.01, "lora": {"rank": 4, "alpha": 8}},
        algorithm={"advantage": "grpo", "use_reference": True, "loss": {"kl_coef": 0.01}},
        rl={"steps": STEPS, **rl},
        eval={"every": 0},
        checkpoint={"every": 2},
    )


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_recipe_dict, monkeypatch_module):
    """A 3-step LoRA run, with every published update and the reference recorded."""
    run_dir = tmp_path_factory.mktemp("lora") / "run"
    seen: dict = {"updates": [], "references": []}
    publish_only = stages.publish_only

    def spy(run, version, weights):
        update = publish_only(run, version, weights)
        seen["updates"].append(update)
        seen["references"].append(run.models.reference)
        return update

    monkeypatch_module.setattr(stages, "publish_only", spy)
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, run_dir))
    trainer = Trainer(cfg)
    records = trainer.run()
    return run_dir, trainer, records, seen


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def test_lora_run_trains_the_adapter_against_the_base_view(lora_run) -> None:
    run_dir, trainer, records, seen = lora_run
    rl = [r for r in records if r["phase"] == "rl" and "train/loss" in r]
    assert len(rl) == STEPS
    assert all(torch.isfinite(torch.tensor([r["train/loss"], r["train/kl"]])).all() for r in rl)
    assert all(isinstance(ref, BaseReference) for ref in seen["references"])
    assert trainer.reference.policy is trainer.policy  # no second model was built
    assert any(r["train/kl"] != 0 for r in rl[1:]), "the adapter never moved off the base"
    # every publication is the adapter alone, marked for the generator
    assert len(seen["updates"]) == STEPS
    for update in seen["updates"]:
        info = adapter_of(update)
        assert info is not None and info.name == "default" and info.config["r"] == 4
    assert trainer.generator.active_adapter == "default"
    assert trainer.generator.weight_version == trainer.policy.version
    # the base stayed frozen: the policy's base view equals the initial model
    base = load_file(str(run_dir / "init_model" / "model.safetensors"))
    merged = load_file(str(run_dir / "final_model" / "model.safetensors"))
    assert merged.keys() == base.keys()
    for name, w in trainer.policy.model.named_parameters():
        if ".lora_" not in name:
            key = name.replace(".base_layer.", ".")
            assert torch.equal(w.detach(), base[key]), f"{key}: the base changed"
    changed = [k for k in base if not torch.equal(base[k], merged[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)


def test_final_model_is_merged_plus_a_peft_adapter(lora_run) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    run_dir, _, _, _ = lora_run
    final = run_dir / "final_model"
    x = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(final)(x).logits
        adapted = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(run_dir / "init_model"), final / "adapter"
        )(x).logits
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=0)
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1] / "policy"
    assert not list(ckpt.glob("model*.safetensors")), "a LoRA checkpoint holds the adapter only"
    assert (ckpt / "adapter_model.safetensors").is_file()


def test_resumed_lora_run_continues_exactly(lora_run, tiny_recipe_dict, tmp_path) -> None:
    run_dir, _, records, _ = lora_run
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    for step in sorted((copy / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(step)  # resume from step 2
    (copy / "final_model").rename(tmp_path / "old_final")
    cfg = load_trainer_config(_recipe(tiny_recipe_dict, copy))
    resumed = Trainer(cfg, resume=True).run()
    last = [r for r in records if r["phase"] == "rl"][-1]
    again = [r for r in resumed if r["phase"] == "rl"][-1]
    strip = {k: v for k, v in last.items() if not k.startswith("perf/")}
    assert {k: again[k] for k in strip} == strip


def test_adapter_sync_needs_lora_and_a_generator_that_takes_adapters(
    tiny_recipe_dict, tmp_path
) -> None:
    recipe = tiny_recipe_dict(tmp_path / "run", rl={"steps": 1, "lora_sync": "adapter"})
    with pytest.raises(ConfigError, match="rl.lora_sync"):
        Trainer(load_trainer_config(recipe)).run()


@pytest.mark.parametrize("sft_lora", [True, False])
def test_merged_sync_publishes_full_weights(
    tiny_recipe_dict, tmp_path, monkeypatch, sft_lora
) -> None:
    """``rl.lora_sync: merged``: the generator gets the merged weights, no adapter. With an
    SFT warm-up the RL phase starts from the merged warm-up model, its adapter's base."""
    updates = []
    publish_only = stages.publish_only

    def spy(run, version, weights):
        updates.append(publish_only(run, version, weights))
        return updates[-1]

    monkeypatch.setattr(stages, "publish_only", spy)
    recipe = _recipe(tiny_recipe_dict, tmp_path / "run", steps=1, lora_sync="merged")
    recipe["sft"] = {"steps": 1, "batch_size": 2, "lora": sft_lora}
    seen_lora = []
    real_build = sft_phase.build_policy

    def spy_build(*args, **kw):
        policy = real_build(*args, **kw)
        seen_lora.append(policy.lora)
        return policy

    monkeypatch.setattr(sft_phase, "build_policy", spy_build)
    trainer = Trainer(load_trainer_config(recipe))
    trainer.run()
    assert (seen_lora[0] is not None) == sft_lora, "the warm-up's policy.lora"
    sft_model = tmp_path / "run" / "sft_model"
    assert (sft_model / "config.json").is_file() and not (
        sft_model / "adapter_config.json"
    ).exists()
    adapter_cfg = json.loads((tmp_path / "run/final_model/adapter/adapter_config.json").read_text())
    assert adapter_cfg["base_model_name_or_path"] == str(sft_model)
    assert len(updates) == 1 and adapter_of(updates[0]) is None
    assert trainer.generator.active_adapter is None
    assert trainer.generator.weight_version == trainer.policy.version


def test_colocated_offload_leaves_the_base_view_to_the_policy(tiny_recipe_dict, tmp_path) -> None:
    """With the colocated hand-over a LoRA run trains exactly as without it; the base-view
    reference is not offloaded on its own (its memory is the policy's)."""
    out = {}
    for offload in (True, False):
        recipe = _recipe(tiny_recipe_dict, tmp_path / str(offload), steps=2)
        recipe["runtime"] = {"layout": "colocated", "offload_policy": offload}
        trainer = Trainer(load_trainer_config(recipe))
        records = trainer.run()
        out[offload] = [
            {k: v for k, v in r.items() if not k.startswith(("perf/", "memory/"))}
            for r in records
            if r["phase"] == "rl"
        ]
        if offload:
            assert trainer.handover.models() == [trainer.policy]
    assert out[True] == out[False]
