"""``torch.compile`` of the policy's transformers model (``HFPolicy.Config.compile_model``).

Two scopes:

- ``"layers"`` (regional compilation): each repeated decoder block (the classes a transformers
  model lists in ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``) is compiled in place with
  ``nn.Module.compile``. The blocks share one compiled graph, so compiling costs one block's
  tracing instead of the whole model's, and the elementwise chains inside a block (RMSNorm, RoPE,
  SwiGLU and their backward) are fused; embedding, final norm and LM head stay eager.
- ``"model"``: the model's whole ``forward`` (one large graph; slower to compile).

Both use ``dynamic=True``: the packed token count changes every step and must not recompile.
Parameter names, ``state_dict`` and saving are unchanged (in-place compilation). :func:`warm_up`
runs one packed forward and backward on a dummy batch, so the compile happens when the policy
is built (start-up) rather than in its first train step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from rl_core.batching import pack_sequences
from rl_core.errors import ConfigError

__all__ = ["compile_model", "warm_up"]


def compile_model(model: Any, scope: Literal["layers", "model"]) -> list[str]:
    """Compile ``model`` in place at ``scope``; returns the names of the compiled modules
    (``["forward"]`` for the whole model). Raises :class:`ConfigError` when ``"layers"`` finds no
    repeated block."""
    if scope == "model":
        model.forward = torch.compile(model.forward, dynamic=True)
        return ["forward"]
    block_classes = set(getattr(model, "_no_split_modules", None) or ())
    blocks = [(n, m) for n, m in model.named_modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(
            f"policy.compile_scope: 'layers' found no repeated decoder block in "
            f"{type(model).__name__} (its _no_split_modules is {sorted(block_classes)}); set "
            "policy.compile_scope: model to compile the whole forward instead."
        )
    for _, module in blocks:
        module.compile(dynamic=True)
    return [n for n, _ in blocks]


def warm_up(
    forward_logprobs: Callable[[Any], torch.Tensor], vocab_size: int, max_positions: int | None
) -> float:
    """Compile now: ``forward_logprobs`` (the policy's packed train forward, a ``TrainBatch`` to
    log-probs ``[T]``) and a backward pass, on three short dummy sequences and, when the model
    has a ``max_positions`` (its ``max_position_embeddings``), once more on a packed row longer
    than that: the compiled graph of a short row is guarded to ``T <= max_positions`` packed
    tokens, and a longer row (many sequences packed) would recompile in the first train step.
    The caller clears the gradients. Returns the seconds it took."""
    gen = torch.Generator().manual_seed(0)
    batches = [[7, 5, 9]]
    if max_positions:
        n = max_positions // 16 + 1
        batches.append([17] * n)  # n * 17 > max_positions tokens, each sequence short
    t0 = time.perf_counter()
    for lengths in batches:
        seqs = [torch.randint(0, vocab_size, (n,), generator=gen) for n in lengths]
        forward_logprobs(pack_sequences(seqs)).sum().backward()
    return time.perf_counter() - t0
