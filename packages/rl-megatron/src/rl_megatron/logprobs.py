"""Token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its vocabulary slice ``[S, V/tp]``. The global
log-sum-exp is built from the all-reduced max and sum of exponentials; the target logit from the
rank that owns the token; the entropy ``H = lse - sum_v p_v z_v`` from an all-reduced partial dot
product. All reductions are differentiable in Megatron's style (all-reduce forward, identity
backward), so the log-probs carry correct gradients into every rank's slice. Vocabulary padding
columns (ids >= the true vocabulary) are excluded.

Tensor-name legend: ``S`` scored positions, ``V`` this rank's vocabulary slice.
"""

from __future__ import annotations

import torch

__all__ = ["vocab_parallel_logprobs"]


def _all_reduce(x: torch.Tensor, group: torch.distributed.ProcessGroup | None) -> torch.Tensor:
    if group is None or torch.distributed.get_world_size(group) == 1:
        return x
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits_SV: torch.Tensor,
    targets_S: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: torch.distributed.ProcessGroup | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log p(target)`` and the entropy of each position's predictive distribution.

    Args:
        logits_SV: ``[S, V]`` logits of this rank's vocabulary slice ``[vocab_start,
            vocab_start + V)`` (any float dtype; computed in float32).
        targets_S: ``[S]`` int64 global token ids.
        vocab_start: first global vocabulary id of this rank's slice.
        vocab_size: true vocabulary size; columns at or beyond it are padding and ignored.
        group: the tensor-parallel process group (``None`` or size 1: no communication).
        temperature: logits are divided by it first.
        with_entropy: also return the entropy ``[S]``.

    Returns:
        ``logp_S`` float32 and ``entropy_S`` (or ``None``), identical on every TP rank.
    """
    z_SV = logits_SV.float()
    if temperature != 1.0:
        z_SV = z_SV / temperature
    width = z_SV.shape[-1]
    ids_V = torch.arange(vocab_start, vocab_start + width, device=z_SV.device)
    valid_V = ids_V < vocab_size
    has_padding = not bool(valid_V.all())
    if has_padding:
        z_SV = z_SV.masked_fill(~valid_V, float("-inf"))
    with torch.no_grad():
        max_S = z_SV.max(dim=-1).values
        if group is not None and torch.distributed.get_world_size(group) > 1:
            torch.distributed.all_reduce(max_S, op=torch.distributed.ReduceOp.MAX, group=group)
    shifted_SV = z_SV - max_S[:, None]
    exp_SV = shifted_SV.exp()
    sum_exp_S = _all_reduce(exp_SV.sum(dim=-1), group)
    log_sum_S = sum_exp_S.log()
    local_S = targets_S - vocab_start
    mine_S = (local_S >= 0) & (local_S < width)
    picked_S = shifted_SV.gather(-1, local_S.clamp(0, width - 1)[:, None]).squeeze(-1)
    target_S = _all_reduce(torch.where(mine_S, picked_S, 0.0), group)
    logp_S = target_S - log_sum_S
    if not with_entropy:
        return logp_S, None
    # H = log(sum e^s) - sum_v p_v s_v with s = z - max (shift-invariant); padding has p = 0.
    finite_SV = shifted_SV.masked_fill(~valid_V, 0.0) if has_padding else shifted_SV
    dot_S = _all_reduce((exp_SV * finite_SV).sum(dim=-1), group)
    entropy_S = (log_sum_S - dot_S / sum_exp_S).clamp_min(0.0)
    return logp_S, entropy_S
