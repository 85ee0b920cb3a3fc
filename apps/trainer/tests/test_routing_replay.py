"""Routing replay through the trainer (``rollout.routing_replay``): the moe_demo recipe for a few
steps, record mode, start-up refusals, and a resume with routing held in the buffer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.config import load_config_file
from rl_core.errors import ConfigError
from rl_trainer.cli import recipe_path
from rl_trainer.config import load_trainer_config
from rl_trainer.lifecycle.checkpoint import load_trainer_state
from rl_trainer.loop import Trainer
from rl_trainer.step.routing import check_support

TINY_MOE = {
    "arch": "qwen3_moe",
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
    "num_experts": 4,
    "moe_top_k": 2,
    "moe_intermediate_size": 32,
    "router_init_std": 0.2,
}


def _short_moe_demo(run_dir: Path, **over: Any) -> dict[str, Any]:
    """The bundled moe_demo recipe, cut to a few small steps."""
    rec = load_config_file(recipe_path("moe_demo"))
    rec["run_dir"] = str(run_dir)
    rec["task"].update(n_train=64, n_eval=4)
    rec["sft"] = {"steps": 2, "batch_size": 8}
    rec["rollout"].update(prompts_per_step=2, n_samples=4, routing_no_replay_every=1)
    rec["rollout"]["sampling"]["max_new_tokens"] = 6
    rec["rl"] = {"steps": 2}
    rec["eval"] = {"every": 0}
    rec["checkpoint"] = {"every": 0, "keep": 1}
    rec["logging"] = {"tensorboard": False, "progress": False}
    for key, value in over.items():
        rec[key] = value
    return rec


def _rl_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["phase"] == "rl" and r["step"] > 0]


def test_moe_demo_replays_the_engines_routing(tmp_path: Path) -> None:
    """With router noise in the generator, the trainer's own routing differs from the engine's
    (first step's no-replay pass), and with replay the experts used are exactly the engine's."""
    records = _rl_records(Trainer(load_trainer_config(_short_moe_demo(tmp_path / "run"))).run())
    assert len(records) == 2
    for r in records:
        assert r["routing/mismatch"] == 0.0
        assert r["routing/bytes_per_token"] == 2 * 2  # 2 layers x top-2 x uint8
        assert r["routing/logprob_mismatch"] <= r["routing/logprob_mismatch_no_replay"]
    first = records[0]
    assert first["routing/mismatch_no_replay"] > 0.0
    assert first["routing/router_mismatch"] > 0.0


def test_record_mode_measures_without_replaying(tmp_path: Path, tiny_recipe_dict) -> None:
    recipe = tiny_recipe_dict(
        tmp_path / "run",
        model={"init": dict(TINY_MOE)},
        generator={"type": "hf", "router_logit_noise_std": 1.0},
    )
    recipe["rollout"]["routing_replay"] = "record"
    records = _rl_records(Trainer(load_trainer_config(recipe)).run())
    for r in records:
        # The policy routed on its own: what it used is its router's choice, not the engine's.
        assert r["routing/mismatch"] == r["routing/router_mismatch"] > 0.0
        assert "routing/mismatch_no_replay" not in r
        # The loss saw the same log-probs as the record pass (no replay in either).
        assert r["routing/logprob_mismatch"] == pytest.approx(r["train/mismatch"], rel=1e-5)


def test_dense_model_with_routing_is_refused(tmp_path: Path, tiny_recipe_dict) -> None:
    recipe = tiny_recipe_dict(tmp_path / "run")
    recipe["rollout"]["routing_replay"] = "replay"
    with pytest.raises(ConfigError, match="rollout.routing_replay"):
        Trainer(load_trainer_config(recipe)).run()


class _NoRouting:
    supports_routing: ClassVar[bool] = False
    supports_routing_replay: ClassVar[bool] = False


class _Routing:
    supports_routing: ClassVar[bool] = True


def test_start_up_check_names_the_field_and_the_fix() -> None:
    check_support("off", _NoRouting(), _NoRouting())
    with pytest.raises(ConfigError, match=r"rollout.routing_replay.*supports_routing = False"):
        check_support("record", _NoRouting(), _NoRouting())
    check_support("record", _NoRouting(), _Routing())
    with pytest.raises(ConfigError, match=r"supports_routing_replay = False.*record"):
        check_support("replay", _NoRouting(), _Routing())


def test_resume_with_routing_in_the_buffer(tmp_path: Path) -> None:
    """Async generation holds the next round's groups (with routing) in the buffer at the RL
    step-1 checkpoint; the run resumed from it replays them."""
    import shutil

    run_dir = tmp_path / "run"
    over = {
        "rl": {"steps": 2, "async_generation": True, "max_staleness": 1},
        "checkpoint": {"every": 1, "keep": 3},
    }
    Trainer(load_trainer_config(_short_moe_demo(run_dir, **over))).run()
    # Checkpoints count SFT and RL steps: the last two are after RL steps 1 and 2.
    *_, ckpt, newest = sorted((run_dir / "checkpoints").iterdir())
    held = load_trainer_state(ckpt)["buffer"]["groups"]
    assert held, "the async run should hold the next round in the buffer"
    routed = [r["routed_experts"] for g in held for r in g["rollouts"]]
    assert all(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 for t in routed)
    shutil.rmtree(newest)
    records = Trainer(load_trainer_config(_short_moe_demo(run_dir, **over)), resume=True).run()
    last = _rl_records(records)[-1]
    assert last["step"] == 2 and last["routing/mismatch"] == 0.0
