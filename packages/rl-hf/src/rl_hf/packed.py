"""Packed per-token log-probs from a plain transformers causal LM, for a hand-written RL loop.

:func:`packed_logprobs` runs ``model`` once on a padding-free row of concatenated sequences, with
attention confined to each sequence (the packed attention ``HFPolicy`` trains with, see
:mod:`rl_hf._packed_attention`), and returns the log-prob of every token under the position
before it, in the ``[T]`` layout of :class:`~rl_core.types.TrainBatch` that the losses of
:mod:`rl_core.algorithms` take::

    from transformers import AutoModelForCausalLM
    from rl_core.batching import pack_rollouts
    from rl_hf import packed_logprobs

    model = AutoModelForCausalLM.from_pretrained(path)     # any attention implementation
    batch = pack_rollouts(rollouts, advantages=adv)        # or a list of token-id sequences
    with torch.no_grad():
        batch.old_logprobs = packed_logprobs(model, batch).logprobs
    out = packed_logprobs(model, batch)                     # with gradients
    loss = PolicyLoss(PolicyLoss.Config())(out.logprobs, batch).loss

The result equals the model run on each sequence alone (to float rounding). It needs only
``transformers`` and ``torch`` (``pip install rlpost-hf``); the model is not modified (its
attention implementation is switched for the call and restored).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from rl_core.batching import pack_sequences
from rl_core.errors import ConfigError
from rl_core.types import LogProbOutput, TrainBatch

__all__ = ["packed_logprobs"]


def _attn_implementation(model: Any) -> str:
    """``model``'s attention implementation; ConfigError when it is no transformers model."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current is None or not hasattr(model, "set_attn_implementation"):
        raise ConfigError(
            f"packed_logprobs: {type(model).__name__} is not a transformers PreTrainedModel with a "
            "config (load it with AutoModelForCausalLM.from_pretrained or from_config)"
        )
    return str(current)


@contextlib.contextmanager
def _packed_attention(model: Any) -> Iterator[None]:
    """``model`` runs on the packed attention inside the block, its own one after."""
    from rl_hf._packed_attention import ATTN_NAME, register_packed_attention

    current = _attn_implementation(model)
    register_packed_attention()
    if current == ATTN_NAME:
        yield
        return
    model.set_attn_implementation(ATTN_NAME)
    if model.config._attn_implementation != ATTN_NAME:
        model.set_attn_implementation(current)
        raise ConfigError(
            f"packed_logprobs: {type(model).__name__} cannot switch its attention implementation "
            "(it does not use transformers' AttentionInterface); score each sequence alone instead"
        )
    try:
        yield
    finally:
        model.set_attn_implementation(current)


def packed_logprobs(
    model: Any,
    sequences: TrainBatch | Sequence[Sequence[int]] | Sequence[torch.Tensor],
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> LogProbOutput:
    """Per-token log-probs ``[T]`` of packed sequences under a transformers causal LM.

    Args:
        model: a ``transformers`` causal LM (``AutoModelForCausalLM``), on any device; its
            parameters' gradients flow through the result unless called under
            ``torch.no_grad()``.
        sequences: a :class:`~rl_core.types.TrainBatch` (its ``tokens`` / ``cu_seqlens``, e.g.
            from :func:`rl_core.batching.pack_rollouts`) or token-id sequences (packed in order
            with :func:`rl_core.batching.pack_sequences`).
        temperature: logits are divided by it first (use the sampler's temperature).
        with_entropy: also return the entropy ``[T]`` of each predictive distribution.

    Returns:
        :class:`~rl_core.types.LogProbOutput`: ``logprobs`` ``[T]`` float32 on the model's
        device, ``logprobs[t] = log p(tokens[t] | earlier tokens of its sequence)``, 0 at each
        sequence's first token; ``entropy`` likewise (or ``None``).

    Raises:
        ConfigError: ``temperature`` is not positive; the model is not a transformers model
            whose attention can be switched; or its attention is one the packed attention does
            not reproduce (logit soft-capping, attention sinks): score each sequence alone.
    """
    from rl_hf._hf import token_logprobs
    from rl_hf._packed_attention import check_config, check_model, packed_inputs

    if not temperature > 0:
        raise ConfigError(f"packed_logprobs: temperature must be > 0, got {temperature!r}")
    _attn_implementation(model)
    batch = sequences if isinstance(sequences, TrainBatch) else pack_sequences(sequences)
    device = next(model.parameters()).device
    tokens_T = batch.tokens.to(device)
    if tokens_T.shape[0] == 0:
        logp_T, ent_T = token_logprobs(
            tokens_T.new_zeros(0, 1).float(), tokens_T, tokens_T.bool(), with_entropy=with_entropy
        )
        return LogProbOutput(logprobs=logp_T, entropy=ent_T)
    check_config(model.config)
    check_model(model)
    position_ids_T, kwargs, _ = packed_inputs(batch, device, sdpa=True, share_prefix=False)
    with _packed_attention(model):
        logits_TV = model(**kwargs).logits[0]
    logp_T, ent_T = token_logprobs(
        logits_TV,
        tokens_T,
        position_ids_T == 0,
        temperature=temperature,
        with_entropy=with_entropy,
    )
    return LogProbOutput(logprobs=logp_T, entropy=ent_T)
