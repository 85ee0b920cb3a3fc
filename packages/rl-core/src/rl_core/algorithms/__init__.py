"""RL algorithms in pure torch: advantages, KL estimators, loss aggregation, losses, and
train/inference mismatch correction.

Shapes are suffixes on tensor names: ``_T`` one entry per packed token, ``_N`` one per sequence
(rollout), ``_N1`` the ``N+1`` sequence bounds, ``_NL`` a left-aligned ``[N, L]`` matrix. Position
``t`` of every ``[T]`` tensor refers to ``TrainBatch.tokens[t]``.

How the trainer uses it::

    from rl_core.algorithms import ADVANTAGE_ESTIMATORS, LOSSES, compute_loss_weights

    adv_fn = ADVANTAGE_ESTIMATORS["grpo"](GRPO.Config())
    adv = adv_fn(AdvantageInputs(rewards=..., group_index=..., response_mask=...))  # N x [R_i]
    weights_T = compute_loss_weights(loss_mask_T, cu_seqlens_N1, mode="rollout",
                                     rollout_ids=[r.rollout_id for r in rollouts])
    loss_fn = LOSSES["policy"](PolicyLoss.Config(eps_clip_high=0.28, correction="tis"))
    policy.train_step(batch, loss_fn)          # batch.loss_weights = weights_T
"""

from rl_core.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GAE,
    GRPO,
    RLOO,
    DrGRPO,
    ReinforcePP,
    ReinforcePPBaseline,
    compute_gae,
    dr_grpo_advantages,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rl_core.algorithms.aggregation import (
    AGGREGATION_MODES,
    compute_loss_weights,
    rollout_token_counts,
)
from rl_core.algorithms.correction import (
    CORRECTION_LEVELS,
    CORRECTION_MODES,
    CorrectionWeights,
    importance_weights,
    logprob_mismatch,
)
from rl_core.algorithms.kl import KL_KINDS, kl_estimate
from rl_core.algorithms.losses import (
    LOSSES,
    POLICY_LOSS_VARIANTS,
    DistillationLoss,
    PolicyLoss,
    SFTLoss,
    ValueLoss,
    ValueObjective,
    distillation_advantages,
    value_loss,
)
from rl_core.algorithms.skipping import (
    metrics_over_trained,
    sequences_to_train,
    skip_blocker,
    zero_advantage_sequences,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATION_MODES",
    "CORRECTION_LEVELS",
    "CORRECTION_MODES",
    "GAE",
    "GRPO",
    "KL_KINDS",
    "LOSSES",
    "POLICY_LOSS_VARIANTS",
    "RLOO",
    "CorrectionWeights",
    "DistillationLoss",
    "DrGRPO",
    "PolicyLoss",
    "ReinforcePP",
    "ReinforcePPBaseline",
    "SFTLoss",
    "ValueLoss",
    "ValueObjective",
    "compute_gae",
    "compute_loss_weights",
    "distillation_advantages",
    "dr_grpo_advantages",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "logprob_mismatch",
    "masked_whiten",
    "metrics_over_trained",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_token_counts",
    "sequences_to_train",
    "skip_blocker",
    "value_loss",
    "zero_advantage_sequences",
]
