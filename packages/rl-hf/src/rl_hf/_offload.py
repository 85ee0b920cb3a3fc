"""``offload``/``onload`` of :class:`~rl_hf.HFPolicy` and :class:`~rl_hf.HFCritic`.

What moves (each kind switched by ``policy.offload``, an :class:`~rl_core.offload.OffloadConfig`):
``weights`` are the model's parameters and buffers plus extra trainable heads (the critic's
value head), ``grads`` the parameters' ``.grad`` (``None`` between steps, since ``train_step``
frees them), ``optimizer`` the AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``). The mechanism
is :class:`~rl_core.offload.StorageOffloader`: device storages are freed in place and restored
bitwise. Between ``offload`` and ``onload`` the policy must not be used on a GPU (its storages
are empty then); on CPU its tensors read the host copies, so it still computes the same values.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.offload import Offloadable, TrackedTensors

__all__ = ["OffloadMixin"]


class OffloadMixin(Offloadable):
    """Adds ``offload``/``onload`` to a policy with ``model``, ``_params``, ``optimizer``,
    ``device`` and ``config.offload`` attributes (``HFPolicy``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    config: Any
    _params: list[torch.nn.Parameter]

    def tracked_tensors(self) -> TrackedTensors:
        """``(kind, name, tensor)`` of every tensor of the policy's state, weights first."""
        for name, param in self.model.named_parameters():
            yield "weights", name, param
        extra = {id(p) for p in self.model.parameters()}
        for i, param in enumerate(self._params):
            if id(param) not in extra:
                yield "weights", f"extra.{i}", param
        for name, buf in self.model.named_buffers():
            yield "weights", name, buf
        for i, param in enumerate(self._params):
            yield "grads", f"grad.{i}", param.grad
        for i, param in enumerate(self._params):
            for key, value in self.optimizer.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.device.type == self.device.type:
                    yield "optimizer", f"state.{i}.{key}", value
