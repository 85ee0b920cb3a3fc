"""LoRA runs (``policy.lora``): the reference from the policy's base view, adapter-only weight
sync, and the final export.

- **Reference.** With ``algorithm.use_reference`` a LoRA policy is its own reference:
  :class:`BaseReference` scores with the adapters disabled
  (:meth:`~rl_core.interfaces.Policy.compute_base_logprobs`); no second model is built.
- **Weight sync** (``rl.lora_sync``). ``adapter``: publish
  :meth:`~rl_core.interfaces.Policy.named_adapter_weights` (a few megabytes) marked with
  :func:`rl_core.lora.with_adapter`; the generator loads them as a named adapter on the base it
  serves. ``merged``: publish the merged full weights (:meth:`named_weights`). ``auto``:
  ``adapter`` when the policy has LoRA and the generator takes adapters
  (``Generator.supports_lora_adapters``), else ``merged``.
- **Export.** ``final_model`` holds the merged Hugging Face model (every consumer of a
  ``final_model`` loads it unchanged) and ``final_model/adapter`` the peft adapter directory
  (``peft.PeftModel.from_pretrained(base, "final_model/adapter")``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_core.errors import ConfigError
from rl_core.lora import with_adapter
from rl_core.types import LogProbOutput, TrainBatch

if TYPE_CHECKING:
    from rl_trainer.loop import Trainer

__all__ = [
    "ADAPTER_DIR",
    "BaseReference",
    "mark_update",
    "policy_weights",
    "save_final",
    "use_adapter_sync",
    "weights_copy",
]

ADAPTER_DIR = "adapter"
"""Subdirectory of a LoRA run's ``final_model`` holding the peft adapter."""


class BaseReference:
    """The KL reference of a LoRA run: the policy itself with its adapters disabled.

    It holds no weights (:attr:`shares_policy`: the colocated hand-over does not offload it
    separately) and answers ``compute_logprobs`` with the policy's
    ``compute_base_logprobs``.
    """

    shares_policy = True
    """Its memory is the policy's (nothing to offload or checkpoint)."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        """The LoRA policy whose base this is."""

    @property
    def version(self) -> int:
        """The base never changes: version 0."""
        return 0

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` of the frozen base (entropy is not computed)."""
        return self.policy.compute_base_logprobs(batch)


def use_adapter_sync(mode: str, policy: Any, generator: Any, *, ray: bool = False) -> bool:
    """Whether this run publishes adapters (``rl.lora_sync`` resolved; see module doc). On the
    ``ray`` runtime the policy ranks publish full weights themselves, so ``auto`` is
    ``merged`` there.

    Raises:
        ConfigError: ``adapter`` asked for but the policy has no LoRA, the generator cannot
            load adapters, or the runtime is ``ray``.
    """
    lora = policy.lora
    takes = bool(getattr(generator, "supports_lora_adapters", False)) and not ray
    if mode == "auto":
        return lora is not None and takes
    if mode == "merged":
        return False
    if lora is None:
        raise ConfigError(
            "rl.lora_sync: 'adapter' publishes LoRA adapters, but policy.lora is not set; set "
            "policy.lora (e.g. {rank: 8}) or rl.lora_sync: auto."
        )
    if ray:
        raise ConfigError(
            "rl.lora_sync: 'adapter' is not available on the ray runtime yet (its policy ranks "
            "publish full weights); use rl.lora_sync: merged (or auto)."
        )
    if not takes:
        raise ConfigError(
            f"rl.lora_sync: 'adapter', but the generator ({type(generator).__name__}) cannot "
            "load LoRA adapters (supports_lora_adapters is false); use rl.lora_sync: merged "
            "(or auto) to publish the merged weights."
        )
    return True


def policy_weights(run: Trainer) -> Iterable[tuple[str, torch.Tensor]]:
    """What the run publishes of the live policy: its adapter under adapter sync, else the
    (merged, for LoRA) full weights."""
    if run.adapter_sync:
        return run.policy.named_adapter_weights()
    return run.policy.named_weights()


def weights_copy(run: Trainer) -> list[tuple[str, torch.Tensor]]:
    """A CPU copy of :func:`policy_weights` (kept for a later publication)."""
    return [(n, t.detach().to("cpu", copy=True)) for n, t in policy_weights(run)]


def mark_update(run: Trainer, update: Any) -> Any:  # a WeightUpdate
    """``update`` marked as an adapter update under adapter sync (unchanged otherwise)."""
    if not run.adapter_sync:
        return update
    return with_adapter(update, run.policy.lora, run.rl_start_path())


def save_final(policy: Any, directory: Path) -> None:
    """Write the final model: without LoRA ``policy.save``; with LoRA the merged Hugging Face
    model in ``directory`` and the peft adapter in ``directory / ADAPTER_DIR``."""
    if policy.lora is None:
        policy.save(directory, with_optimizer=False)
        return
    policy.save_merged(directory)
    policy.save(directory / ADAPTER_DIR, with_optimizer=False)
