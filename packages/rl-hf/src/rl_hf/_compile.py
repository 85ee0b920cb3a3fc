"""``torch.compile`` of the policy's transformers model (``HFPolicy.Config.compile_model``).

Two scopes:

- ``"layers"`` (regional compilation): each repeated decoder block (the classes a transformers
  model lists in ``_no_split_modules``, e.g. ``Qwen2DecoderLayer``) is compiled in place with
  ``nn.Module.compile``. The blocks share one compiled graph, so compiling costs one block's
  tracing instead of the whole model's, and the elementwise chains inside a block (RMSNorm, RoPE,
  SwiGLU and their backward) are fused; embedding, final norm and LM head stay eager.
- ``"model"``: the model's whole ``forward`` (one large graph; slower to compile).

Both use ``dynamic=True``: the packed token count changes every step and must not recompile.
Python floats (RMSNorm's epsilon, attention's scale) are constants of the model: the compiled
modules are called under :func:`compiled_call`, which traces them as constants. Traced as
symbols (dynamo's default), they could not all be turned into tensors and dynamo restarted the
whole trace of the first compile: 2-4 s of every start-up on 2 CPU cores, cache warm.
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

__all__ = ["compile_model", "compiled_call", "warm_up"]


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


def compiled_call(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()`` (a forward through the modules :func:`compile_model` compiled) with dynamo
    specializing Python floats (``specialize_float``): every compile and every call of those
    modules goes through here, so their floats are constants in the graph and in its guards."""
    import torch._dynamo

    with torch._dynamo.config.patch(specialize_float=True):
        return run()


LONG_ROW = (257, 17)
"""Sequences x tokens of the warm-up's long packed row (4369 tokens). Measured (torch 2.13,
qwen2 layers, ``dynamic=True``): after a compile on short rows only, a packed row of 8000 tokens
compiled again (rows up to 6400 did not); a second warm-up compile on a row of about 4400 tokens
gives the graph every later row reused (rows of 2816 to 16 000 tokens, up to 512 sequences,
``max_position_embeddings`` 512 to 32 768), one of 2200 tokens does not. The row also exceeds
``max_position_embeddings`` up to 4352, which the warm-up covered before (a small-context
model's rows longer than it recompiled). It no longer grows with ``max_position_embeddings``:
at 32k that was a 35k-token forward and backward at start-up."""


def warm_up(forward_logprobs: Callable[[Any], torch.Tensor], vocab_size: int) -> float:
    """Compile now: ``forward_logprobs`` (the policy's packed train forward, a ``TrainBatch`` to
    log-probs ``[T]``) and a backward pass, on three short dummy sequences and once more on a
    long packed row of many short sequences (:data:`LONG_ROW`), so the first train steps do
    not recompile. The caller clears the gradients. Returns the seconds it took."""
    gen = torch.Generator().manual_seed(0)
    n, length = LONG_ROW
    batches = [[7, 5, 9], [length] * n]
    t0 = time.perf_counter()
    for lengths in batches:
        seqs = [torch.randint(0, vocab_size, (k,), generator=gen) for k in lengths]
        forward_logprobs(pack_sequences(seqs)).sum().backward()
    return time.perf_counter() - t0
