"""Building a :class:`~rl_core.interfaces.Critic` on a policy backend.

A backend's critic is usually its policy with a scalar value head in place of the vocabulary
projection, so the packed forward, the optimizer, the parallel layout and the checkpoints are the
policy's. :class:`PolicyCriticMixin` maps the critic methods onto the policy ones; a backend
mixes it in before its policy class and makes its per-token output the values::

    class MyCritic(PolicyCriticMixin, MyPolicy, Critic):
        ...  # override the head and the per-token output; save/load the head
"""

from __future__ import annotations

from typing import Any

import torch

from rl_core.algorithms.losses import ValueObjective
from rl_core.interfaces import ValueLossFn
from rl_core.types import LogProbOutput, TrainBatch

__all__ = ["PolicyCriticMixin"]


class PolicyCriticMixin:
    """``compute_values`` / ``train_step`` of a :class:`~rl_core.interfaces.Critic` on top of a
    :class:`~rl_core.interfaces.Policy` whose per-token output (``compute_logprobs().logprobs``
    and what ``train_step`` hands the loss) is the value."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[T]`` (float32) without gradients."""
        return self.compute_logprobs(batch).logprobs

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """The values in ``logprobs`` (a critic has no log-probs); ``entropy`` is ``None``."""
        out = super().compute_logprobs(batch, with_entropy=False)  # type: ignore[misc]
        return LogProbOutput(logprobs=out.logprobs, entropy=None)

    def train_step(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, Any]:
        """One optimizer step of the backend's training loop on ``loss_fn(values, batch)``."""
        return super().train_step(batch, ValueObjective(loss_fn))  # type: ignore[misc]
