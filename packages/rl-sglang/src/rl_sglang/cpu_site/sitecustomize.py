"""CPU patches for SGLang 0.5.23, loaded by every process of a CPU SGLang server.

:func:`rl_sglang._cpu_support.cpu_environment` puts this directory first on the server's
``PYTHONPATH``, so Python imports this file at start-up (``site`` imports ``sitecustomize``) in the
launcher and in every scheduler/tokenizer/detokenizer process it spawns. Nothing is imported
here: each patch is applied right after SGLang itself imports the module it patches (a
``sys.meta_path`` finder wraps that module's loader), so a process that never imports SGLang pays
nothing.

Patches (each names the SGLang code it replaces):

- ``sglang/srt/mem_cache/pool_host/common.py``: ``ALLOC_MEMORY_FUNCS["cpu"]``. The host buffer of
  ``--enable-return-routed-experts`` (``state_capturer/base.py: BaseHostCache``) is allocated
  with ``pin_memory=True`` through ``alloc_with_host_register``, which calls
  ``torch.cuda.cudart()`` (``_cuda_host_register``) and kills a CPU server with "Found no NVIDIA
  driver on your system". On CPU there is nothing to pin: allocate the plain tensor.
- ``torch`` (in the server process only): pinned host memory (``pin_memory=True`` on the tensor
  factories, ``Tensor.pin_memory()``) needs a CUDA driver; without a GPU it raises "Found no NVIDIA
  driver". SGLang's LoRA layers pin small index tensors at start-up
  (``sglang/srt/lora/layers.py:475``, ``ColumnParallelLinearWithLoRA.__init__``), and its LoRA
  memory pool pins adapter weights. Pinning only speeds up host-to-GPU copies, so on a machine
  without CUDA the patch makes it a no-op (the tensor stays in ordinary host memory).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


def _unpinned_host_alloc(module: ModuleType) -> None:
    def alloc_unpinned(
        dims: tuple[int, ...],
        dtype: Any,
        device: str,
        pin_memory: bool,
        allocator: Any,
        registration_granularity_bytes: int | None = None,
    ) -> Any:
        """CPU: the host buffer is the tensor itself; there is no device to pin it for."""
        del pin_memory, registration_granularity_bytes
        return allocator.allocate(dims, dtype=dtype, device=device)

    module.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned


_PINNING_FACTORIES = ("tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided")


def _no_pinning_without_cuda(torch: ModuleType) -> None:
    if torch.cuda.is_available():
        return

    def unpinned(factory: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        call.__name__ = call.__qualname__ = factory.__name__
        call.__doc__ = factory.__doc__
        return call

    for name in _PINNING_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.mem_cache.pool_host.common": _unpinned_host_alloc,
    "torch": _no_pinning_without_cuda,
}
"""Module name -> function that patches it right after it is executed."""


class _PatchingFinder(importlib.abc.MetaPathFinder):
    """Finds the modules in :data:`PATCHES` with the normal finders, then wraps their loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> Any:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


sys.meta_path.insert(0, _PatchingFinder())
