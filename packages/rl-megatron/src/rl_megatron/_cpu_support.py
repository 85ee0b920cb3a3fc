"""CPU redirection of the CUDA-only calls megatron-core makes on the dense-GPT training path.

megatron-core assumes a GPU in a handful of places (rotary embeddings, the default causal mask,
the model-parallel RNG tracker, the optimizer's norm and clip helpers, the ``.type()`` asserts of
the distributed optimizer). On a machine without CUDA, :func:`enable_cpu_support` redirects them
to the CPU so training, tensor/data parallelism and the distributed optimizer run over gloo.

This module is only imported by :mod:`rl_megatron.parallel` when ``torch.cuda.is_available()``
is False, and :func:`enable_cpu_support` refuses to run when a GPU is present: the patches are
process-wide (a ``TorchFunctionMode`` rewrites ``device="cuda"`` arguments, ``Tensor.cuda`` is a
no-op and ``Tensor.type()`` reports CUDA type names) and must never touch a real GPU process.
Calling it again is a no-op.

The list follows ``feasibility-cpu.md`` §1.2 (megatron-core 0.16.1):

1. ``torch.cuda.current_device`` -> ``"cpu"``; ``synchronize`` and stream calls do nothing.
2. ``get_default_causal_mask`` builds its mask on the CPU (cached per length).
3. The CUDA RNG tracker saves and restores the CPU generator state.
4. ``device="cuda"`` (or an int device) in any torch call becomes ``"cpu"``.
5. ``Tensor.cuda()`` returns the tensor itself.
6. ``Tensor.type()`` without arguments reports ``torch.cuda.FloatTensor`` etc. for CPU tensors.
7. ``torch.cuda.Stream()`` is a stream that never waits and ``torch.cuda.stream(s)`` a null
   context (the MoE all-to-all token dispatcher copies its split sizes on a side stream).
8. The all-to-all dispatcher's device-to-host copy of its split sizes returns numpy arrays for
   CPU tensors too (``all_to_all_single`` takes sequences of ints, not tensors; on a GPU they
   become numpy arrays in that copy).
9. Uneven all-gather / reduce-scatter along the first dimension (the expert tensor-parallel
   steps of the all-to-all dispatcher): gloo refuses lists of tensors of different sizes, so
   the gather pads every part to the largest and trims, and the reduce-scatter all-reduces the
   whole tensor and keeps this rank's part.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from rl_core.errors import RLError

__all__ = ["cpu_support_enabled", "disable_cpu_support", "enable_cpu_support"]

_ENABLED = False
_MODE: Any = None
_SAVED: dict[tuple[Any, str], Any] = {}


def cpu_support_enabled() -> bool:
    """True once :func:`enable_cpu_support` has patched this process."""
    return _ENABLED


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(torch.overrides.TorchFunctionMode):
    """Rewrites a CUDA ``device=`` keyword of any torch call to the CPU."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for a CUDA stream: every wait or synchronisation returns at once. A class (not a
    function) so code that annotates with ``torch.cuda.Stream | None`` at import time, as
    transformers' continuous batching does, still imports."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Takes and ignores a stream's constructor arguments (device, priority)."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""

    def synchronize(self) -> None:
        """No-op."""

    def record_event(self, *args: Any, **kwargs: Any) -> _NullEvent:
        """An event that is always complete."""
        return _NullEvent()


class _NullEvent:
    """Stands in for a CUDA event: always complete."""

    def synchronize(self) -> None:
        """No-op."""

    def wait(self, *args: Any, **kwargs: Any) -> None:
        """No-op."""


_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}


@functools.lru_cache(maxsize=32)
def _cpu_causal_mask(sq: int) -> torch.Tensor:
    """``[sq, sq]`` bool, True above the diagonal (positions a query must not attend to)."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def enable_cpu_support() -> None:
    """Patch this process so megatron-core's dense GPT path runs without CUDA (idempotent).

    Raises:
        RLError: a CUDA device is available; the redirections must never run on a GPU machine.
    """
    global _ENABLED, _MODE
    if _ENABLED:
        return
    if torch.cuda.is_available():
        raise RLError(
            "rl_megatron._cpu_support: CUDA is available, refusing to redirect CUDA calls to the "
            "CPU; the GPU path needs no redirection (do not call enable_cpu_support there)."
        )
    for owner, name in (
        (torch.cuda, "current_device"),
        (torch.cuda, "synchronize"),
        (torch.cuda, "current_stream"),
        (torch.cuda, "default_stream"),
        (torch.cuda, "Stream"),
        (torch.cuda, "stream"),
        (torch.cuda, "get_rng_state"),
        (torch.cuda, "manual_seed"),
        (torch.Tensor, "cuda"),
        (torch.Tensor, "type"),
    ):
        _SAVED[(owner, name)] = getattr(owner, name)
    # 1. Device queries, synchronisation and streams.
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    torch.cuda.default_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    # 7. Side streams (MoE all-to-all dispatcher).
    torch.cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]

    # 3. RNG: the "CUDA" generator state is the CPU one.
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mp_random

    mp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # 2. The default causal mask on the CPU.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    def get_default_causal_mask(sq: int) -> torch.Tensor:
        return _cpu_causal_mask(sq)

    transformer_utils.get_default_causal_mask = get_default_causal_mask
    if hasattr(fused_softmax, "get_default_causal_mask"):
        fused_softmax.get_default_causal_mask = get_default_causal_mask

    # 8. Split sizes of the MoE all-to-all as numpy arrays, as after a device-to-host copy.
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original_move = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(
        tensor: Any, as_numpy: bool = False, record_stream: bool = False
    ) -> Any:
        if torch.is_tensor(tensor) and not tensor.is_cuda and as_numpy:
            return tensor.numpy()
        return original_move(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu

    # 9. Uneven first-dimension gather / reduce-scatter over gloo.
    import megatron.core.tensor_parallel.mappings as mappings

    even_gather = mappings._gather_along_first_dim
    even_reduce_scatter = mappings._reduce_scatter_along_first_dim

    def gather_along_first_dim(
        input_: torch.Tensor, group: Any, output_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if output_split_sizes is None or group.size() == 1:
            return even_gather(input_, group, output_split_sizes, *args, **kw)
        sizes = [int(n) for n in output_split_sizes]
        longest = max(sizes)
        padded = input_.new_zeros(longest, *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([p[:n] for p, n in zip(parts, sizes)])

    def reduce_scatter_along_first_dim(
        input_: torch.Tensor, group: Any, input_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> torch.Tensor:
        if input_split_sizes is None or group.size() == 1:
            return even_reduce_scatter(input_, group, input_split_sizes, *args, **kw)
        sizes = [int(n) for n in input_split_sizes]
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        start = sum(sizes[: group.rank()])
        return total[start : start + sizes[group.rank()]].clone()

    mappings._gather_along_first_dim = gather_along_first_dim
    mappings._reduce_scatter_along_first_dim = reduce_scatter_along_first_dim

    # 5./6. Tensor.cuda() is the identity; Tensor.type() names CUDA types.
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    original_type = torch.Tensor.type

    def tensor_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        return original_type(self, *args, **kwargs)

    torch.Tensor.type = tensor_type  # type: ignore[method-assign]

    # 4. device="cuda" anywhere becomes the CPU (entered once, for the life of the process).
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _ENABLED = True


def disable_cpu_support() -> None:
    """Undo the torch-level patches of :func:`enable_cpu_support` (for test isolation).

    megatron-core's own module attributes stay redirected; call :func:`enable_cpu_support` again
    before using megatron-core in this process.
    """
    global _ENABLED, _MODE
    if not _ENABLED:
        return
    _MODE.__exit__(None, None, None)
    _MODE = None
    for (owner, name), value in _SAVED.items():
        setattr(owner, name, value)
    _SAVED.clear()
    _ENABLED = False
