"""Helpers to resume partial (aborted) rollouts token-in/token-out.

An aborted rollout keeps the tokens, log-probs and per-token versions sampled so far. Resuming
sends its whole token list back to the engine and appends what comes out, tagged with the
version of the weights that sampled it::

    for group in buffer.take_partial():
        for i, r in enumerate(group.rollouts):
            if r.status == RolloutStatus.ABORTED:
                req = resume_request(r, sampling, request_id=r.sample_id)
                (res,) = await generator.generate([req])
                group.rollouts[i] = continue_rollout(r, res)
"""

from __future__ import annotations

import dataclasses

from rl_core.lora import SEQUENCE_ADAPTER_KEY
from rl_core.types import GenerationRequest, GenerationResult, Rollout, SamplingParams

__all__ = ["continue_rollout", "resume_request"]


def resume_request(
    rollout: Rollout, sampling: SamplingParams, *, request_id: str
) -> GenerationRequest | None:
    """The request that continues ``rollout``: all its tokens in, and a ``max_new_tokens`` budget
    reduced by the response tokens already sampled, on the rollout's LoRA adapter (multi-LoRA,
    ``metadata[SEQUENCE_ADAPTER_KEY]``). ``None`` when the budget is used up."""
    left = sampling.max_new_tokens - rollout.response_length
    if left < 1:
        return None
    return GenerationRequest(
        request_id=request_id,
        input_ids=rollout.tokens,
        sampling=dataclasses.replace(sampling, max_new_tokens=left),
        return_routing=rollout.routed_experts is not None,
        adapter=rollout.metadata.get(SEQUENCE_ADAPTER_KEY),
    )


def continue_rollout(rollout: Rollout, result: GenerationResult) -> Rollout:
    """``rollout`` extended by ``result``: its tokens and log-probs appended with loss mask 1,
    versions set to ``result.weight_version``, and the status from its finish reason.

    When the result carries routing it covers the whole sequence (the engine ran every earlier
    token again on its current weights) and replaces the rollout's; a rollout that had routing
    and a result without it is refused (the resumed tokens would have none)."""
    k = len(result.output_ids)
    n = len(rollout.tokens) + k
    routed = None
    if result.routed_experts is not None:
        from rl_core.routing import pad_routing

        routed = pad_routing(result.routed_experts, n)
    elif rollout.routed_experts is not None and k == 0:
        # Aborted again before the engine ran it: nothing new, the old routing still covers it.
        routed = rollout.routed_experts
    elif rollout.routed_experts is not None:
        raise ValueError(
            f"continue_rollout: rollout {rollout.sample_id} carries routed_experts but the "
            "resumed generation returned none; resume it with resume_request (return_routing)."
        )
    return dataclasses.replace(
        rollout,
        tokens=rollout.tokens + tuple(result.output_ids),
        loss_mask=rollout.loss_mask + (1,) * k,
        rollout_logprobs=rollout.rollout_logprobs + tuple(float(x) for x in result.output_logprobs),
        versions=rollout.versions + (result.weight_version,) * k,
        status=result.finish_reason.to_status(),
        routed_experts=routed,
    )
