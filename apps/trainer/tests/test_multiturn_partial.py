"""Multi-turn partial rollouts through the trainer (``rl.partial_rollouts`` with a custom
``rollout.generate_fn``): a weight release mid-episode aborts only the in-flight turn, which
resumes on the new weights; finished turns keep their tokens and versions; every trained token
stays within ``rl.max_staleness``; and ``rl.async_mode: continuous`` runs end to end. The Ray
variant runs the same episode on the ``ray`` runtime.

The in-process tests do not leave the cut to timing (before, they needed the 160-token middle
turn to outlast a training step): the engine, decoding the first middle turn of the second round
(generated on version 0 while step 1 trains), waits after that turn's first tokens until an abort
is requested, which only the release of version 1 brings about; and step 1 waits until that turn
is held, so the release cannot come before it. The Ray variant still relies on the long middle
turn (its engine runs in another process)."""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable

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
BEFORE = None  # set by the in-process tests: called with (prompt, ctx) before its episodes


async def three_turns(prompt, ctx):
    if BEFORE is not None:
        BEFORE(prompt, ctx)
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
    recipe["runtime"] = {"generator_process": False}  # the hold needs the in-process engine
    return recipe


HOLD_LIMIT_S = 30.0
"""A held decode step that sees no abort by then goes on (and the test fails on its record)."""


def _hold_a_second_round_middle_turn(
    engine,
    later_rounds: Callable[[], list[str]],
    held: list[tuple[str, int, bool]],
    holding: threading.Event,
) -> None:
    """Make the in-process engine stop, once, inside a middle turn of the second round: after
    that request's first decode step (so it holds sampled tokens on version 0) the next decode
    step waits until an abort is requested (the partial-rollout machinery aborts in-flight
    requests when a newer version is released) or ``HOLD_LIMIT_S`` passes. Only the training
    prompts of ``later_rounds()`` are held (never the first round's: step 1, hence the release,
    waits for them; nor evaluation's). ``held`` records ``(request_id, version served at the
    hold, whether an abort ended it)``: one entry when the hold happened; ``holding`` is set
    when the hold starts.

    A test hook on HFGenerator internals (``_decode_step``, ``_running_ids``, ``_abort_seq``),
    which its decode loop reads itself; without the abort on release the held step times out
    and the middle turn is not cut."""
    decode = engine._decode_step
    seen_steps: dict[str, int] = {}

    def middle_turns() -> list[str]:
        later = set(later_rounds())
        ids = sorted(engine._running_ids)  # "<uid>/<sample>/<turn>"
        return [r for r in ids if r.endswith("/1") and r.rsplit("/", 2)[0] in later]

    def held_decode(*args, **kwargs):
        if not held:
            for rid in middle_turns():
                seen_steps[rid] = seen_steps.get(rid, 0) + 1
                if seen_steps[rid] >= 2:  # its first tokens are sampled on the served version
                    version, seq = engine.weight_version, engine._abort_seq
                    holding.set()
                    deadline = time.monotonic() + HOLD_LIMIT_S
                    while engine._abort_seq == seq and time.monotonic() < deadline:
                        time.sleep(0.005)
                    held.append((rid, version, engine._abort_seq != seq))
                    break
        return decode(*args, **kwargs)

    engine._decode_step = held_decode


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


def _run_held(recipe) -> None:
    """Run ``recipe`` in process with a second-round middle turn held until the release."""
    trainer = Trainer(load_trainer_config(recipe))
    module = importlib.import_module("mt_three_turns")  # the module the trainer will run
    held: list[tuple[str, int, bool]] = []
    holding = threading.Event()
    waited: list[bool] = []
    train_uids: list[str] = []  # training prompts (sampled at temperature 1; eval is greedy)
    per_round = trainer.config.rollout.prompts_per_step
    hooked: list[object] = []

    def before(prompt, ctx) -> None:  # the models exist once the RL phase runs the rollouts
        if ctx.sampling.temperature > 0:
            train_uids.append(prompt.uid)
        if hooked:
            return
        hooked.append(trainer.generator)
        later = lambda: train_uids[per_round:]  # noqa: E731
        _hold_a_second_round_middle_turn(trainer.generator, later, held, holding)
        policy = trainer.policy
        train_step = policy.train_step

        def first_rl_step_waits_for_the_hold(*args, **kwargs):
            # Step 1 (whose end releases version 1) waits until the second round's middle
            # turn is held with tokens on version 0: the release cannot come before the turn.
            if not waited:
                waited.append(holding.wait(HOLD_LIMIT_S))
            return train_step(*args, **kwargs)

        policy.train_step = first_rl_step_waits_for_the_hold

    module.BEFORE = before
    trainer.run()
    # The held turn had tokens on version 0 when an abort came, which only the release of
    # version 1 requests: the cut is that release's, whatever the machine's speed.
    assert waited == [True] and len(held) == 1, f"step 1 waited {waited}; the hold saw {held}"
    assert held[0][1:] == (0, True), f"the hold saw {held}"


def test_multiturn_partial_rollouts_resume_the_cut_turn(tmp_path, tiny_recipe_dict, three_turns):
    run_dir = tmp_path / "run"
    _run_held(_recipe(tiny_recipe_dict, run_dir))
    _check_episodes(three_turns(), _rl_rows(run_dir), steps=3)


def test_continuous_mode_trains_within_the_staleness_bound(tmp_path, tiny_recipe_dict, three_turns):
    run_dir = tmp_path / "run"
    recipe = _recipe(tiny_recipe_dict, run_dir, steps=4, async_mode="continuous")
    recipe["eval"] = {"every": 2}  # the producer pauses for eval and checkpoints, then goes on
    recipe["checkpoint"] = {"every": 2}
    _run_held(recipe)
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
