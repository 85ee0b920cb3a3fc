"""Routing replay in the RL step (``rollout.routing_replay``) and its ``routing/*`` metrics.

``record``: the rollouts carry the engine's experts (``Rollout.routed_experts``), the packed
batch too; the policy gets the batch *without* them and routes on its own, and the step reports
how far its routing and log-probs are from the engine's. ``replay``: the policy gets them and
every MoE layer uses exactly the engine's experts (log-prob passes and the training step).

Metrics (one record per step; token sets are said per metric):

- ``routing/mismatch``: fraction of (token, layer) pairs where the experts the trainer's forward
  *used* differ from the engine's, over the positions that predict a loss token (each of them
  was run by the engine; the rows the engine never ran are padding). ``record``: the policy's
  own routing; ``replay``: the replayed routing, so 0 unless the data path lost the alignment.
- ``routing/router_mismatch``: the same count for the policy router's *own* choice in the pass
  the policy trained with (under replay, later layers see replayed hidden states).
- ``routing/logprob_mismatch``: mean |trainer - rollout| log-prob over loss tokens, with the
  routing the training step uses.
- ``routing/mismatch_no_replay``, ``routing/logprob_mismatch_no_replay`` (``replay`` only, every
  ``rollout.routing_no_replay_every`` steps from step 1): the same from one extra pass without replay: what
  replay removed.
- ``routing/bytes_per_token``: the routing payload of one token (``layers x top_k x itemsize``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from rl_core.errors import ConfigError, DataError
from rl_core.routing import routing_mismatch
from rl_core.types import TrainBatch

__all__ = ["check_support", "for_policy", "routing_step"]


def check_support(mode: str, policy: Any, generator: Any) -> None:
    """Refuse, before the first step, a run whose generator cannot record routing or (for
    ``replay``) whose policy cannot replay it."""
    if mode == "off":
        return
    if not getattr(generator, "supports_routing", False):
        raise ConfigError(
            f"rollout.routing_replay: {mode!r} needs a generator that returns the experts it "
            f"routed every token to, and {type(generator).__name__} does not "
            "(supports_routing = False); use generator.type: hf or sglang with a "
            "mixture-of-experts model, or set rollout.routing_replay: off."
        )
    if mode == "replay" and not getattr(policy, "supports_routing_replay", False):
        raise ConfigError(
            f"rollout.routing_replay: 'replay' needs a policy that can replay the engine's "
            f"routing, and {type(policy).__name__} cannot (supports_routing_replay = False); "
            "use rollout.routing_replay: record (measure only) or a policy that replays "
            "(policy.type: hf)."
        )


def for_policy(batch: TrainBatch, mode: str) -> TrainBatch:
    """``batch`` as the policy sees it: with the engine's routing only under ``replay``."""
    if mode == "replay" or batch.routed_experts is None:
        return batch
    return dataclasses.replace(batch, routed_experts=None)


def _predicts_loss_token(batch: TrainBatch) -> torch.Tensor:
    """``[T]`` True at positions whose output is the log-prob of a loss token."""
    mask_T = batch.loss_mask > 0
    pred_T = torch.zeros_like(mask_T)
    pred_T[:-1] = mask_T[1:]
    return pred_T


def _logprob_mismatch(logp_T: torch.Tensor, batch: TrainBatch) -> float:
    if batch.rollout_logprobs is None:
        return float("nan")
    mask_T = batch.loss_mask > 0
    n = int(mask_T.sum())
    if n == 0:
        return 0.0
    diff_T = (logp_T.float().cpu() - batch.rollout_logprobs.float().cpu()).abs()
    return float(diff_T[mask_T.cpu()].sum()) / n


def routing_step(
    policy: Any, batch: TrainBatch, *, mode: str, step: int, no_replay_every: int
) -> tuple[TrainBatch, dict[str, float]]:
    """The batch the policy trains on (routing replayed or not, per ``mode``) and the step's
    ``routing/*`` metrics (see the module docstring); runs one log-prob pass, plus one without
    replay on step 1 and every ``no_replay_every`` steps after it (``replay`` only).

    Raises:
        DataError: routing is on but the batch carries none (the generator returned none).
    """
    engine_TLK = batch.routed_experts
    if engine_TLK is None:
        raise DataError(
            f"rollout.routing_replay: {mode!r} but the step's rollouts carry no routed_experts; "
            "the generator did not return them (does it serve a mixture-of-experts model? "
            "does a custom generate_fn pass ctx.return_routing and keep "
            "GenerationResult.routed_experts in its rollouts?)."
        )
    train_batch = for_policy(batch, mode)
    pred_T = _predicts_loss_token(batch)
    out = policy.compute_logprobs(train_batch)
    metrics: dict[str, float] = {
        "routing/bytes_per_token": float(engine_TLK[0].numel() * engine_TLK.element_size()),
        "routing/logprob_mismatch": _logprob_mismatch(out.logprobs, batch),
    }
    own_TLK = out.routed_experts
    if own_TLK is not None:
        metrics["routing/router_mismatch"] = routing_mismatch(
            own_TLK.cpu(), engine_TLK.cpu(), pred_T.cpu()
        )
    if mode == "replay":
        used_TLK = train_batch.routed_experts
        metrics["routing/mismatch"] = routing_mismatch(
            used_TLK.cpu(), engine_TLK.cpu(), pred_T.cpu()
        )
        if no_replay_every and (step - 1) % no_replay_every == 0:
            plain = policy.compute_logprobs(for_policy(batch, "record"))
            metrics["routing/logprob_mismatch_no_replay"] = _logprob_mismatch(plain.logprobs, batch)
            if plain.routed_experts is not None:
                metrics["routing/mismatch_no_replay"] = routing_mismatch(
                    plain.routed_experts.cpu(), engine_TLK.cpu(), pred_T.cpu()
                )
    elif own_TLK is not None:
        metrics["routing/mismatch"] = metrics["routing/router_mismatch"]
    return train_batch, metrics
