"""Run the ``tinker-cookbook`` supervised and RL trainers, unmodified, against a service.

``supervised(...)`` runs ``tinker_cookbook.supervised.train.main`` on the conversations file the
cookbook ships (``example_data/conversations.jsonl``) with the ``role_colon`` renderer and the
base model's own tokenizer directory; ``rl(...)`` runs ``tinker_cookbook.rl.train.main`` (its
default ``importance_sampling`` loss, GRPO-style group advantages) on :class:`LettersTask`, a
task of ours: the reward is the share of sampled tokens that are lowercase ASCII letters, so a
random tiny model starts near the letters' share of its vocabulary and learns to raise it. Only
configuration points the cookbook at the service (``base_url``, ``model_name`` = the model's
directory, ``renderer_name``); nothing is downloaded.

``tinker-cookbook`` is not a dependency of this package (its own dependency ``tml-renderers``
is not on every index): these functions import it when called.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["letters_task_builder", "read_metrics", "rl", "supervised"]


def _cookbook() -> Any:
    try:
        import tinker_cookbook
    except ImportError as e:
        from rl_core.errors import ConfigError

        raise ConfigError(
            "the cookbook recipes need tinker-cookbook (pip install tinker-cookbook; see "
            "docs/service.md for installing it where tml-renderers is missing)."
        ) from e
    return tinker_cookbook


def supervised(
    base_url: str,
    model_dir: str,
    log_path: str,
    *,
    batch_size: int = 16,
    max_length: int = 256,
    learning_rate: float = 1e-3,
    lora_rank: int = 8,
    num_epochs: int = 1,
    max_steps: int | None = None,
) -> list[dict[str, Any]]:
    """The cookbook's supervised trainer on its example conversations; returns its metrics
    rows (``train_mean_nll`` per step)."""
    cookbook = _cookbook()
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    extra = {} if max_steps is None else {"max_steps": max_steps}
    config = train.Config(
        log_path=log_path,
        recipe_name="recipe_sl_basic",
        model_name=model_dir,
        renderer_name="role_colon",
        dataset_builder=FromConversationFileBuilder(
            file_path=str(data),
            common_config=ChatDatasetBuilderCommonConfig(
                model_name_for_tokenizer=model_dir,
                renderer_name="role_colon",
                max_length=max_length,
                batch_size=batch_size,
            ),
        ),
        learning_rate=learning_rate,
        lora_rank=lora_rank,
        base_url=base_url,
        num_epochs=num_epochs,
        save_every=0,
        eval_every=0,
        **extra,
    )
    asyncio.run(train.main(config))
    return read_metrics(log_path)


def letters_task_builder(
    model_dir: str, *, batches: int, batch_size: int, group_size: int, max_tokens: int
) -> Any:
    """An ``RLDatasetBuilder`` of :class:`LettersTask` episodes (``batches`` batches of
    ``batch_size`` groups of ``group_size`` samples)."""
    _cookbook()
    import chz
    import tinker
    from tinker_cookbook.rl.types import (
        Env,
        EnvGroupBuilder,
        RLDataset,
        RLDatasetBuilder,
        StepResult,
    )
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    tokenizer = get_tokenizer(model_dir)
    prompt = list(tokenizer.encode("Write some words: "))
    letters = {
        t
        for t in range(len(tokenizer))
        if (s := tokenizer.decode([t])) and len(s) == 1 and "a" <= s <= "z"
    }

    class LettersTask(Env):
        """One episode: continue the prompt; reward = share of lowercase-letter tokens."""

        async def initial_observation(self) -> Any:
            return tinker.ModelInput.from_ints(prompt), []

        async def step(self, action: Sequence[int], *, extra: Any = None) -> Any:
            share = sum(t in letters for t in action) / max(1, len(action))
            return StepResult(
                reward=share,
                episode_done=True,
                next_observation=tinker.ModelInput.from_ints([]),
                next_stop_condition=[],
                metrics={"letter_share": share},
            )

    class Group(EnvGroupBuilder):
        async def make_envs(self) -> Sequence[Any]:
            return [LettersTask() for _ in range(group_size)]

        def logging_tags(self) -> list[str]:
            return ["letters"]

    class Dataset(RLDataset):
        def get_batch(self, index: int) -> Sequence[Any]:
            return [Group() for _ in range(batch_size)]

        def __len__(self) -> int:
            return batches

    @chz.chz
    class Builder(RLDatasetBuilder):
        async def __call__(self) -> tuple[Any, None]:
            return Dataset(), None

    return Builder()


def rl(
    base_url: str,
    model_dir: str,
    log_path: str,
    *,
    steps: int = 6,
    batch_size: int = 4,
    group_size: int = 4,
    max_tokens: int = 8,
    learning_rate: float = 1e-2,
    lora_rank: int = 8,
) -> list[dict[str, Any]]:
    """The cookbook's RL trainer on :class:`LettersTask`; returns its metrics rows
    (``env/all/reward/total`` per step)."""
    _cookbook()
    from tinker_cookbook.rl import train

    config = train.Config(
        learning_rate=learning_rate,
        dataset_builder=letters_task_builder(
            model_dir,
            batches=steps,
            batch_size=batch_size,
            group_size=group_size,
            max_tokens=max_tokens,
        ),
        model_name=model_dir,
        recipe_name="recipe_rl_basic",
        max_tokens=max_tokens,
        log_path=log_path,
        renderer_name="role_colon",
        lora_rank=lora_rank,
        base_url=base_url,
        eval_every=0,
        save_every=0,
        num_groups_to_log=0,
        rollout_json_export=False,
    )
    asyncio.run(train.main(config))
    return read_metrics(log_path)


def read_metrics(log_path: str) -> list[dict[str, Any]]:
    """The rows of ``<log_path>/metrics.jsonl`` the cookbook writes."""
    file = Path(log_path) / "metrics.jsonl"
    if not file.is_file():
        return []
    return [json.loads(line) for line in file.read_text().splitlines() if line.strip()]


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a local model directory never needs the hub
