"""Process-group and Megatron parallel-state set-up for :class:`~rl_megatron.policy.MegatronPolicy`.

Every rank of the job runs the same code. Launch ranks like ``torchrun`` does: each process has
``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (and ``LOCAL_RANK``) in its
environment, or has called ``torch.distributed.init_process_group`` itself. A single process
with none of these runs as a world of one (an in-process store, no network).

The backend is NCCL when CUDA is available, gloo otherwise; without CUDA the CPU redirections of
:mod:`rl_megatron._cpu_support` are switched on here (and only here).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from rl_core.errors import ConfigError

__all__ = ["ParallelLayout", "current_device", "init_parallel"]


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    """The parallel layout this process belongs to."""

    tp_size: int
    """Tensor-parallel size."""
    pp_size: int
    """Pipeline-parallel size."""
    dp_size: int
    """Data-parallel size (world size / (tp * pp))."""
    rank: int
    """Global rank."""
    tp_rank: int
    """Rank inside the tensor-parallel group."""
    pp_rank: int
    """Rank inside the pipeline-parallel group."""
    dp_rank: int
    """Rank inside the data-parallel group (which shard of the data this rank trains on)."""
    ep_size: int = 1
    """Expert-parallel size (mixture-of-experts layers; 1 for a dense model)."""
    ep_rank: int = 0
    """Rank inside the expert-parallel group (which experts this rank holds)."""
    etp_size: int = 1
    """Expert tensor-parallel size (how each expert's weights are split)."""
    etp_rank: int = 0
    """Rank inside the expert tensor-parallel group."""


def _ensure_process_group() -> None:
    dist = torch.distributed
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
        return
    # A world of one: an in-process store, no port to pick and no network.
    dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def init_parallel(
    tp_size: int,
    pp_size: int,
    dp_size: int | None,
    seed: int,
    *,
    ep_size: int = 1,
    etp_size: int | None = None,
) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and Megatron's parallel state for this layout.

    ``ep_size`` / ``etp_size`` (default: ``tp_size``) lay out the experts of a
    mixture-of-experts model: ``etp_size * ep_size * pp_size`` must divide the world size (the
    rest is expert data parallelism).

    An existing Megatron parallel state of the same sizes is reused; one of different sizes is
    destroyed and rebuilt (every rank must do the same).

    Raises:
        ConfigError: the sizes do not multiply to the world size.
    """
    if not torch.cuda.is_available():
        from rl_megatron._cpu_support import enable_cpu_support

        enable_cpu_support()
    _ensure_process_group()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    world = torch.distributed.get_world_size()
    if tp_size < 1 or pp_size < 1 or world % (tp_size * pp_size):
        raise ConfigError(
            f"policy.tp_size/pp_size: {tp_size} x {pp_size} does not divide the world size "
            f"{world}; launch tp_size * pp_size * dp_size processes."
        )
    derived_dp = world // (tp_size * pp_size)
    if dp_size not in (None, 0, derived_dp):
        raise ConfigError(
            f"policy.dp_size: {dp_size}, but the world of {world} processes with tp_size="
            f"{tp_size} and pp_size={pp_size} gives {derived_dp}; set dp_size to {derived_dp} "
            "(or 0 to derive it) or launch a matching number of processes."
        )
    etp = etp_size or tp_size
    if ep_size < 1 or etp < 1 or world % (etp * ep_size * pp_size):
        raise ConfigError(
            f"policy.expert_model_parallel_size/expert_tensor_parallel_size: {ep_size} x {etp} "
            f"x pp_size {pp_size} does not divide the world size {world}; pick sizes whose "
            "product divides the number of processes."
        )
    if ps.model_parallel_is_initialized():
        same = (
            ps.get_tensor_model_parallel_world_size() == tp_size
            and ps.get_pipeline_model_parallel_world_size() == pp_size
            and ps.get_expert_model_parallel_world_size() == ep_size
            and ps.get_expert_tensor_parallel_world_size() == etp
        )
        if not same:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp_size,
            pipeline_model_parallel_size=pp_size,
            expert_model_parallel_size=ep_size,
            expert_tensor_parallel_size=etp,
        )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return ParallelLayout(
        tp_size=tp_size,
        pp_size=pp_size,
        dp_size=derived_dp,
        rank=torch.distributed.get_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_size=ep_size,
        ep_rank=ps.get_expert_model_parallel_rank(),
        etp_size=etp,
        etp_rank=ps.get_expert_tensor_parallel_rank(),
    )


def current_device() -> torch.device:
    """This rank's compute device: the current CUDA device, or the CPU without CUDA."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
