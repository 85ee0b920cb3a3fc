"""What ``offload``/``onload`` of :class:`~rl_megatron.MegatronPolicy` (and the critic) move.

What moves, by kind (switched by ``policy.offload``, an :class:`~rl_core.offload.OffloadConfig`):

- ``weights``: the module's parameters and buffers, and DDP's contiguous parameter buffers
  (``param_data``, present with the distributed optimizer: the parameters are views into it);
- ``grads``: DDP's contiguous gradient buffers (``grad_data``; every ``param.main_grad`` is a view
  into one), any ``.grad`` of the parameters and of the optimizer's own parameters;
- ``optimizer``: per sub-optimizer of Megatron's ``ChainedOptimizer``, the inner torch
  optimizer's parameters (the fp32 master weights of a bf16 model, or their data-parallel shards
  under the distributed optimizer) and its state (Adam ``exp_avg``/``exp_avg_sq``).

The mechanism is :class:`~rl_core.offload.StorageOffloader`: storages are freed in place and
restored bitwise, so the views Megatron keeps into its buffers (``main_grad``, the distributed
optimizer's shard views, bucket views) are valid again after ``onload``. Between ``offload`` and
``onload`` the policy must not be used. An fp32 model without the distributed optimizer trains
its parameters directly: they are the optimizer's parameters too and move with ``weights``.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.offload import TrackedTensors

__all__ = ["tracked_tensors"]


def _ddp_buffers(model: Any) -> list[Any]:
    """DDP's parameter-and-gradient buffers (dense and expert-parallel)."""
    return [*getattr(model, "buffers", []), *getattr(model, "expert_parallel_buffers", [])]


def _inner_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's (chained) optimizer."""
    subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
    out = []
    for sub in subs:
        inner = getattr(sub, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            out.append(inner)
    return out


def tracked_tensors(module: Any, model: Any, optimizer: Any, device_type: str) -> TrackedTensors:
    """``(kind, name, tensor)`` of one rank's state, weights first (a storage's first kind
    decides whether it moves): ``module`` the Megatron model, ``model`` its DDP wrapper,
    ``optimizer`` Megatron's (chained) optimizer, ``device_type`` the compute device's type
    (optimizer state elsewhere, e.g. on the host while offloaded, is not listed)."""
    for name, param in module.named_parameters():
        yield "weights", name, param
    for name, buf in module.named_buffers():
        yield "weights", name, buf
    buffers = _ddp_buffers(model)
    for i, buf in enumerate(buffers):
        yield "weights", f"ddp.{i}.param_data", getattr(buf, "param_data", None)
    for i, buf in enumerate(buffers):
        yield "grads", f"ddp.{i}.grad_data", getattr(buf, "grad_data", None)
    for name, param in module.named_parameters():
        yield "grads", f"{name}.main_grad", getattr(param, "main_grad", None)
        yield "grads", f"{name}.grad", param.grad
    for k, inner in enumerate(_inner_optimizers(optimizer)):
        for g, group in enumerate(inner.param_groups):
            for j, param in enumerate(group["params"]):
                yield "optimizer", f"opt{k}.group{g}.{j}", param
                yield "grads", f"opt{k}.group{g}.{j}.grad", param.grad
                for key, value in inner.state.get(param, {}).items():
                    if isinstance(value, torch.Tensor) and value.device.type == device_type:
                        yield "optimizer", f"opt{k}.group{g}.{j}.{key}", value
