"""The tensors ``offload``/``onload`` of :class:`~rl_hf.HFPolicy` and :class:`~rl_hf.HFCritic` move.

What moves (each kind switched by ``policy.offload``, an :class:`~rl_core.offload.OffloadConfig`):
``weights`` are the model's parameters and buffers plus extra trainable heads (the critic's
value head), ``grads`` the parameters' ``.grad`` (``None`` between steps, since ``train_step``
frees them), ``optimizer`` the AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``). The mechanism
is :class:`~rl_core.offload.Offloadable`'s :class:`~rl_core.offload.StorageOffloader`: device
storages are freed in place and restored bitwise. Between ``offload`` and ``onload`` the policy
must not be used on a GPU (its storages are empty then); on CPU its tensors read the host copies,
so it still computes the same values.
"""

from __future__ import annotations

import torch

from rl_core.offload import TrackedTensors

__all__ = ["training_state"]


def training_state(
    model: torch.nn.Module,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    device: torch.device,
) -> TrackedTensors:
    """``(kind, name, tensor)`` of every tensor of a model's training state, weights first.

    ``params`` are the optimizer's parameters (the model's trainable ones plus extra heads, which
    are weights too); ``optimizer`` state on ``device`` is the ``optimizer`` kind.
    """
    for name, param in model.named_parameters():
        yield "weights", name, param
    extra = {id(p) for p in model.parameters()}
    for i, param in enumerate(params):
        if id(param) not in extra:
            yield "weights", f"extra.{i}", param
    for name, buf in model.named_buffers():
        yield "weights", name, buf
    for i, param in enumerate(params):
        yield "grads", f"grad.{i}", param.grad
    for i, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            if isinstance(value, torch.Tensor) and value.device.type == device.type:
                yield "optimizer", f"state.{i}.{key}", value
