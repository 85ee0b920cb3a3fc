"""A critic on megatron-core: :class:`~rl_megatron.policy.MegatronPolicy`'s model, layouts,
DDP, optimizer and checkpoints with a scalar value head instead of the vocabulary projection.

The last pipeline stage carries ``value_head``, a ``Linear(hidden, 1)`` initialised to zero and
replicated over tensor-parallel ranks (its input, the final-norm hidden state, is replicated
without sequence parallelism, so every TP rank computes the same values and gradients; the
gradient norm counts it once). The language-model head is bypassed: its forward returns the
values, so no ``[S, V/tp]`` logits are computed. Registry name ``megatron`` in ``rl.critics``::

    critic = MegatronCritic(MegatronCritic.Config(model_path="runs/demo/sft_model", tp_size=2))
    values_T = critic.compute_values(batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_core.critics import PolicyCriticMixin
from rl_core.errors import CheckpointError, ConfigError
from rl_core.interfaces import Critic
from rl_megatron.parallel import current_device
from rl_megatron.policy import MegatronPolicy

__all__ = ["HEAD_FILE", "MegatronCritic"]

HEAD_FILE = "value_head.pt"
"""File name of the value head's weights inside a saved critic directory (same as
:data:`rl_hf.critic.HEAD_FILE`, so the two backends read each other's heads)."""


class MegatronCritic(PolicyCriticMixin, MegatronPolicy, Critic):
    """A value model on megatron-core at any TP/PP/DP layout MegatronPolicy supports.

    Values follow :class:`~rl_core.interfaces.Critic`'s alignment (``values[t]`` from the hidden
    state of ``tokens[t-1]``, 0 at sequence starts). :meth:`compute_logprobs` (inherited) returns
    the values in ``logprobs``; use :meth:`compute_values`.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MegatronPolicy.Config):
        """Settings of :class:`MegatronCritic` (those of :class:`MegatronPolicy`, without
        ``lora``)."""

        def __post_init__(self) -> None:
            MegatronPolicy.Config.__post_init__(self)
            if self.lora is not None:
                raise ConfigError(
                    "critic.lora: a LoRA critic is not supported (its value head would be "
                    "frozen with the base); remove critic.lora and train the critic fully."
                )

    value_head: torch.nn.Linear | None
    """``Linear(hidden, 1)`` on the last pipeline stage (``None`` on the others)."""

    def _build_ddp_and_optimizer(self, split: dict[str, dict[str, Any]]) -> None:
        self.value_head = None
        if self.module.post_process:
            hidden = int(self.tconfig.hidden_size)
            head = torch.nn.Linear(hidden, 1, dtype=self._params_dtype, device=current_device())
            torch.nn.init.zeros_(head.weight)
            torch.nn.init.zeros_(head.bias)
            self.module.value_head = head  # a submodule: DDP and the optimizer include it
            self.value_head = head
            output_layer = self.module.output_layer
            # Untied: the LM head is not trained. Tied: keep the last stage's embedding copy
            # trainable, Megatron all-reduces its (here zero) gradient with the first stage's.
            if not self.module.share_embeddings_and_output_weights:
                output_layer.weight.requires_grad_(False)

            def values_instead_of_logits(
                hidden_SBH: torch.Tensor, weight: Any = None, **_: Any
            ) -> tuple[torch.Tensor, None]:
                return head(hidden_SBH), None

            output_layer.forward = values_instead_of_logits
        super()._build_ddp_and_optimizer(split)

    def _logits_to_logp(
        self, logits_NLV: torch.Tensor, prep: dict[str, torch.Tensor], *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values ``[T]`` from the head's ``[N, L, 1]`` output (no entropy)."""
        tokens_T, scored_T = prep["tokens_T"], prep["scored_T"]
        zero_T = torch.zeros(tokens_T.shape[0], dtype=torch.float32, device=tokens_T.device)
        values_S = logits_NLV.reshape(-1).index_select(0, prep["source_S"]).float()
        return zero_T.masked_scatter(scored_T, values_S), None

    def _head_writer(self) -> bool:
        return self.value_head is not None and self.layout.tp_rank == 0 and self.layout.dp_rank == 0

    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """The policy checkpoint plus :data:`HEAD_FILE` (written by the last stage's first
        rank before the state file; collective). The value head is also part of the Megatron
        distributed checkpoint written with ``with_optimizer`` (its Adam state included)."""
        out = Path(directory)
        if self._head_writer():
            out.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().cpu().float() for k, v in self.value_head.state_dict().items()}
            tmp = out / (HEAD_FILE + ".tmp")
            torch.save(state, tmp)
            tmp.replace(out / HEAD_FILE)
        super().save(out, with_optimizer=with_optimizer)

    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore :meth:`save`'s output, value head included (collective).

        With ``with_optimizer`` the head and its optimizer state come from the Megatron
        distributed checkpoint (any layout); otherwise from :data:`HEAD_FILE`.

        Raises:
            CheckpointError: the directory has no value head (e.g. a policy checkpoint).
        """
        head = Path(directory) / HEAD_FILE
        if not head.is_file():
            raise CheckpointError(
                f"{Path(directory)}: no {HEAD_FILE}; this is not a critic checkpoint (a fresh "
                "critic starts from a policy directory through Config.model_path instead)."
            )
        super().load(directory, with_optimizer=with_optimizer)
        if with_optimizer or self.value_head is None:
            return
        state = torch.load(head, map_location="cpu", weights_only=True)
        with torch.no_grad():
            for name, param in self.value_head.named_parameters():
                param.copy_(state[name].to(param.dtype))
        reload = getattr(self.optimizer, "reload_model_params", None)
        if callable(reload):
            reload()
