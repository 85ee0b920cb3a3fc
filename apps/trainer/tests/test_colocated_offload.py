"""The colocated hand-over (``runtime.offload_policy``): the step's phases in order, memory
metrics per phase, no growth of resident memory over 20 steps, and the same training as a run
that never offloads."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_core.errors import ConfigError
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step.offload import PHASES

STEPS = 20


def _recipe(tiny_recipe_dict, run_dir, *, offload: bool, steps: int = STEPS, **sections):
    runtime = {"layout": "colocated", "offload_policy": offload}
    return tiny_recipe_dict(
        run_dir,
        runtime=runtime,
        rl={"steps": steps},
        eval={"every": 0},
        checkpoint={"every": 7},
        **sections,
    )


def _slope(ys: list[float]) -> float:
    """Least-squares slope of ``ys`` against their index."""
    n = len(ys)
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((i - mx) * (y - my) for i, y in enumerate(ys)) / sum((i - mx) ** 2 for i in range(n))


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_recipe_dict):
    """The same 20-step run with and without the hand-over."""
    root = tmp_path_factory.mktemp("coloc")
    out = {}
    for offload in (True, False):
        cfg = load_trainer_config(_recipe(tiny_recipe_dict, root / str(offload), offload=offload))
        out[offload] = (cfg.run_path, Trainer(cfg).run())
    return out


def test_offloaded_run_trains_exactly_like_a_plain_one(runs) -> None:
    """Offloading between steps changes nothing: the same metrics and final weights, bitwise
    (the hand-over only adds ``memory/*`` metrics)."""
    (dir_on, recs_on), (dir_off, recs_off) = runs[True], runs[False]

    def strip(records):
        return [
            {k: v for k, v in r.items() if not k.startswith(("perf/", "memory/"))}
            for r in records
            if r["phase"] == "rl"
        ]

    assert strip(recs_on) == strip(recs_off)
    assert not any(k.startswith("memory/") for r in recs_off for k in r)
    a = load_file(str(dir_on / "final_model" / "model.safetensors"))
    b = load_file(str(dir_off / "final_model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_per_phase_and_no_growth_over_20_steps(runs) -> None:
    """Each step records ``memory/<phase>_bytes`` (resident tensor bytes on CPU) and
    ``memory/<phase>_rss_bytes`` after every phase. The policy's state is resident exactly from
    ``onload`` to ``publish``; the bytes of every phase are the same at every step from step 2
    (step 1 creates AdamW's moments), and the process RSS does not trend upwards.

    RSS tolerance: a leak of the offloaded state (host copies not reused, a device storage not
    freed) grows RSS by at least the policy's state per step (weights + 2 Adam moments, the
    ``memory/train_bytes`` value); the least-squares slope over steps 6-20 must stay below a
    quarter of that. Python objects the run keeps by design (one metrics record per step, a few
    KB) stay far below it."""
    _, records = runs[True]
    steps = [r for r in records if r["phase"] == "rl" and "memory/train_bytes" in r]
    assert len(steps) == STEPS
    for r in steps:
        assert all(f"memory/{p}_bytes" in r and f"memory/{p}_rss_bytes" in r for p in PHASES)
        for p in ("generate", "release", "offload", "resume", "load"):
            assert r[f"memory/{p}_bytes"] == 0, (r["step"], p)
        assert r["memory/onload_bytes"] > 0 and r["memory/train_bytes"] > 0
    state_bytes = steps[1]["memory/train_bytes"]
    for r in steps[1:]:
        for p in PHASES:
            assert r[f"memory/{p}_bytes"] == steps[1][f"memory/{p}_bytes"], (r["step"], p)
    for p in ("generate", "load"):
        slope = _slope([float(r[f"memory/{p}_rss_bytes"]) for r in steps[5:]])
        assert slope < state_bytes / 4, (p, slope, state_bytes)


def test_offload_policy_needs_the_colocated_synchronous_loop(tmp_path, tiny_recipe_dict) -> None:
    recipe = tiny_recipe_dict(tmp_path, runtime={"offload_policy": True})
    with pytest.raises(ConfigError, match="runtime.offload_policy.*layout: colocated"):
        load_trainer_config(recipe)
    recipe = _recipe(tiny_recipe_dict, tmp_path, offload=True)
    recipe["rl"]["async_generation"] = True
    with pytest.raises(ConfigError, match="synchronous loop"):
        load_trainer_config(recipe)


@pytest.mark.gpu
def test_colocated_on_cuda_frees_the_policy_state(tmp_path, tiny_recipe_dict) -> None:
    """GPU: policy, reference and generator on CUDA in one process. ``memory/<phase>_bytes`` is
    ``torch.cuda.memory_allocated``: the offload phase frees at least the policy's weights and
    Adam moments, and the memory while the generator works (generate, load) does not grow
    from step 2 on."""
    recipe = _recipe(
        tiny_recipe_dict,
        tmp_path,
        offload=True,
        steps=6,
        policy={"type": "hf", "device": "cuda"},
        generator={"type": "hf", "device": "cuda"},
    )
    records = Trainer(load_trainer_config(recipe)).run()
    steps = [r for r in records if r["phase"] == "rl" and "memory/train_bytes" in r]
    assert len(steps) == 6
    params = sum(
        t.numel() * t.element_size()
        for t in load_file(str(tmp_path / "final_model" / "model.safetensors")).values()
    )
    for r in steps[1:]:
        assert r["memory/publish_bytes"] - r["memory/offload_bytes"] >= 3 * params, r
        # No growth: a leaked copy of the policy's weights per step would add >= params bytes;
        # the generator's own transients (KV cache of responses of varying length) are ~1 KB.
        for p in ("generate", "load"):
            grown = r[f"memory/{p}_bytes"] - steps[1][f"memory/{p}_bytes"]
            assert grown < params // 2, (r["step"], p, grown)
