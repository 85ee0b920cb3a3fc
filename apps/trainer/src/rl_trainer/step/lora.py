"""LoRA runs (``policy.lora``): the reference from the policy's base view, adapter-only weight
sync, and the final export.

- **Reference.** With ``algorithm.use_reference`` a LoRA policy is its own reference:
  :class:`BaseReference` scores with the adapters disabled
  (:meth:`~rl_core.interfaces.Policy.compute_base_logprobs`); no second model is built.
- **Weight sync** (``rl.lora_sync``). ``adapter``: publish
  :meth:`~rl_core.interfaces.Policy.named_adapter_weights` (a few megabytes) marked with
  :func:`rl_core.lora.with_adapter`; the generator loads them as a named adapter on the base it
  serves. ``merged``: publish the merged full weights
  (:meth:`~rl_core.interfaces.Policy.named_weights`). ``auto``: ``adapter`` when the policy has LoRA
  and the generator takes adapters (``Generator.supports_lora_adapters``), else ``merged``.
- **Multi-LoRA** (``policy.lora.adapters`` with ``rollout.adapter_key``): every prompt is
  tagged with its adapter (:func:`tag_prompts`, ``Prompt.metadata[SEQUENCE_ADAPTER_KEY]``); the
  default sampling sends it as ``GenerationRequest.adapter``, its rollouts carry it
  (:func:`tag_groups`) into ``TrainBatch.adapters``, so each adapter trains on its own
  prompts only. One adapter-only update per sync carries every adapter
  (:func:`rl_core.lora.with_adapter`); :func:`check_multi` refuses what cannot work.
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
from rl_core.lora import SEQUENCE_ADAPTER_KEY, adapter_of, with_adapter
from rl_core.types import Group, LogProbOutput, Prompt, TrainBatch

if TYPE_CHECKING:
    from rl_trainer.ops.evaluation import EvalSet
    from rl_trainer.run_state import WeightSync

__all__ = [
    "ADAPTER_DIR",
    "BaseReference",
    "adapter_metrics",
    "check_multi",
    "mark_update",
    "multi",
    "policy_weights",
    "save_final",
    "served",
    "tag_groups",
    "tag_prompts",
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


def policy_weights(policy: Any, adapter_sync: bool) -> Iterable[tuple[str, torch.Tensor]]:
    """What the run publishes of the live ``policy``: its adapter under ``adapter_sync``, else
    the (merged, for LoRA) full weights."""
    if adapter_sync:
        return policy.named_adapter_weights()
    return policy.named_weights()


def weights_copy(policy: Any, adapter_sync: bool) -> list[tuple[str, torch.Tensor]]:
    """A CPU copy of :func:`policy_weights` (kept for a later publication)."""
    return [(n, t.detach().to("cpu", copy=True)) for n, t in policy_weights(policy, adapter_sync)]


def mark_update(sync: WeightSync, policy: Any, update: Any) -> Any:  # a WeightUpdate
    """``update`` marked as an adapter update of ``policy`` on ``sync.base_path`` under adapter
    sync (unchanged otherwise)."""
    if not sync.adapter_sync:
        return update
    return with_adapter(update, policy.lora, sync.base_path)


def save_final(policy: Any, directory: Path) -> None:
    """Write the final model: without LoRA ``policy.save``; with LoRA the merged Hugging Face
    model in ``directory`` and the peft adapter in ``directory / ADAPTER_DIR``."""
    if policy.lora is None:
        policy.save(directory, with_optimizer=False)
        return
    policy.save_merged(directory)
    policy.save(directory / ADAPTER_DIR, with_optimizer=False)


# ----------------------------------------------------------------------------- multi-LoRA
def multi(policy: Any) -> bool:
    """Whether ``policy`` trains several adapters (``policy.lora.adapters``)."""
    lora = policy.lora
    return lora is not None and bool(getattr(lora, "adapters", ()))


def check_multi(key: str | None, policy: Any, adapter_sync: bool) -> None:
    """Refuse inconsistent multi-LoRA settings (``rollout.adapter_key``, ``policy.lora.adapters``,
    ``rl.lora_sync``), naming the field to change.

    Raises:
        ConfigError: an adapter key without several adapters or the reverse, or several
            adapters published as merged weights (one model cannot hold several adapters).
    """
    lora, several = policy.lora, multi(policy)
    if key and not several:
        raise ConfigError(
            f"rollout.adapter_key: {key!r} picks a LoRA adapter per prompt, but "
            "policy.lora.adapters is not set; set policy.lora.adapters (e.g. [solver, critic]) "
            "or drop rollout.adapter_key."
        )
    if several and not key:
        raise ConfigError(
            f"policy.lora.adapters: {list(lora.adapters)} needs rollout.adapter_key, the prompt "
            "metadata field naming each prompt's adapter (else only the default adapter would "
            "ever train)."
        )
    if several and not adapter_sync:
        raise ConfigError(
            "policy.lora.adapters: several adapters are published as adapters, but this run "
            "publishes merged weights (rl.lora_sync, the generator's supports_lora_adapters, "
            "or the ray runtime); use a generator that takes adapters (hf, or sglang with "
            "enable_lora) on the local runtime with rl.lora_sync: adapter or auto."
        )


def served(
    sync: WeightSync, policy: Any, eval_sets: Iterable[EvalSet], key: str | None, update: Any
) -> None:
    """After the generator loaded ``update``: a multi-LoRA run's requests name their adapters
    from now on (eval prompts too). Until the first adapter update the generator serves the
    base, which is exactly what fresh adapters (``B = 0``) compute, so the first round asks for
    no adapter; a resumed run syncs before its first round. ``key``: ``rollout.adapter_key``;
    sets ``sync.adapters_served``."""
    if sync.adapters_served or not sync.adapter_sync or not multi(policy):
        return
    if adapter_of(update) is None:
        return
    for eval_set in eval_sets:
        tag_prompts(key, policy.lora, eval_set.prompts)
    sync.adapters_served = True


def tag_prompts(key: str | None, lora: Any, prompts: Iterable[Prompt]) -> None:
    """Write each prompt's adapter (its ``metadata[key]``; absent: the default adapter) to
    ``metadata[SEQUENCE_ADAPTER_KEY]``. A no-op without ``key``.

    Raises:
        ConfigError: a prompt names an adapter that is not one of ``policy.lora.adapters``.
    """
    if not key:
        return
    for p in prompts:
        name = p.metadata.get(key, lora.default_adapter)
        if name not in lora.adapter_names:
            raise ConfigError(
                f"rollout.adapter_key: prompt {p.uid} has metadata[{key!r}] = {name!r}, which "
                f"is not one of policy.lora.adapters {list(lora.adapter_names)}; add it there "
                "or fix the data."
            )
        p.metadata[SEQUENCE_ADAPTER_KEY] = str(name)


def tag_groups(groups: Iterable[Group]) -> None:
    """Give every rollout its prompt's adapter (``metadata[SEQUENCE_ADAPTER_KEY]``), so packing
    puts it in ``TrainBatch.adapters`` whatever produced the rollouts."""
    for g in groups:
        name = g.prompt.metadata.get(SEQUENCE_ADAPTER_KEY)
        if name is not None:
            for r in g.rollouts:
                r.metadata[SEQUENCE_ADAPTER_KEY] = name


def adapter_metrics(groups: Iterable[Group], train: dict[str, float]) -> dict[str, float]:
    """Per-adapter metrics of a multi-LoRA step: ``rollout/reward_mean/<adapter>``,
    ``train/samples/<adapter>`` and ``train/grad_norm/<adapter>`` (empty otherwise)."""
    rewards: dict[str, list[float]] = {}
    for g in groups:
        for r in g.rollouts:
            name = r.metadata.get(SEQUENCE_ADAPTER_KEY)
            if name is not None and r.reward is not None:
                rewards.setdefault(name, []).append(float(r.reward))
    out: dict[str, float] = {}
    for name, xs in sorted(rewards.items()):
        out[f"rollout/reward_mean/{name}"] = sum(xs) / len(xs)
        out[f"train/samples/{name}"] = float(len(xs))
    for k, v in train.items():
        if k.startswith("grad_norm/"):
            out[f"train/{k}"] = v
    return out
