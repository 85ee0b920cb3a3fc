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

Truncated sampling (``top_p < 1`` and/or ``top_k > 0``): the sampler drew each token from the
temperature-scaled distribution renormalised over a candidate set, so the behaviour policy's
log-prob is ``log_softmax`` over that set. Pass the same ``top_p``/``top_k`` here and every row's
logits outside the set are ``-inf`` before the softmax (:func:`truncate_logits`: the set is
rebuilt from the trainer's own logits, so it equals the engine's when the logits agree), which
keeps the importance ratio ``exp(logp_train - logp_rollout)`` unbiased (without it, the ratio
carries the kept mass ``S``: ``log ratio = log S < 0`` on every token). The entropy is then the
entropy of the truncated distribution, the one actually sampled from. The scored token itself
always stays a candidate, so a token the current weights would no longer keep (an off-policy
token, or one at the edge of the set under float noise) gets a finite log-prob rather than
``-inf``. Under tensor parallelism (``group`` of more than one rank) truncation is refused: the
threshold would need the global sorted distribution.

Tensor-name legend: ``S`` scored positions, ``C`` positions of one chunk, ``H`` hidden size,
``V`` vocabulary (this rank's slice under tensor parallelism).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["linear_logprobs", "truncate_logits", "truncates"]


def truncates(top_p: float, top_k: int) -> bool:
    """Whether ``top_p``/``top_k`` cut anything (``top_p < 1`` or ``top_k > 0``)."""
    return top_p < 1.0 or top_k > 0


def truncate_logits(
    z_RV: torch.Tensor,
    *,
    top_p: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor = 0,
    keep_R: torch.Tensor | None = None,
) -> torch.Tensor:
    """``z_RV`` with every entry outside each row's top-k / top-p candidate set set to ``-inf``.

    ``z_RV`` are temperature-scaled logits (rows of one distribution each; ``-inf`` entries, such
    as vocabulary padding, are never candidates unless ``keep_R`` names them). The set is
    defined by values, so ties are treated alike whatever a sort would order them:

    - top-k: the tokens with fewer than ``top_k`` tokens strictly above them (all tokens tied
      with the k-th largest logit stay, so the set can exceed ``k``);
    - top-p, on the distribution renormalised over the top-k set: the tokens whose strictly
      larger tokens hold less than ``top_p`` of the mass (the smallest prefix of the sorted
      distribution reaching ``top_p``, widened to its whole tie group).

    Top-k runs first, then top-p (as SGLang, vLLM and transformers order them). The sampler
    (``rl_hf.HFGenerator``) and the trainer's log-probs both call this, so their sets agree
    whenever their logits do.

    Args:
        z_RV: ``[R, V]`` float logits (already divided by the temperature).
        top_p: nucleus mass in ``(0, 1]``, or ``[R]`` per row; 1 keeps all.
        top_k: candidates per row, or ``[R]`` per row; 0 keeps all.
        keep_R: ``[R]`` int64 token ids that stay candidates whatever their rank (the scored
            tokens), or ``None``.

    Returns:
        A new tensor (``z_RV`` itself when scalar ``top_p``/``top_k`` cut nothing).
    """
    scalar = not isinstance(top_p, torch.Tensor) and not isinstance(top_k, torch.Tensor)
    if (scalar and not truncates(float(top_p), int(top_k))) or z_RV.shape[-1] == 0:
        return z_RV
    R, V = z_RV.shape
    dev = z_RV.device
    with torch.no_grad():
        p_R = torch.as_tensor(top_p, dtype=z_RV.dtype, device=dev).expand(R)
        k_R = torch.as_tensor(top_k, dtype=torch.long, device=dev).expand(R)
        k_R = torch.where((k_R > 0) & (k_R < V), k_R, V)
        z_sorted_RV = z_RV.sort(dim=-1, descending=True).values
        thr_k_R1 = z_sorted_RV.gather(-1, (k_R - 1)[:, None])
        in_k_RV = (z_sorted_RV >= thr_k_R1) & (z_sorted_RV > float("-inf"))
        count_R = in_k_RV.sum(dim=-1)
        if bool((p_R < 1).any()):
            q_RV = torch.softmax(z_sorted_RV.masked_fill(~in_k_RV, float("-inf")), dim=-1)
            before_RV = q_RV.cumsum(dim=-1) - q_RV  # mass strictly above, in sort order
            count_p_R = ((before_RV < p_R[:, None]) & in_k_RV).sum(dim=-1)
            count_R = torch.where(p_R < 1, count_p_R, count_R)
        # The last candidate's value; its whole tie group (and everything above) stays.
        thr_R1 = z_sorted_RV.gather(-1, (count_R - 1).clamp(0, V - 1)[:, None])
        keep_RV = (z_RV >= thr_R1) & (z_RV > float("-inf"))
        if keep_R is not None:
            keep_RV.scatter_(-1, keep_R[:, None], True)
    return z_RV.masked_fill(~keep_RV, float("-inf"))


def _check_truncation_group(top_p: float, top_k: int, group: Any) -> None:
    if (
        truncates(top_p, top_k)
        and group is not None
        and torch.distributed.get_world_size(group) > 1
    ):
        raise ValueError(
            "linear_logprobs: top_p/top_k truncation under tensor parallelism (a vocabulary "
            "split over more than one rank) is not supported; the candidate threshold needs "
            "the global sorted distribution. Use tensor_parallel_size 1 or sample without "
            "top_p/top_k."
        )


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
    trunc: tuple[float, int] = (1.0, 0),
    local_C: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[C, V]`` logits of one chunk in float32 (float64 for float64 inputs); the matmul runs
    in the hidden dtype, like ``nn.Linear``; padding columns are ``-inf``, and so are the
    entries outside the top-p/top-k candidate set ``trunc`` (the target ``local_C`` kept)."""
    z_CV = (hidden_CH @ weight_VH.t()).to(_softmax_dtype(hidden_CH))
    if temperature != 1.0:
        z_CV.div_(temperature)
    if valid_V is not None:
        z_CV.masked_fill_(~valid_V, float("-inf"))
    if truncates(*trunc):
        z_CV = truncate_logits(z_CV, top_p=trunc[0], top_k=trunc[1], keep_R=local_C)
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
        trunc: tuple[float, int],
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
            z_CV = _chunk_logits(
                hidden_SH[a:b], weight_VH, temperature, valid_V, trunc, local_S[a:b]
            )
            max_C = z_CV.amax(dim=-1)
            if group is not None:
                _all_reduce(max_C, group, torch.distributed.ReduceOp.MAX)
            z_CV.sub_(max_C[:, None])  # shifted logits s = z - max
            parts_3C = z_CV.new_zeros(3, b - a)
            parts_3C[1] = torch.where(mine_S[a:b], z_CV.gather(-1, local_S[a:b, None])[:, 0], 0.0)
            if with_entropy:
                if truncates(*trunc):  # -inf entries (cut or padding) have e = 0: s*e = 0
                    s_CV = z_CV.nan_to_num(neginf=0.0)
                elif valid_V is not None:
                    s_CV = z_CV.masked_fill(valid_V.logical_not(), 0.0)
                else:
                    s_CV = z_CV
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
        ctx.settings = (temperature, with_entropy, chunk_tokens, trunc)
        return logp_S, ent_S.clamp_min(0.0)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, g_logp_S: torch.Tensor, g_ent_S: torch.Tensor | None
    ) -> tuple[Any, ...]:
        hidden_SH, weight_VH, local_S, mine_S, lse_S, ent_S = ctx.saved_tensors
        temperature, with_entropy, chunk_tokens, trunc = ctx.settings
        valid_V = ctx.valid_V
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h_SH = torch.empty_like(hidden_SH) if need_h else None
        acc = _softmax_dtype(weight_VH)
        grad_w_VH = torch.zeros(weight_VH.shape, dtype=acc, device=weight_VH.device)
        use_ent = with_entropy and g_ent_S is not None
        n = hidden_SH.shape[0]
        for a in range(0, n, chunk_tokens):
            b = min(a + chunk_tokens, n)
            z_CV = _chunk_logits(
                hidden_SH[a:b], weight_VH, temperature, valid_V, trunc, local_S[a:b]
            )
            # log p = z - lse; p = exp(log p) (0 on padding columns).
            z_CV.sub_(lse_S[a:b, None])
            p_CV = z_CV.exp()
            # d logp_t / dz = onehot(t) - p;  d H / dz = -p * (log p + H).
            if use_ent:
                if truncates(*trunc):
                    z_CV.nan_to_num_(neginf=0.0)
                elif valid_V is not None:
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
        return grad_h_SH, grad_w, None, None, None, None, None, None, None, None


def _unchunked(
    hidden_SH: torch.Tensor,
    weight_VH: torch.Tensor,
    targets_S: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    vocab_size: int,
    trunc: tuple[float, int] = (1.0, 0),
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The plain autograd computation (whole ``[S, V]`` logits), single process."""
    z_SV = (hidden_SH @ weight_VH.t()).to(_softmax_dtype(hidden_SH)) / temperature
    if vocab_size < z_SV.shape[-1]:
        z_SV = z_SV[:, :vocab_size]
    z_SV = truncate_logits(z_SV, top_p=trunc[0], top_k=trunc[1], keep_R=targets_S)
    logq_SV = torch.log_softmax(z_SV, dim=-1)
    logp_S = logq_SV.gather(-1, targets_S[:, None])[:, 0]
    if not with_entropy:
        return logp_S, None
    ent_S = -(logq_SV.exp() * logq_SV.nan_to_num(neginf=0.0)).sum(dim=-1)
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
    top_p: float = 1.0,
    top_k: int = 0,
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
        top_p: renormalise over the sampler's nucleus (see :func:`truncate_logits`); 1: off.
        top_k: renormalise over the sampler's top-k set; 0: off. Either one needs ``group``
            of one rank (else ``ValueError``).

    Returns:
        ``logp_S`` and ``entropy_S`` (or ``None``), float32 (float64 for float64 inputs), differentiable with respect to
        ``hidden_SH`` and ``weight_VH``; identical on every rank of ``group``.
    """
    if vocab_size is None:
        vocab_size = vocab_start + weight_VH.shape[0]
    _check_truncation_group(top_p, top_k, group)
    trunc = (float(top_p), int(top_k))
    if hidden_SH.shape[0] == 0:
        empty_S = hidden_SH.new_zeros(0, dtype=_softmax_dtype(hidden_SH)) + 0.0 * weight_VH.sum()
        return empty_S, (empty_S if with_entropy else None)
    if chunk_tokens <= 0:
        if group is not None and torch.distributed.get_world_size(group) > 1:
            raise ValueError("linear_logprobs: chunk_tokens=0 is single-process only.")
        return _unchunked(
            hidden_SH, weight_VH, targets_S, temperature, with_entropy, vocab_size, trunc
        )
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
        trunc,
    )
    return logp_S, (ent_S if with_entropy else None)
