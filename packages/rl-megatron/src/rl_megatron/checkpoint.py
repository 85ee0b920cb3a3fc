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
  reshards across data-parallel ranks.

A checkpoint of one optimizer kind does not load into the other (the state keys differ); the
policy refuses that with a :class:`~rl_core.errors.CheckpointError` before reading anything.

Writing is synchronous and in-process (:class:`_InProcessTorchDistSave`): megatron-core's
default ``torch_dist`` writer forks one writer process per thread and needs ``psutil`` and a
spawned ``multiprocessing`` manager, neither of which this package needs otherwise.
"""

from __future__ import annotations

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
    module: Any, optimizer: Any, *, distributed_optimizer: bool, is_loading: bool
) -> dict[str, Any]:
    model_sd = module.sharded_state_dict()
    optim_sd = optimizer.sharded_state_dict(
        model_sd, is_loading=is_loading, metadata=_metadata(distributed_optimizer)
    )
    return {"model": model_sd, "optimizer": optim_sd}


def save_distributed(
    module: Any, optimizer: Any, directory: str | Path, *, distributed_optimizer: bool
) -> None:
    """Write ``module``'s weights and ``optimizer``'s state as a ``torch_dist`` checkpoint.

    Collective over all ranks. ``directory`` must be empty or absent; rank 0 creates it.
    ``distributed_optimizer`` says whether ``optimizer`` is Megatron's distributed optimizer.
    """
    out = Path(directory)
    if torch.distributed.get_rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    from megatron.core import dist_checkpointing

    _ensure_optimizer_state(optimizer)
    state = _sharded_state_dict(
        module, optimizer, distributed_optimizer=distributed_optimizer, is_loading=False
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
    module: Any, optimizer: Any, directory: str | Path, *, distributed_optimizer: bool
) -> None:
    """Restore :func:`save_distributed`'s output into ``module`` and ``optimizer``.

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
        module, optimizer, distributed_optimizer=distributed_optimizer, is_loading=True
    )
    try:
        loaded = dist_checkpointing.load(state, str(src))
    except (CheckpointingException, KeyError) as exc:
        raise CheckpointError(
            f"{src}: megatron-core cannot read this checkpoint into the model ({exc}); was it "
            "saved from a different model, or with a different use_distributed_optimizer?"
        ) from exc
    missing, _ = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
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
