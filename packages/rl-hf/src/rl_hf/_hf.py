"""Private helpers shared by the Hugging Face reference backends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.config import PositiveFloat
from rl_core.errors import CheckpointError, ConfigError
from rl_core.logprobs import truncate_logits, truncates

__all__ = [
    "enable_activation_checkpointing",
    "hf_state_dict",
    "quiet_progress",
    "token_logprobs",
]


@contextlib.contextmanager
def quiet_progress() -> Iterator[None]:
    """Silence transformers' load/save progress bars inside the block, then restore them."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def attention_refused(e: ValueError, field: str, what: str) -> ConfigError | None:
    """The ``ConfigError`` for transformers refusing an attention implementation (``what``)
    for an architecture at load, naming ``field`` and its fix, ``eager``; ``None`` for another
    ``ValueError``."""
    if "does not support an attention implementation" not in str(e):
        return None
    return ConfigError(
        f"{field}: transformers cannot run this architecture with {what} "
        f"({str(e).split(' Please')[0]}); set {field}: eager."
    )


def token_logprobs(
    logits_TV: torch.Tensor,
    tokens_T: torch.Tensor,
    starts_T: torch.Tensor,
    *,
    temperature: PositiveFloat = 1.0,
    with_entropy: bool = False,
    top_p: float = 1.0,
    top_k: int = 0,
    rows_T: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each token under the logits of the position before it, and that entropy.

    Args:
        logits_TV: ``[T, V]`` logits of a packed forward (position ``t`` predicts ``t + 1``).
        tokens_T: ``[T]`` int64 token ids.
        starts_T: ``[T]`` bool, True at the first token of each sequence.
        temperature: logits are divided by it before the softmax.
        with_entropy: also return the entropy of each predictive distribution.
        top_p: renormalise over the sampler's top-p candidate set (1: off), see
            :func:`rl_core.logprobs.truncate_logits`; the entropy is then the truncated one.
        top_k: renormalise over the sampler's top-k candidate set (0: off).
        rows_T: ``[T]`` the row of ``logits_TV`` (then ``[C, V]``) holding each packed token's
            logits, for a forward on a compact row (shared prefixes: ``expand_T`` of
            :func:`rl_hf._packed_attention.packed_inputs`); ``None``: row ``t``. The
            log-sum-exp and entropy are then computed once per compact row and gathered, and no
            ``[T, V]`` copy is made (with truncation the candidate set depends on each target,
            so the rows are expanded first).

    Returns:
        ``logp_T`` (float32, 0 at sequence starts) and ``entropy_T`` (or ``None``).
        Memory: besides ``logits_TV`` at most one ``[T, V]`` (``[C, V]``) temporary exists at a
        time (log-sum-exp and gather instead of a full ``log_softmax``).
    """
    if tokens_T.shape[0] == 0:
        empty_T = logits_TV.new_zeros(0, dtype=torch.float32)
        return empty_T, (empty_T if with_entropy else None)
    cut = truncates(top_p, top_k)
    if rows_T is not None and cut:
        logits_TV, rows_T = logits_TV.index_select(0, rows_T), None
    # R: the logits rows scored (the first T - 1 packed rows, or every compact row once)
    logits_RV = logits_TV[:-1] if rows_T is None else logits_TV
    if logits_RV.dtype != torch.float32:
        logits_RV = logits_RV.float()
    if temperature != 1.0:
        logits_RV = logits_RV / temperature
    if cut:
        logits_RV = truncate_logits(logits_RV, top_p=top_p, top_k=top_k, keep_R=tokens_T[1:])
    lse_R = torch.logsumexp(logits_RV, dim=-1)
    if rows_T is None:
        target_S = logits_RV.gather(-1, tokens_T[1:, None]).squeeze(-1)
        lse_S = lse_R
    else:
        rows_S = rows_T[:-1]
        target_S = logits_RV[rows_S, tokens_T[1:]]
        lse_S = lse_R.index_select(0, rows_S)
    keep_T = ~starts_T
    zero_1 = lse_S.new_zeros(1)
    logp_T = torch.where(keep_T, torch.cat([zero_1, target_S - lse_S]), 0.0)
    if not with_entropy:
        return logp_T, None
    # H = lse - sum_v p_v * z_v; the dot product runs as a batched matmul (no [R, V] product).
    p_RV = torch.softmax(logits_RV, dim=-1)
    if cut:  # cut entries: p = 0 and z = -inf; their product is 0
        logits_RV = logits_RV.nan_to_num(neginf=0.0)
    expected_R = torch.bmm(p_RV.unsqueeze(1), logits_RV.unsqueeze(2)).view(-1)
    entropy_R = (lse_R - expected_R).clamp_min(0.0)
    entropy_S = entropy_R if rows_T is None else entropy_R.index_select(0, rows_T[:-1])
    entropy_T = torch.where(keep_T, torch.cat([zero_1, entropy_S]), 0.0)
    return logp_T, entropy_T


def hf_state_dict(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The state dict (in-memory names) of the Hugging Face model saved in ``path``."""
    from transformers import AutoModelForCausalLM

    try:
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: transformers cannot load the saved model ({e}); was it written by "
            "HFPolicy.save?"
        ) from e
    return {n: t.detach() for n, t in model.state_dict().items()}


def enable_activation_checkpointing(model: Any) -> None:
    """Turn on transformers' non-reentrant gradient checkpointing of every decoder layer.

    transformers checkpoints a layer only while that layer is in training mode; the policy keeps
    the model in eval mode (dropout off), so only the layer objects themselves are flagged as
    training (their submodules, dropout included, stay in eval mode).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer

    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer):
            module.training = True
