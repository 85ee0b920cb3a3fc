"""GPU launch options of :class:`~rl_sglang.generator.SGLangGenerator`: the SGLang server
arguments built from its typed config fields, and the GPU budget check.

The typed fields map to SGLang 0.5.23 flags (read from its parser):

=========================  ==================================================================
``tp_size``                ``--tp-size`` (GPUs per server, tensor parallel)
``dp_size``                ``--dp-size`` (data-parallel replicas inside one server)
``mem_fraction_static``    ``--mem-fraction-static``
``disable_cuda_graph``     ``--disable-decode-cuda-graph --disable-prefill-cuda-graph``
                           (0.5.23 deprecated the single ``--disable-cuda-graph``)
``cuda_graph_max_bs``      ``--cuda-graph-max-bs-decode``
``enable_memory_saver``    ``--enable-memory-saver`` (needed by release/resume of memory)
``capture_routing``        ``--enable-return-routed-experts``
``enable_lora`` ...        ``--enable-lora --max-lora-rank --lora-target-modules``
                           (``--max-loras-per-batch``); on CPU ``--lora-backend torch_native``
``base_gpu_id``            ``--base-gpu-id``: server ``i`` of this node starts at
                           ``base_gpu_id + i * tp_size * dp_size``, so servers never share a GPU
=========================  ==================================================================

A server spread over several nodes, or servers on other nodes (addresses from Ray), are launched
there with :func:`rl_sglang.server.server_argv` and attached with ``server_urls`` (optionally
behind a router, ``use_router``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rl_core.errors import ConfigError

if TYPE_CHECKING:
    from rl_sglang.generator import SGLangGenerator

__all__ = ["TYPED_SERVER_ARGS", "check_gpu_budget", "typed_server_args", "visible_gpus"]

TYPED_SERVER_ARGS: Mapping[str, str] = {
    "tp_size": "tp_size",
    "tensor_parallel_size": "tp_size",
    "dp_size": "dp_size",
    "data_parallel_size": "dp_size",
    "mem_fraction_static": "mem_fraction_static",
    "disable_cuda_graph": "disable_cuda_graph",
    "disable_decode_cuda_graph": "disable_cuda_graph",
    "disable_prefill_cuda_graph": "disable_cuda_graph",
    "cuda_graph_max_bs_decode": "cuda_graph_max_bs",
    "enable_memory_saver": "enable_memory_saver",
    "enable_return_routed_experts": "capture_routing",
    "base_gpu_id": "base_gpu_id",
    "enable_lora": "enable_lora",
    "max_lora_rank": "max_lora_rank",
    "lora_target_modules": "lora_target_modules",
    "max_loras_per_batch": "max_loras_per_batch",
}
"""SGLang ``ServerArgs`` fields set from a typed config field (``server_args`` key -> field)."""


def typed_server_args(config: SGLangGenerator.Config, index: int) -> dict[str, Any]:
    """The SGLang server arguments of server ``index`` (on this node) from the typed fields;
    only what differs from SGLang's defaults."""
    out: dict[str, Any] = {}
    if config.tp_size > 1:
        out["tp_size"] = config.tp_size
    if config.dp_size > 1:
        out["dp_size"] = config.dp_size
    if config.mem_fraction_static is not None:
        out["mem_fraction_static"] = config.mem_fraction_static
    if config.disable_cuda_graph:
        out["disable_decode_cuda_graph"] = True
        out["disable_prefill_cuda_graph"] = True
    if config.cuda_graph_max_bs is not None:
        out["cuda_graph_max_bs_decode"] = config.cuda_graph_max_bs
    if config.enable_memory_saver:
        out["enable_memory_saver"] = True
    if config.capture_routing:
        out["enable_return_routed_experts"] = True
    if config.enable_lora:
        out["enable_lora"] = True
        out["max_lora_rank"] = config.max_lora_rank
        out["lora_target_modules"] = list(config.lora_target_modules)
        if config.max_loras_per_batch is not None:
            out["max_loras_per_batch"] = config.max_loras_per_batch
    if config.device == "cuda":
        first = config.base_gpu_id + index * config.tp_size * config.dp_size
        if first:
            out["base_gpu_id"] = first
    return out


def visible_gpus(env: Mapping[str, str] | None = None) -> int | None:
    """GPUs this process may use: the length of ``CUDA_VISIBLE_DEVICES`` when set, else
    ``torch.cuda.device_count()`` when CUDA is available; ``None`` when unknown."""
    env = os.environ if env is None else env
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is not None:
        return len([d for d in raw.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency of rl-core
        return None
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def check_gpu_budget(config: SGLangGenerator.Config, visible: int | None) -> None:
    """Refuse launching more GPU servers than this node has visible GPUs (when known)."""
    if config.device != "cuda" or visible is None or config.server_urls:
        return
    need = config.base_gpu_id + config.num_servers * config.tp_size * config.dp_size
    if need > visible:
        raise ConfigError(
            f"SGLangGenerator.Config: base_gpu_id ({config.base_gpu_id}) + num_servers "
            f"({config.num_servers}) x tp_size ({config.tp_size}) x dp_size ({config.dp_size}) "
            f"= {need} GPUs, but {visible} are visible (CUDA_VISIBLE_DEVICES / "
            "torch.cuda.device_count()); lower num_servers, tp_size or dp_size, or launch the "
            "other servers on other nodes and attach them with server_urls."
        )
