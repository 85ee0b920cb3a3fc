"""A reference critic: a Hugging Face causal LM's backbone with a scalar value head.

:class:`HFCritic` reuses :class:`~rl_hf.HFPolicy`'s packed (padding-free) forward,
AdamW, gradient clipping, warmup schedule and Hugging Face checkpoint format; it replaces the
language-model head's log-probs with values read off the last hidden states::

    critic = HFCritic(HFCritic.Config(model_path="runs/demo/sft_model", lr=1e-4))
    old_values_T = critic.compute_values(batch)
    batch.old_values, batch.returns = old_values_T, returns_T  # returns from GAE
    critic.train_step(batch, ValueLoss())

The value head is a ``Linear(hidden, 1)`` initialised to zero (every value starts at 0) and saved
next to the model as :data:`HEAD_FILE`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from rl_core.critics import PolicyCriticMixin
from rl_core.errors import CheckpointError, ConfigError
from rl_core.interfaces import Critic
from rl_core.types import TrainBatch
from rl_hf.policy import HFPolicy

__all__ = ["HEAD_FILE", "HFCritic"]

HEAD_FILE = "value_head.pt"
"""File name of the value head's weights inside a saved critic directory."""


class HFCritic(PolicyCriticMixin, HFPolicy, Critic):
    """A value model on a Hugging Face causal LM directory (the policy's, typically).

    Values follow :class:`~rl_core.interfaces.Critic`'s alignment: ``values[t]`` is read off the
    hidden state of ``tokens[t-1]`` (0 at every sequence start), the same position the
    log-prob of ``tokens[t]`` comes from. :meth:`compute_logprobs` (inherited) returns the values
    in ``logprobs``; use :meth:`compute_values`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(HFPolicy.Config):
        """Settings of :class:`HFCritic` (those of :class:`HFPolicy`; ``temperature`` is unused,
        ``lora`` is not supported: a critic trains every weight)."""

        def __post_init__(self) -> None:
            HFPolicy.Config.__post_init__(self)
            if self.lora is not None:
                raise ConfigError(
                    "critic.lora: the critic trains every weight and its value head; remove "
                    "critic.lora (LoRA is a policy option, policy.lora)."
                )

    value_head: torch.nn.Linear
    """``Linear(hidden, 1)`` in float32 on the model's device."""

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        hidden = int(self.model.config.get_text_config().hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1, dtype=torch.float32, device=self.device)
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        return [*super()._trainable_parameters(), *self.value_head.parameters()]

    def _packed_logprobs(
        self, batch: TrainBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values ``[T]`` of one micro-batch (no entropy)."""
        if batch.tokens.shape[0] == 0:
            return torch.zeros(0, device=self.device), None
        position_ids_T, kwargs, expand_T = self._packed_inputs(batch)
        hidden_TH = self.model.base_model(**kwargs).last_hidden_state[0]
        if expand_T is not None:  # shared prefixes: the model ran on the compact row
            hidden_TH = hidden_TH.index_select(0, expand_T)
        v_T = self.value_head(hidden_TH.float()).squeeze(-1)  # value after token t
        shifted_T = torch.cat([v_T.new_zeros(1), v_T[:-1]])  # value before token t
        return torch.where(position_ids_T == 0, 0.0, shifted_T), None

    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """The policy checkpoint (Hugging Face directory, optimizer) plus :data:`HEAD_FILE`."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / (HEAD_FILE + ".tmp")
        torch.save(self.value_head.state_dict(), tmp)
        tmp.replace(out / HEAD_FILE)
        super().save(out, with_optimizer=with_optimizer)  # its state file is written last

    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore :meth:`save`'s output, value head and version included.

        Raises:
            CheckpointError: the directory has no value head (e.g. it is a policy checkpoint).
        """
        head = Path(directory) / HEAD_FILE
        if not head.is_file():
            raise CheckpointError(
                f"{Path(directory)}: no {HEAD_FILE}; this is not a critic checkpoint (a fresh "
                "critic starts from a policy directory through Config.model_path instead)."
            )
        state = torch.load(head, map_location=self.device, weights_only=True)
        super().load(directory, with_optimizer=with_optimizer)
        self.value_head.load_state_dict(state)
