"""Multi-turn partial rollouts through the trainer (``rl.partial_rollouts`` with a custom
``rollout.generate_fn``): a weight release mid-episode aborts only the in-flight turn, which
resumes on the new weights; finished turns keep their tokens and versions; every trained token
stays within ``rl.max_staleness``; and ``rl.async_mode: continuous`` runs end to end. The Ray
variant runs the same episode on the ``ray`` runtime."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap

import pytest
import torch

from rl_buffer import GroupBuffer
from rl_core.types import Group, Prompt, Rollout
from rl_trainer.config import load_trainer_config
from rl_trainer.loop import Trainer
from rl_trainer.step.stages import take_groups

# Three turns per episode; the middle one is long, so a round outlasts a training step and the
# trainer's release lands while it generates. Every turn's pieces are recorded.
THREE_TURNS = """
import dataclasses

from rl_agents.trajectory import TrajectoryBuilder

EPISODES = []  # per episode: [(turn, [(finish_reason, version, n_tokens), ...]), ...]
LENGTHS = (3, 160, 3)


async def three_turns(prompt, ctx):
    out = []
    for k in range(ctx.n_samples):
        traj = TrajectoryBuilder(prompt.token_ids, version=ctx.policy_version)
        turns = []
        for turn, n in enumerate(LENGTHS):
            sampling = dataclasses.replace(ctx.sampling, max_new_tokens=n)
            result = await ctx.generate(traj.input_ids, sampling, request_id=f"{prompt.uid}/{k}/{turn}")
            pieces = getattr(result, "pieces", (result,))
            turns.append((turn, [(str(p.finish_reason), p.weight_version, len(p.output_ids)) for p in pieces]))
            traj.append_model(result)
            if turn < len(LENGTHS) - 1:
                traj.append_text(" ok ", ctx.tokenizer)
        EPISODES.append((turns, traj.versions, traj.loss_mask))
        out.append(traj.to_rollout(prompt.uid, f"{prompt.uid}/{k}"))
    return out
"""


@pytest.fixture
def three_turns(tmp_path, monkeypatch):
    """The rollout module, importable as ``mt_three_turns`` (fresh per test)."""
    code = tmp_path / "user_code"
    code.mkdir()
    (code / "mt_three_turns.py").write_text(textwrap.dedent(THREE_TURNS))
    monkeypatch.syspath_prepend(str(code))
    sys.modules.pop("mt_three_turns", None)
    yield lambda: sys.modules["mt_three_turns"]
    sys.modules.pop("mt_three_turns", None)


def _recipe(tiny_recipe_dict, run_dir, **rl):
    recipe = tiny_recipe_dict(run_dir)
    recipe["generator"] = {"type": "hf", "stop_on_eos": False}
    recipe["rollout"]["generate_fn"] = {"type": "mt_three_turns:three_turns"}
    recipe["rl"] = {
        "steps": 3,
        "async_generation": True,
        "partial_rollouts": True,
        "max_staleness": 1,
        **rl,
    }
    return recipe


def _rl_rows(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["phase"] == "rl" and r["step"]]


def _check_episodes(module, rows, *, steps: int) -> None:
    """Cut turns resumed on the next version, finished turns untouched, tokens within bound."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(math.isfinite(r["train/loss"]) for r in rows)
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r["rollout/partial_interruptions"] for r in rows) >= 1
    assert sum(r["rollout/partial_resumed"] for r in rows) >= 1
    cut_episodes = 0
    for turns, versions, mask in module.EPISODES:
        model_versions = [v for v, m in zip(versions, mask, strict=True) if m]
        recorded = [v for _, pieces in turns for _, v, n in pieces for _ in range(n)]
        assert model_versions == recorded  # per-token versions = the pieces' versions
        assert model_versions == sorted(model_versions)  # versions only move forward
        for i, (_, pieces) in enumerate(turns):
            if len(pieces) == 1:
                assert pieces[0][0] != "abort"
                continue
            cut_episodes += 1
            *cut, last = pieces
            assert all(reason == "abort" for reason, _, _ in cut)
            assert last[0] != "abort" and last[1] > cut[-1][1]  # resumed on newer weights
            assert sum(n for _, _, n in pieces) == module.LENGTHS[i]  # budget kept, not reset
            # The turns before it finished on the cut version or older and were not redone.
            assert all(len(p) == 1 and p[0][1] <= cut[0][1] for _, p in turns[:i])
    assert cut_episodes >= 1


def test_multiturn_partial_rollouts_resume_the_cut_turn(tmp_path, tiny_recipe_dict, three_turns):
    run_dir = tmp_path / "run"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir))).run()
    _check_episodes(three_turns(), _rl_rows(run_dir), steps=3)


def test_continuous_mode_trains_within_the_staleness_bound(tmp_path, tiny_recipe_dict, three_turns):
    run_dir = tmp_path / "run"
    recipe = _recipe(tiny_recipe_dict, run_dir, steps=4, async_mode="continuous")
    recipe["eval"] = {"every": 2}  # the producer pauses for eval and checkpoints, then goes on
    recipe["checkpoint"] = {"every": 2}
    Trainer(load_trainer_config(recipe)).run()
    rows = _rl_rows(run_dir)
    _check_episodes(three_turns(), rows, steps=4)
    assert all(r["rollout/rounds_taken"] >= 1 for r in rows)
    assert [r["step"] for r in rows if any(k.startswith("eval/") for k in r)] == [2, 4]
    state = torch.load(  # plain data: loads without pickle's code execution
        run_dir / "checkpoints" / "step_000004" / "trainer_state.pt", weights_only=True
    )
    assert state["pipeline"]["continuous"] is True


def _group(uid: str, version: int) -> Group:
    r = Rollout(
        prompt_uid=uid,
        rollout_id=f"{uid}/0",
        sample_id=f"{uid}/0",
        tokens=(1, 2, 3),
        response_start=1,
        loss_mask=(1, 1),
        rollout_logprobs=(-0.1, -0.1),
        versions=(version, version + 1),  # resumed mid-response: spans two versions
    )
    return Group(prompt=Prompt(uid=uid, input="x", token_ids=(1,)), rollouts=[r])


def test_take_drops_groups_with_a_too_old_token_and_waits_for_more():
    buf = GroupBuffer()
    buf.put([_group("a", 0), _group("b", 2), _group("c", 3)])  # a holds a version-0 token
    groups, m = take_groups(buf, n=2, version=3, max_staleness=1, wait_for_more=True)
    assert [g.uid for g in groups] == ["b", "c"] and m["rollout/stale_dropped_at_take"] == 1
    assert m["rollout/staleness_max"] <= 1
    buf.put([_group("d", 1)])  # 1 < 3 - 1: stale
    groups, m = take_groups(buf, n=1, version=3, max_staleness=1, wait_for_more=True)
    assert groups == [] and m == {"rollout/stale_dropped_at_take": 1}


@pytest.fixture(scope="module")
def ray_cluster():
    """A small local Ray cluster for the Ray variant (heavy: run it under the shared lock)."""
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # a cluster of the session: use it, leave it running
        yield
        return
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.parametrize("mode", ["lockstep", "continuous"])
def test_multiturn_partial_rollouts_on_ray(
    tmp_path, tiny_recipe_dict, three_turns, ray_cluster, mode
):
    """The same episodes with the policy and one generator engine as Ray actors: the pool
    aborts its engine at the release, the turn resumes on the published weights (in both
    async modes)."""
    run_dir = tmp_path / "run"
    recipe = _recipe(tiny_recipe_dict, run_dir, async_mode=mode)
    recipe["weight_transport"] = {"type": "disk_full"}
    recipe["runtime"] = {"type": "ray", "generator": {"count": 1}}
    Trainer(load_trainer_config(recipe)).run()
    _check_episodes(three_turns(), _rl_rows(run_dir), steps=3)
