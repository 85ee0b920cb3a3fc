"""The public surface of rl_core.algorithms: pinned names and docstrings."""

from __future__ import annotations

import inspect

import rl_core.algorithms as alg

EXPECTED = {
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
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "rollout_token_counts",
    "value_loss",
    "metrics_over_trained",
    "sequences_to_train",
    "skip_blocker",
    "zero_advantage_sequences",
}


def test_all_is_pinned() -> None:
    """Adding or removing a public name is a deliberate change: update EXPECTED with it."""
    assert set(alg.__all__) == EXPECTED
    for name in alg.__all__:
        assert hasattr(alg, name), name


def test_public_names_have_docstrings() -> None:
    missing = []
    for name in alg.__all__:
        obj = getattr(alg, name)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            if not inspect.getdoc(obj):
                missing.append(name)
            if inspect.isclass(obj) and hasattr(obj, "Config") and not obj.Config.__doc__:
                missing.append(f"{name}.Config")
    assert not missing, missing
