"""One prompt, many samples in the trainer's stages: siblings (rollouts sharing a
``rollout_id``) form one episode for the advantage baseline, land on one data-parallel rank,
and weigh as one episode in the loss with ``aggregation: rollout``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_core.algorithms import compute_loss_weights
from rl_core.algorithms.advantages import GRPO
from rl_core.types import Rollout
from rl_trainer.step.packing import plan_and_pack
from rl_trainer.step.stages import advantages


def _rollout(rid: str, sample: str, reward: float, n_resp: int, n_prompt: int = 3) -> Rollout:
    return Rollout(
        prompt_uid=rid.split("/")[0],
        rollout_id=rid,
        sample_id=sample,
        tokens=tuple(range(1, n_prompt + n_resp + 1)),
        response_start=n_prompt,
        loss_mask=(1,) * n_resp,
        rollout_logprobs=(-0.5,) * n_resp,
        versions=(0,) * n_resp,
        reward=reward,
    )


# Group 0: episode a (main + 2 sub-agents, reward 1) and episode b (one sample, reward 0).
# Group 1: episodes c (reward 1) and d (main + sub-agent, reward 1): no signal.
ROLLOUTS = [
    _rollout("p/a", "p/a/0", 1.0, 4),
    _rollout("p/a", "p/a/1", 1.0, 2),
    _rollout("p/a", "p/a/2", 1.0, 3),
    _rollout("p/b", "p/b/0", 0.0, 5),
    _rollout("q/c", "q/c/0", 1.0, 2),
    _rollout("q/d", "q/d/0", 1.0, 6),
    _rollout("q/d", "q/d/1", 1.0, 1),
]
GROUPS = [0, 0, 0, 0, 1, 1, 1]


def test_advantage_baseline_counts_each_episode_once():
    adv = advantages(GRPO(GRPO.Config()), ROLLOUTS, GROUPS, None)[0]
    per_sample = [float(a[0]) for a in adv]
    # Episodes a and b are +-1 after whitening over two episodes (not 3 samples vs 1).
    expect = GRPO(GRPO.Config())(
        SimpleNamespace(
            rewards=torch.tensor([1.0, 0.0]),
            group_index=torch.tensor([0, 0]),
            response_mask=[torch.ones(9), torch.ones(5)],
            kl=None,
            values=None,
        )
    )
    assert per_sample[:3] == pytest.approx([float(expect[0][0])] * 3)
    assert per_sample[3] == pytest.approx(float(expect[1][0]))
    assert per_sample[0] == pytest.approx(-per_sample[3])  # symmetric: one episode each side
    assert per_sample[4:] == pytest.approx([0.0, 0.0, 0.0])
    assert [len(a) for a in adv] == [len(r.loss_mask) for r in ROLLOUTS]
    # Without fan-out the per-sample baseline is the same estimator as before.
    solo = [_rollout(f"p/{i}", f"p/{i}/0", float(i % 2), 2) for i in range(4)]
    plain = advantages(GRPO(GRPO.Config()), solo, [0, 0, 0, 0], None)[0]
    assert [float(a[0]) for a in plain] == pytest.approx([-0.866, 0.866, -0.866, 0.866], abs=1e-3)


def test_balancer_keeps_siblings_on_one_rank_and_loss_weighs_episodes():
    policy = SimpleNamespace(data_parallel_size=2, model_shape=None)
    batch, order = plan_and_pack(ROLLOUTS, policy, max_tokens_per_micro_batch=64)
    rolls = [ROLLOUTS[i] for i in order]
    mid = batch.dp_bounds[1]
    ranks = {r.rollout_id: set() for r in rolls}
    for k, r in enumerate(rolls):
        ranks[r.rollout_id].add(0 if k < mid else 1)
    assert all(len(v) == 1 for v in ranks.values()), ranks
    w = compute_loss_weights(
        batch.loss_mask, batch.cu_seqlens, mode="rollout", rollout_ids=[r.rollout_id for r in rolls]
    )
    starts = batch.cu_seqlens.tolist()
    per_episode: dict[str, float] = {}
    for k, r in enumerate(rolls):
        per_episode[r.rollout_id] = per_episode.get(r.rollout_id, 0.0) + float(
            w[starts[k] : starts[k + 1]].sum()
        )
    assert per_episode == pytest.approx({rid: 0.25 for rid in ("p/a", "p/b", "q/c", "q/d")})
