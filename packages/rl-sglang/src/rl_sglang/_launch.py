"""Launching the servers of :class:`~rl_sglang.generator.SGLangGenerator` on this node: the SGLang
server arguments built from its typed config fields, the GPU budget check, and
:class:`ServerLauncher`, which starts one server (or the router) with them.

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
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from rl_core.errors import ConfigError
from rl_sglang.server import ManagedProcess, launch_router, launch_server

__all__ = [
    "TYPED_SERVER_ARGS",
    "LaunchOptions",
    "ServerLauncher",
    "check_gpu_budget",
    "typed_server_args",
    "visible_gpus",
]

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


class LaunchOptions(Protocol):
    """The launch settings of ``SGLangGenerator.Config`` read here (the config is one)."""

    @property
    def model_path(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def host(self) -> str: ...
    @property
    def initial_version(self) -> int: ...
    @property
    def router_policy(self) -> str: ...
    @property
    def server_urls(self) -> tuple[str, ...]: ...
    @property
    def num_servers(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def dp_size(self) -> int: ...
    @property
    def base_gpu_id(self) -> int: ...
    @property
    def mem_fraction_static(self) -> float | None: ...
    @property
    def disable_cuda_graph(self) -> bool: ...
    @property
    def cuda_graph_max_bs(self) -> int | None: ...
    @property
    def enable_memory_saver(self) -> bool: ...
    @property
    def capture_routing(self) -> bool: ...
    @property
    def enable_lora(self) -> bool: ...
    @property
    def max_lora_rank(self) -> int | None: ...
    @property
    def lora_target_modules(self) -> tuple[str, ...]: ...
    @property
    def max_loras_per_batch(self) -> int | None: ...


def typed_server_args(config: LaunchOptions, index: int) -> dict[str, Any]:
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


def check_gpu_budget(config: LaunchOptions, visible: int | None) -> None:
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


class ServerLauncher:
    """Starts the generator's SGLang servers (and its router) on this node."""

    def __init__(
        self,
        options: LaunchOptions,
        *,
        python: str,
        server_args: Mapping[str, Any],
        log_dir: Path,
    ) -> None:
        """Launch with ``options`` (the generator's config) from ``python``; ``server_args``:
        the validated arguments shared by every server; logs under ``log_dir``."""
        self.options = options
        """The launch settings."""
        self.python = python
        """Interpreter the servers and the router run in."""
        self.server_args = dict(server_args)
        """Arguments of every server (each adds its own :func:`typed_server_args`)."""
        self.log_dir = log_dir
        """Directory of the server and router logs (and their working directory)."""

    def server(self, port: int, index: int) -> ManagedProcess:
        """Start server ``index`` on ``port`` (not waited for)."""
        o = self.options
        return launch_server(
            model_path=o.model_path,
            python=self.python,
            port=port,
            server_args={**self.server_args, **typed_server_args(o, index)},
            device=o.device,
            log_dir=self.log_dir,
            host=o.host,
            name=f"sglang-{index}",
            weight_version=o.initial_version,
        )

    def router(self, worker_urls: Sequence[str], port: int) -> ManagedProcess:
        """Start the SGLang router in front of ``worker_urls`` on ``port`` (not waited for)."""
        o = self.options
        return launch_router(
            worker_urls=list(worker_urls),
            python=self.python,
            port=port,
            log_dir=self.log_dir,
            host=o.host,
            policy=o.router_policy,
        )
