"""Token log-probs and entropy straight from hidden states and the LM head, in chunks of tokens.

The plain way to score tokens (``logits = hidden @ W.T``, then ``log_softmax``) holds float32
logits ``[S, V]`` for every scored position, and autograd keeps them (and the softmax) until
backward: at 32k packed tokens and a 49k vocabulary that is 6.4 GB per copy. Here the head is
applied ``chunk_tokens`` rows at a time inside one autograd function that keeps only the
per-position statistics (log-sum-exp, entropy) and recomputes each chunk's logits in backward,
so neither pass holds more than one chunk's ``[C, V]`` (plus a few temporaries of that size)::

    from rl_core.logprobs import linear_logprobs

    hidden_SH = hidden_TH.index_select(0, source_S)          # the positions that are scored
    logp_S, ent_S = linear_logprobs(hidden_SH, lm_head.weight, targets_S,
                                    temperature=1.0, with_entropy=True, chunk_tokens=1024)
    loss = -(logp_S * weights_S).sum(); loss.backward()       # grads of hidden and weight

Values and gradients equal those of the unchunked computation (``chunk_tokens=0``, ordinary
autograd) up to floating-point rounding.

Vocabulary-parallel heads (tensor parallelism): pass this rank's weight slice ``[V/tp, H]``,
its first global id ``vocab_start``, the true ``vocab_size`` (columns at or beyond it are padding
and are excluded) and the tensor-parallel ``group``. Each chunk then all-reduces its row max and
``[3, C]`` partial sums (sum of exponentials, target logit, ``sum e*z``), never the logits. The
backward needs no communication for the logits' gradient (it uses the saved global
log-sum-exp and entropy); the hidden-state gradient it returns is this rank's partial sum, so
the caller all-reduces it across the group (Megatron's ``copy_to_tensor_model_parallel_region``
on the input does exactly that, as for its own column-parallel output layer).

Tensor-name legend: ``S`` scored positions, ``C`` positions of one chunk, ``H`` hidden size,
``V`` vocabulary (this rank's slice under tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["linear_logprobs"]


def _all_reduce(x: torch.Tensor, group: Any, op: Any = None) -> torch.Tensor:
    if group is not None and torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(
            x, op=op if op is not None else torch.distributed.ReduceOp.SUM, group=group
        )
    return x


def _softmax_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, torch.float32)


def _chunk_logits(
    hidden_CH: torch.Tensor,
    weight_VH: torch.Tensor,
    temperature: float,
    valid_V: torch.Tensor | None,
) -> torch.Tensor:
    """``[C, V]`` logits of one chunk in float32 (float64 for float64 inputs); the matmul runs
    in the hidden dtype, like ``nn.Linear``; padding columns are ``-inf``."""
    z_CV = (hidden_CH @ weight_VH.t()).to(_softmax_dtype(hidden_CH))
    if temperature != 1.0:
        z_CV.div_(temperature)
    if valid_V is not None:
        z_CV.masked_fill_(~valid_V, float("-inf"))
    return z_CV


class _ChunkedLinearLogprobs(torch.autograd.Function):
    """``(hidden, weight) -> (logp, entropy)`` with per-chunk recomputation in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden_SH: torch.Tensor,
        weight_VH: torch.Tensor,
        targets_S: torch.Tensor,
        temperature: float,
        with_entropy: bool,
        chunk_tokens: int,
        vocab_start: int,
        vocab_size: int,
        group: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        width = weight_VH.shape[0]
        n = hidden_SH.shape[0]
        ids_V = torch.arange(vocab_start, vocab_start + width, device=weight_VH.device)
        valid_V = ids_V < vocab_size
        valid_V = None if bool(valid_V.all()) else valid_V
        local_S = targets_S - vocab_start
        mine_S = (local_S >= 0) & (local_S < width)
        local_S = local_S.clamp(0, max(width - 1, 0))
        lse_S = torch.empty(n, dtype=_softmax_dtype(hidden_SH), device=hidden_SH.device)
        logp_S = torch.empty_like(lse_S)
        ent_S = torch.zeros_like(lse_S)
        for a in range(0, n, chunk_tokens):
            b = min(a + chunk_tokens, n)
            z_CV = _chunk_logits(hidden_SH[a:b], weight_VH, temperature, valid_V)
            max_C = z_CV.amax(dim=-1)
            if group is not None:
                _all_reduce(max_C, group, torch.distributed.ReduceOp.MAX)
            z_CV.sub_(max_C[:, None])  # shifted logits s = z - max
            parts_3C = z_CV.new_zeros(3, b - a)
            parts_3C[1] = torch.where(mine_S[a:b], z_CV.gather(-1, local_S[a:b, None])[:, 0], 0.0)
            if with_entropy:
                s_CV = z_CV.masked_fill(valid_V.logical_not(), 0.0) if valid_V is not None else z_CV
                e_CV = z_CV.exp()
                parts_3C[0] = e_CV.sum(dim=-1)
                parts_3C[2] = (e_CV * s_CV).sum(dim=-1)
                del e_CV, s_CV
            else:
                parts_3C[0] = z_CV.exp_().sum(dim=-1)
            del z_CV
            _all_reduce(parts_3C, group)
            log_sum_C = parts_3C[0].log()
            lse_S[a:b] = max_C + log_sum_C
            logp_S[a:b] = parts_3C[1] - log_sum_C
            if with_entropy:
                ent_S[a:b] = log_sum_C - parts_3C[2] / parts_3C[0]
        ctx.save_for_backward(hidden_SH, weight_VH, local_S, mine_S, lse_S, ent_S)
        ctx.valid_V = valid_V
        ctx.settings = (temperature, with_entropy, chunk_tokens)
        return logp_S, ent_S.clamp_min(0.0)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp_S: torch.Tensor, g_ent_S: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden_SH, weight_VH, local_S, mine_S, lse_S, ent_S = ctx.saved_tensors
        temperature, with_entropy, chunk_tokens = ctx.settings
        valid_V = ctx.valid_V
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_SH = torch.empty_like(hidden_SH) if need_h else None
        acc = _softmax_dtype(weight_VH)
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device)
        use_ent = with_entropy and g_ent_S is not None
        n = hidden_SH.shape[0]
        for a in range(0, n, chunk_tokens):
            b = min(a + chunk_tokens, n)
            z_CV = _chunk_logits(hidden_SH[a:b], weight_VH, temperature, valid_V)
            # log p = z - lse; p = exp(log p) (0 on padding columns).
            z_CV.sub_(lse_S[a:b, None])
            p_CV = z_CV.exp()
            # d logp_t / dz = onehot(t) - p;  d H / dz = -p * (log p + H).
            if use_ent:
                if valid_V is not None:
                    z_CV.masked_fill_(~valid_V, 0.0)
                z_CV.add_(ent_S[a:b, None]).mul_(p_CV).mul_(-g_ent_S[a:b, None])
                g_CV = z_CV
                g_CV.sub_(p_CV.mul_(g_logp_S[a:b, None]))
            else:
                del z_CV
                g_CV = p_CV.mul_(-g_logp_S[a:b, None])
            del p_CV
            rows_C = torch.arange(b - a, device=g_CV.device)
            g_CV.index_put_(
                (rows_C, local_S[a:b]),
                torch.where(mine_S[a:b], g_logp_S[a:b], 0.0),
                accumulate=True,
            )
            if temperature != 1.0:
                g_CV.div_(temperature)
            g_CV = g_CV.to(hidden_SH.dtype)
            if grad_h_SH is not None:
                grad_h_SH[a:b] = g_CV @ weight_VH
            if need_w:
                grad_w_VH += (g_CV.t() @ hidden_SH[a:b]).to(acc)
            del g_CV
        grad_w = grad_w_VH.to(weight_VH.dtype) if need_w else None
        return grad_h_SH, grad_w, None, None, None, None, None, None, None


def _unchunked(
    hidden_SH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_S: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain autograd computation (whole ``[S, V]`` logits), single process."""
    z_SV = (hidden_SH @ weight_VH.t()).to(_softmax_dtype(hidden_SH)) / temperature
    if vocab_size < z_SV.shape[-1]:
        z_SV = z_SV[:, :vocab_size]
    logq_SV = torch.log_softmax(z_SV, dim=-1)
    logp_S = logq_SV.gather(-1, targets_S[:, None])[:, 0]
    if not with_entropy:
        return logp_S, None
    ent_S = -(logq_SV.exp() * logq_SV).sum(dim=-1)
    return logp_S, ent_S.clamp_min(0.0)


def linear_logprobs(
    hidden_SH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_S: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_tokens: int = 1024,
    vocab_start: int = 0,
    vocab_size: int | None = None,
    group: Any = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(hidden @ W.T / temperature)[target]`` per row, and the entropy, in chunks.

    Args:
        hidden_SH: ``[S, H]`` final hidden states of the positions to score (any float dtype;
            the matmul runs in it, the softmax in float32).
        weight_VH: ``[V, H]`` LM-head weight (this rank's vocabulary slice under TP), same dtype.
        targets_S: ``[S]`` int64 global token ids scored at each row.
        temperature: logits are divided by it first.
        with_entropy: also return the entropy of each row's distribution.
        chunk_tokens: rows per chunk; 0 computes everything at once with plain autograd
            (single process only: the reference the chunked path is tested against).
        vocab_start: first global id of ``weight_VH``'s rows.
        vocab_size: true vocabulary size (ids at or beyond it are padding); default: all rows.
        group: tensor-parallel process group over which the vocabulary is split, or ``None``.

    Returns:
        ``logp_S`` and ``entropy_S`` (or ``None``), float32 (float64 for float64 inputs), differentiable with respect to
        ``hidden_SH`` and ``weight_VH``; identical on every rank of ``group``.
    """
    if vocab_size is None:
        vocab_size = vocab_start + weight_VH.shape[0]
    if hidden_SH.shape[0] == 0:
        empty_S = hidden_SH.new_zeros(0, dtype=_softmax_dtype(hidden_SH)) + 0.0 * weight_VH.sum()
        return empty_S, (empty_S if with_entropy else None)
    if chunk_tokens <= 0:
        if group is not None and torch.distributed.get_world_size(group) > 1:
            raise ValueError("linear_logprobs: chunk_tokens=0 is single-process only.")
        return _unchunked(hidden_SH, weight_VH, targets_S, temperature, with_entropy, vocab_size)
    logp_S, ent_S = _ChunkedLinearLogprobs.apply(
        hidden_SH,
        weight_VH,
        targets_S,
        float(temperature),
        bool(with_entropy),
        int(chunk_tokens),
        int(vocab_start),
        int(vocab_size),
        group,
    )
    return logp_S, (ent_S if with_entropy else None)
