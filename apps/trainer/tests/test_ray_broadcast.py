"""``weight_transport.type=broadcast`` on the ``ray`` runtime (gloo on CPU): policy rank 0 and
two generator engines form the collective group through the placement group; an engine killed
mid-run is restarted, the group is re-formed (a new generation) and the new engine re-synced,
without restarting the trainer; the run finishes with every engine on the trainer's final
weights (checksums)."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from rl_core.errors import ConfigError  # noqa: E402
from rl_trainer.config import load_trainer_config  # noqa: E402
from rl_trainer.loop import Trainer  # noqa: E402
from rl_trainer.ray.generator import RayGeneratorPool  # noqa: E402
from rl_weightsync.checksum import tensor_checksum  # noqa: E402

RECIPE = {
    "seed": 3,
    "model": {
        "init": {
            "arch": "qwen2",
            "hidden_size": 32,
            "num_layers": 1,
            "num_heads": 2,
            "num_kv_heads": 1,
            "intermediate_size": 64,
        }
    },
    "task": {"type": "reverse", "n_train": 64, "n_eval": 4, "min_len": 2, "max_len": 3},
    "policy": {"type": "hf", "lr": 0.002},
    "generator": {"type": "hf"},
    "weight_transport": {"type": "broadcast", "timeout_s": 20, "bucket_bytes": 4096},
    "sft": {"steps": 2, "batch_size": 8, "lr": 0.005},
    "rollout": {
        "prompts_per_step": 4,
        "n_samples": 2,
        "sampling": {"temperature": 1.0, "max_new_tokens": 3},
    },
    "algorithm": {"advantage": "grpo"},
    "rl": {"steps": 6},
    "eval": {"every": 0},
    "checkpoint": {"every": 0},
    "logging": {"tensorboard": False, "progress": False},
    "runtime": {"type": "ray", "generator": {"count": 2}, "num_cpus": 3},
}


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster for this module (or the one already running)."""
    if ray.is_initialized():
        yield
        return
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _rl_step_reached(run_dir: Path, step: int) -> bool:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return False
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return any(r["phase"] == "rl" and r["step"] >= step for r in rows)


def test_broadcast_survives_a_killed_engine_and_every_engine_ends_on_the_final_weights(
    ray_cluster, tmp_path, monkeypatch
):
    run = tmp_path / "bcast"
    trainer = Trainer(load_trainer_config({**RECIPE, "run_dir": str(run)}))
    seen: dict[str, object] = {}
    close = RayGeneratorPool.close

    async def close_after_checking(pool: RayGeneratorPool) -> None:
        """Before the engines go: the checksums of each engine's and the policy's weights."""
        seen["engines"] = [await e.weight_checksums.remote() for e in pool.engines]
        seen["policy"] = {n: tensor_checksum(t) for n, t in trainer.policy.named_weights()}
        seen["generation"] = pool.group.generation
        seen["restarts"], seen["events"] = pool.restarts, list(pool.events)
        await close(pool)

    monkeypatch.setattr(RayGeneratorPool, "close", close_after_checking)
    killed: list[object] = []

    def kill_engine_0() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not _rl_step_reached(run, 2):
            time.sleep(0.01)
        engine = trainer.generator.engines[0]
        killed.append(engine)
        ray.kill(engine, no_restart=True)

    watcher = threading.Thread(target=kill_engine_0, daemon=True)
    watcher.start()
    trainer.run()
    watcher.join(timeout=5)
    assert killed, "engine 0 was never killed"
    assert seen["restarts"] == 1 and str(seen["events"][0]).startswith("engine 0 died")
    # Generation 1 at the start, one more for the restart; one more again when the kill lands
    # while an update is being sent (the surviving engine's transfer fails and is re-synced on
    # a re-formed group: seen once in a CI run). More than the restart plus three re-sync
    # attempts would be a loop.
    assert 2 <= seen["generation"] <= 5, f"group generation {seen['generation']}"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "rl" and r["step"]] == list(range(1, 7))
    policy = seen["policy"]
    assert policy and len(seen["engines"]) == 2
    for i, engine in enumerate(seen["engines"]):
        diff = [n for n in policy if engine.get(n) != policy[n]]
        assert not diff, f"engine {i} does not serve the trainer's final weights: {diff}"


def test_an_engine_dead_during_a_broadcast_does_not_hang_the_other(
    ray_cluster, tmp_path, monkeypatch
):
    """Engine 0 dies just as the third update is sent: engine 1 has acknowledged it and waits
    for a member that never comes. The restart re-forms the group, which releases engine 1
    (its receiver is closed) instead of letting it wait out ``timeout_s``, and both end on the
    final weights."""
    run = tmp_path / "mid_update"
    trainer = Trainer(load_trainer_config({**RECIPE, "run_dir": str(run)}, ["rl.steps=4"]))
    seen: dict[str, object] = {"updates": 0, "waits": []}
    update_weights, close = RayGeneratorPool.update_weights, RayGeneratorPool.close

    async def update_killing_engine_0(pool: RayGeneratorPool, update, transport) -> None:
        seen["updates"] += 1
        if seen["updates"] == 3:
            ray.kill(pool.engines[0], no_restart=True)
        t0 = time.perf_counter()
        await update_weights(pool, update, transport)
        seen["waits"].append(time.perf_counter() - t0)

    async def close_after_checking(pool: RayGeneratorPool) -> None:
        seen["engines"] = [await e.weight_checksums.remote() for e in pool.engines]
        seen["policy"] = {n: tensor_checksum(t) for n, t in trainer.policy.named_weights()}
        seen["generation"], seen["restarts"] = pool.group.generation, pool.restarts
        await close(pool)

    monkeypatch.setattr(RayGeneratorPool, "update_weights", update_killing_engine_0)
    monkeypatch.setattr(RayGeneratorPool, "close", close_after_checking)
    trainer.run()
    assert seen["restarts"] == 1 and seen["generation"] >= 2, seen
    timeout_s = RECIPE["weight_transport"]["timeout_s"]
    assert max(seen["waits"]) < timeout_s, f"an update waited out the timeout: {seen['waits']}"
    for i, engine in enumerate(seen["engines"]):
        diff = [n for n in seen["policy"] if engine.get(n) != seen["policy"][n]]
        assert not diff, f"engine {i} does not serve the trainer's final weights: {diff}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            [
                "runtime.layout=colocated",
                "runtime.generator.count=1",
                "weight_transport.device=cuda",
            ],
            "weight_transport.device: 'broadcast' on cuda",
        ),
        (["runtime.generator.count=0"], "with runtime.generator.count=0"),
    ],
)
def test_broadcast_settings_that_cannot_work_fail_before_ray_starts(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(load_trainer_config({**RECIPE, "run_dir": str(tmp_path / "bad")}, overrides))
