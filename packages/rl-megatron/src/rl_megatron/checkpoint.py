"""Megatron distributed checkpoints (``torch_dist``) of a model and its optimizer.

:class:`~rl_megatron.policy.MegatronPolicy` saves its weights twice: as a Hugging Face directory
(what generators, ``HFPolicy`` and ``load(with_optimizer=False)`` read) and, with the optimizer
state, as a megatron-core distributed checkpoint in :data:`DIST_DIR`. This module writes and
reads the second one::

    save_distributed(policy.module, policy.optimizer, "ckpt/megatron_dist",
                     distributed_optimizer=True)
    # ... later, possibly at another TP/PP/DP layout:
    load_distributed(policy.module, policy.optimizer, "ckpt/megatron_dist",
                     distributed_optimizer=True)

Each tensor is stored under its *global* key and shape (``model.decoder.layers.self_attention.
linear_qkv.weight``, ``optimizer.state.exp_avg.<same key>``, ...), so a checkpoint loads at any
tensor-, pipeline- or data-parallel layout: every rank reads the slices it owns. The vocabulary
padding (which depends on ``tp_size``) is trimmed or zero-filled on load (megatron-core's
``allow_shape_mismatch`` for the embedding and output layer, optimizer state included).

Formats chosen, on megatron-core 0.16.1:

* plain optimizer: its ``sharded_state_dict`` (Adam moments per parameter, step shared);
* distributed optimizer: sharding type ``fully_reshardable`` (the state is gathered over the
  data-parallel group at save time into per-parameter tensors of the model's shape, and each
  rank flattens and slices what it owns at load time). ``fully_sharded_model_space`` raises
  ``ShardedTensor.flattened_range is not supported`` in 0.16.1, and ``dp_reshardable`` only
  reshards across data-parallel ranks. megatron-core 0.16.1 saves this format shifted for every
  parameter in a DDP bucket that follows a padded one (tied embeddings at PP>1 always are);
  :func:`_dp_zero_state_keeps_bucket_padding` corrects that, and every save first checks, on
  every rank, that the state it is about to write slices back to the live state bitwise
  (:class:`~rl_core.errors.CheckpointError` otherwise, before anything is written).

A checkpoint of one optimizer kind does not load into the other (the state keys differ); the
policy refuses that with a :class:`~rl_core.errors.CheckpointError` before reading anything.

Writing is synchronous and in-process (``_InProcessTorchDistSave``): megatron-core's default
``torch_dist`` writer forks one writer process per thread and needs ``psutil`` and a spawned
``multiprocessing`` manager, neither of which this package needs otherwise.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError

__all__ = ["DISTOPT_SHARDING", "DIST_DIR", "load_distributed", "save_distributed"]

DIST_DIR = "megatron_dist"
"""Sub-directory of a policy checkpoint holding the ``torch_dist`` model + optimizer state."""
DISTOPT_SHARDING = "fully_reshardable"
"""Megatron's ``distrib_optim_sharding_type`` used for the distributed optimizer (reshards
across TP, PP and DP)."""


def _in_process_save_strategy() -> Any:
    """megatron-core's ``torch_dist`` save strategy, writing with PyTorch's own
    ``FileSystemWriter`` in this process (one file per rank, no forked writers)."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner,
        TorchDistSaveShardedStrategy,
        _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict,
    )

    class _InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        """``torch_dist`` format (read by megatron-core's default loader), written in-process."""

        def save(self, sharded_state_dict: Any, checkpoint_dir: str | Path) -> None:
            """Write this rank's main replicas and, on rank 0, the global metadata."""
            by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(
                sharded_state_dict, self.keep_only_main_replica
            )
            dcp.save(
                mcore_to_pyt_state_dict(by_key, False),
                storage_writer=dcp.FileSystemWriter(str(checkpoint_dir), thread_count=1),
                planner=MCoreSavePlanner(
                    dedup_replicated_tensors=not self.keep_only_main_replica,
                    flatten_state_dict=False,
                ),
            )

    return _InProcessTorchDistSave("torch_dist", 1)


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _metadata(distributed_optimizer: bool) -> dict[str, Any]:
    meta: dict[str, Any] = {"chained_optim_avoid_prefix": True}
    if distributed_optimizer:
        meta["distrib_optim_sharding_type"] = DISTOPT_SHARDING
    return meta


def _sharded_state_dict(
    module: Any,
    optimizer: Any,
    *,
    distributed_optimizer: bool,
    is_loading: bool,
    keys: Callable[[str], bool] | None = None,
) -> dict[str, Any]:
    model_sd = module.sharded_state_dict()
    if keys is not None:  # e.g. LoRA: the adapters only (the optimizer holds nothing else)
        model_sd = {k: v for k, v in model_sd.items() if keys(k)}
    if not distributed_optimizer:
        optim_sd = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_metadata(False)
        )
        return {"model": model_sd, "optimizer": optim_sd}
    with _dp_zero_state_keeps_bucket_padding(optimizer):
        optim_sd = optimizer.sharded_state_dict(
            model_sd, is_loading=is_loading, metadata=_metadata(True)
        )
    if not is_loading:
        inner = _inner_optimizers(optimizer)
        parts = [optim_sd] if len(inner) == 1 else [optim_sd[i] for i in range(len(inner))]
        problems = [_saved_distopt_state_problem(o, p) for o, p in zip(inner, parts, strict=True)]
        _raise_if_any_rank([p for p in problems if p])
    return {"model": model_sd, "optimizer": optim_sd}


def _raise_if_any_rank(problems: list[str]) -> None:
    """Raise on every rank if any rank found a problem (so no rank enters the collective write
    alone)."""
    bad = torch.tensor([1 if problems else 0], dtype=torch.int64)
    torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    if int(bad.item()):
        detail = problems[0] if problems else "on another rank"
        raise CheckpointError(
            f"distributed optimizer: the state gathered for the checkpoint differs from the live "
            f"state ({detail}), a megatron-core layout mismatch; refusing to write a checkpoint "
            "that would resume wrong. Set policy.use_distributed_optimizer=False to checkpoint "
            "this model."
        )


@contextlib.contextmanager
def _dp_zero_state_keeps_bucket_padding(optimizer: Any) -> Iterator[None]:
    """Work around a megatron-core 0.16.1 bug in the ``fully_reshardable`` optimizer format.

    ``DistributedOptimizer.get_parameter_state_dp_zero`` concatenates each DDP bucket's
    *unpadded* elements (dropping the padding at the end of every bucket), but
    ``sharded_param_state_fully_reshardable`` slices the result with the *padded* buffer offsets
    of ``param_index_map``. Every parameter in bucket ``k > 0`` is then read shifted by the
    padding of buckets ``0..k-1``, and its tail is zero-filled (megatron logs "param range exceeds
    unpadded buffer by N elements"). Tied embeddings at PP>1 always get a bucket of their own
    (``shared_embedding``), and a ``bucket_size`` splits any buffer into several buckets.

    While this context is open, each inner distributed optimizer's ``get_parameter_state_dp_zero``
    (an instance attribute, removed on exit; the class is untouched) puts the padding back, so the
    world tensors are indexed like ``param_index_map``. The load side
    (``load_parameter_state_from_fully_reshardable``) indexes per parameter and is not affected.
    """
    patched = []
    for opt in _inner_optimizers(optimizer):
        original = getattr(opt, "get_parameter_state_dp_zero", None)
        if original is None:
            continue
        opt.get_parameter_state_dp_zero = functools.partial(_padded_dp_zero_state, opt, original)
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt.get_parameter_state_dp_zero


def _padded_dp_zero_state(opt: Any, original: Callable[..., Any], **kwargs: Any) -> Any:
    """``original(**kwargs)`` (megatron's ``get_parameter_state_dp_zero``) with every world
    tensor laid out like the DDP buffer: bucket ``b`` at ``b.offset``, zeros in the padding."""
    state = original(**kwargs)
    if state is None:  # a DP rank > 0 in megatron's memory-efficient mode
        return None
    for gbuf_idx, buffer in enumerate(opt.buffers):
        for dtype, world in state[gbuf_idx].items():
            state[gbuf_idx][dtype] = {
                key: _with_bucket_padding(t, buffer) if isinstance(t, torch.Tensor) else t
                for key, t in world.items()
            }
    return state


def _with_bucket_padding(world_N: torch.Tensor, buffer: Any) -> torch.Tensor:
    """Re-insert the padding at the end of each of ``buffer``'s buckets into ``world_N``, the
    concatenation of the buckets' unpadded elements."""
    if world_N.numel() == buffer.numel:  # nothing dropped (no padding, or a fixed megatron-core)
        return world_N
    unpadded = sum(b.numel_unpadded for b in buffer.buckets)
    if world_N.numel() != unpadded:
        raise CheckpointError(
            f"distributed optimizer state of {world_N.numel()} elements matches neither the DDP "
            f"buffer ({buffer.numel}) nor its unpadded buckets ({unpadded}); this megatron-core "
            "version is not supported by rl_megatron.checkpoint. Use "
            "policy.use_distributed_optimizer=False, or pin megatron-core 0.16.1."
        )
    padded_N = world_N.new_zeros(buffer.numel)
    src = 0
    for bucket in buffer.buckets:
        n = bucket.numel_unpadded
        padded_N[bucket.offset : bucket.offset + n] = world_N[src : src + n]
        src += n
    return padded_N


def _saved_distopt_state_problem(opt: Any, optim_part: dict[str, Any]) -> str | None:
    """What is wrong with the distributed-optimizer state about to be written, or ``None``.

    For every parameter range this rank owns, the saved per-parameter tensors (fp32 main weight,
    ``exp_avg``, ``exp_avg_sq``) are flattened and sliced exactly as
    ``load_parameter_state_from_fully_reshardable`` will slice them, and must equal the live
    state bitwise; so a checkpoint that would load back different values is never written.
    """
    param_state = optim_part.get("param_state")
    if param_state is None:  # nothing built on this rank (megatron's memory-efficient mode)
        return None
    param_idx = -1
    for gbuf_idx, gbuf_range_maps in enumerate(opt.gbuf_ranges):
        for per_bucket in gbuf_range_maps.values():
            owned = collections.ChainMap(*(m["param_map"] for m in per_bucket))
            for model_param in opt.buffers[gbuf_idx].param_index_map:
                param_idx += 1  # the order of megatron's save and load
                if model_param not in owned:
                    continue
                rng = owned[model_param]["param"]
                live = opt._get_main_param_and_optimizer_states(model_param)
                for key, sharded in param_state[param_idx].items():
                    saved_N = sharded.data.flatten()[rng.start : rng.end]
                    live_N = live[key].detach().reshape(-1).to(saved_N.dtype).cpu()
                    if not torch.equal(saved_N, live_N):
                        return f"{sharded.key!r}, elements [{rng.start}, {rng.end})"
    return None


def save_distributed(
    module: Any,
    optimizer: Any,
    directory: str | Path,
    *,
    distributed_optimizer: bool,
    keys: Callable[[str], bool] | None = None,
) -> None:
    """Write ``module``'s weights and ``optimizer``'s state as a ``torch_dist`` checkpoint.

    Collective over all ranks. ``directory`` must be empty or absent; rank 0 creates it.
    ``distributed_optimizer`` says whether ``optimizer`` is Megatron's distributed optimizer;
    ``keys`` (a predicate on the model's state-dict keys) saves only those weights (every
    parameter the optimizer holds must be among them: LoRA's adapters).

    Raises:
        CheckpointError: (every rank, before any tensor is written) the distributed optimizer's
            state as gathered for the checkpoint does not match the live state.
    """
    out = Path(directory)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    from megatron.core import dist_checkpointing

    _ensure_optimizer_state(optimizer)
    state = _sharded_state_dict(
        module, optimizer, distributed_optimizer=distributed_optimizer, is_loading=False, keys=keys
    )
    dist_checkpointing.save(state, str(out), sharded_strategy=_in_process_save_strategy())


def _ensure_optimizer_state(optimizer: Any) -> None:
    """Give every inner optimizer that has not stepped yet the state of a fresh Adam.

    A checkpoint must hold Adam moments for every parameter at every save (so a later load at
    any layout finds its keys), and megatron-core's distributed optimizer reads torch Adam's per-parameter
    ``step`` (and asserts there is one). Zero moments at step
    0 are exactly what torch Adam creates on its first step, so this changes no result.
    """
    for opt in _inner_optimizers(optimizer):
        inner = opt.optimizer
        if len(inner.state) > 0 or opt.init_state_fn is None:
            continue
        opt.init_state_fn(inner, opt.config)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):  # step lives in state
            for state in inner.state.values():
                state["step"] = torch.zeros((), dtype=torch.float32)


def _restore_zero_step(opt: Any, state: dict[str, Any]) -> None:
    """Put back the torch Adam ``step`` of plain-optimizer state saved before the first step.

    megatron-core stores the shared step as ``common_step`` only when it is non-zero (``if
    step:``), so state saved at step 0 has moments but no step, which torch Adam's
    ``load_state_dict`` refuses (``KeyError: 'step'``).
    """
    per_param = state.get("state") or {}
    if not isinstance(opt.optimizer, (torch.optim.Adam, torch.optim.AdamW)) or not per_param:
        return
    if "common_step" not in per_param and not any(
        isinstance(v, dict) and "step" in v for v in per_param.values()
    ):
        per_param["common_step"] = torch.zeros((), dtype=torch.float32)


def _load_distopt(opt: Any, state: dict[str, Any]) -> None:
    """``DistributedOptimizer.load_state_dict`` for torch Adam (no TE/Apex) on 0.16.1.

    Two megatron-core defects are worked around, neither changing what is loaded:

    * ``load_state_dict`` gives every parameter's state the *same* ``step`` tensor, which torch
      Adam then increments in place once per parameter; each parameter gets its own copy here.
    * ``load_parameter_state_from_fully_reshardable`` copies every key of the live state, also
      ``step``, which the checkpoint's per-parameter tensors do not have (``KeyError: 'step'``);
      ``step`` is set aside while the tensors are copied.
    """
    state = dict(state)
    param_state = state.pop("param_state")
    sharding = state.pop("param_state_sharding_type")
    if sharding != DISTOPT_SHARDING:
        raise CheckpointError(
            f"optimizer state has sharding type {sharding!r}; this version reads "
            f"{DISTOPT_SHARDING!r} only. Re-save the checkpoint with this version."
        )
    opt.load_state_dict(state)  # param groups and step, no parameter state
    inner = opt.optimizer.state
    steps = {p: s.pop("step") for p, s in inner.items() if "step" in s}
    try:
        opt.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for p, step in steps.items():
            inner[p]["step"] = step.detach().clone()


def load_distributed(
    module: Any,
    optimizer: Any,
    directory: str | Path,
    *,
    distributed_optimizer: bool,
    keys: Callable[[str], bool] | None = None,
) -> None:
    """Restore :func:`save_distributed`'s output into ``module`` and ``optimizer`` (``keys``:
    as saved, only those weights are read).

    Collective over all ranks; works at any TP/PP/DP layout of the same model. Weights are
    copied into the live parameters (``module`` keeps its DDP buffers), then the optimizer state
    (fp32 main weights included) is loaded; nothing is re-derived from the model weights after.

    Raises:
        CheckpointError: the directory is not a ``torch_dist`` checkpoint, or its tensors do not
            fit this model (a different architecture, or a different optimizer kind).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    src = Path(directory)
    if not (src / "metadata.json").is_file():
        raise CheckpointError(
            f"{src}: no metadata.json; not a megatron-core distributed checkpoint (write one "
            "with MegatronPolicy.save(..., with_optimizer=True))."
        )
    _ensure_optimizer_state(optimizer)
    state = _sharded_state_dict(
        module, optimizer, distributed_optimizer=distributed_optimizer, is_loading=True, keys=keys
    )
    try:
        loaded = dist_checkpointing.load(state, str(src))
    except (CheckpointingException, KeyError) as exc:
        raise CheckpointError(
            f"{src}: megatron-core cannot read this checkpoint into the model ({exc}); was it "
            "saved from a different model, or with a different use_distributed_optimizer?"
        ) from exc
    missing, _ = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and (keys is None or keys(k))]
    if missing:
        raise CheckpointError(
            f"{src}: the checkpoint has no values for {missing[:3]}; was it saved from a "
            "different model?"
        )
    optim_state = loaded["optimizer"]
    inner = _inner_optimizers(optimizer)
    parts = [optim_state] if len(inner) == 1 else [optim_state[i] for i in range(len(inner))]
    for opt, part in zip(inner, parts, strict=True):
        if distributed_optimizer:
            _load_distopt(opt, part)
        else:
            _restore_zero_step(opt, part)
            opt.load_state_dict(part)
