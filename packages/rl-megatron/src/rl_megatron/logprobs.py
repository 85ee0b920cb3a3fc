"""Token log-probs and entropy from vocabulary-parallel logits, without gathering the vocabulary.

Each tensor-parallel rank holds the logits of its vocabulary slice ``[S, V/tp]``. The global
log-sum-exp is built from the all-reduced max and sum of exponentials; the target logit from the
rank that owns the token; the entropy ``H = lse - sum_v p_v z_v`` from an all-reduced partial dot
product. All reductions are differentiable in Megatron's style (all-reduce forward, identity
backward), so the log-probs carry correct gradients into every rank's slice. Vocabulary padding
columns (ids >= the true vocabulary) are excluded.

Long context: :func:`emit_hidden_states` makes the model return its final hidden states instead
of logits, and :func:`chunked_vocab_parallel_logprobs` applies this rank's LM-head slice to them
a chunk of positions at a time (:func:`rl_core.logprobs.linear_logprobs`: per chunk, the same
all-reduced max / sum of exponentials / target logit / ``sum e*z``; logits recomputed in
backward), so no rank ever holds ``[S, V/tp]`` float32 logits for the whole micro-batch.

Truncated sampling: ``top_p``/``top_k`` renormalise each position over the sampler's candidate
set (:func:`rl_core.logprobs.truncate_logits`), on one tensor-parallel rank only (a split
vocabulary raises ``ValueError``: the threshold would need the global sorted distribution).

Tensor-name legend: ``S`` scored positions, ``V`` this rank's vocabulary slice, ``H`` hidden size.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.logprobs import linear_logprobs, truncate_logits, truncates

__all__ = ["chunked_vocab_parallel_logprobs", "emit_hidden_states", "vocab_parallel_logprobs"]


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
    top_p: float = 1.0,
    top_k: int = 0,
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
        top_p: renormalise over the sampler's top-p set (1: off); one TP rank only.
        top_k: renormalise over the sampler's top-k set (0: off); one TP rank only.

    Returns:
        ``logp_S`` float32 and ``entropy_S`` (or ``None``), identical on every TP rank.
    """
    trunc = truncates(top_p, top_k)
    if trunc and group is not None and torch.distributed.get_world_size(group) > 1:
        raise ValueError(
            "vocab_parallel_logprobs: top_p/top_k truncation needs the whole vocabulary on one "
            "rank (tensor-parallel size 1)."
        )
    z_SV = logits_SV.float()
    if temperature != 1.0:
        z_SV = z_SV / temperature
    width = z_SV.shape[-1]
    ids_V = torch.arange(vocab_start, vocab_start + width, device=z_SV.device)
    valid_V = ids_V < vocab_size
    has_padding = not bool(valid_V.all())
    if has_padding:
        z_SV = z_SV.masked_fill(~valid_V, float("-inf"))
    if trunc:
        z_SV = truncate_logits(z_SV, top_p=top_p, top_k=top_k, keep_R=targets_S - vocab_start)
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
    if trunc:  # cut and padding entries: e = 0 and s = -inf; their product is 0
        finite_SV = shifted_SV.masked_fill(torch.isinf(shifted_SV), 0.0)
    else:
        finite_SV = shifted_SV.masked_fill(~valid_V, 0.0) if has_padding else shifted_SV
    dot_S = _all_reduce((exp_SV * finite_SV).sum(dim=-1), group)
    entropy_S = (log_sum_S - dot_S / sum_exp_S).clamp_min(0.0)
    return logp_S, entropy_S


class _CopyToTensorParallel(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over the tensor-parallel group.

    Megatron's ``copy_to_tensor_model_parallel_region`` all-reduces ``grad.contiguous()`` and
    returns ``grad``: when the incoming gradient is not contiguous (here it is, being the
    gradient of the ``transpose(0, 1)`` that ends ``GPTModel.forward``) the reduction lands in a
    temporary copy and is lost. This one reduces a contiguous tensor and returns that tensor.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def emit_hidden_states(output_layer: Any, group: Any) -> None:
    """Make a ``ColumnParallelLinear`` output layer return its (TP-mapped) input, not logits.

    The model's forward then ends with the final hidden states ``[N, L, H]`` where it would
    return logits. The input goes through the same tensor-parallel mapping the layer applies
    before its matmul (all-gather under sequence parallelism, else an identity whose backward
    all-reduces the gradient), so the hidden-state gradients of every TP rank's partial head
    are summed exactly as for the layer's own matmul.
    """
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    tp = torch.distributed.get_world_size(group) if group is not None else 1

    def forward(input_: torch.Tensor, weight: Any = None, **_: Any) -> tuple[torch.Tensor, None]:
        if getattr(output_layer, "sequence_parallel", False):
            return gather_from_sequence_parallel_region(
                input_, tensor_parallel_output_grad=True, group=group
            ), None
        if tp > 1:
            return _CopyToTensorParallel.apply(input_, group), None
        return input_, None

    output_layer.forward = forward


def chunked_vocab_parallel_logprobs(
    hidden_SH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_S: torch.Tensor,
    *,
    vocab_start: int,
    vocab_size: int,
    group: torch.distributed.ProcessGroup | None,
    chunk_tokens: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`vocab_parallel_logprobs` from hidden states and this rank's head slice, in chunks.

    Args:
        hidden_SH: ``[S, H]`` final hidden states of the positions to score, already mapped
            into the tensor-parallel region (see :func:`emit_hidden_states`).
        weight_VH: ``[V, H]`` this rank's slice of the output-layer weight.
        targets_S: ``[S]`` int64 global token ids.
        vocab_start: first global id of the slice.
        vocab_size: true vocabulary size (padding columns excluded).
        group: the tensor-parallel process group.
        chunk_tokens: positions per chunk (> 0).
        temperature: logits are divided by it first.
        with_entropy: also return the entropy ``[S]``.
        top_p: renormalise over the sampler's top-p set (1: off); one TP rank only.
        top_k: renormalise over the sampler's top-k set (0: off); one TP rank only.

    Returns:
        ``logp_S`` float32 and ``entropy_S`` (or ``None``), identical on every TP rank.
    """
    if group is not None and torch.distributed.get_world_size(group) == 1:
        group = None
    return linear_logprobs(
        hidden_SH,
        weight_VH,
        targets_S,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk_tokens=chunk_tokens,
        vocab_start=vocab_start,
        vocab_size=vocab_size,
        group=group,
        top_p=top_p,
        top_k=top_k,
    )
