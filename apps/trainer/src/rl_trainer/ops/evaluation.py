"""Evaluation sets: which prompts, how to sample and score them, when, and what to report.

The held-out split (the task's eval split or ``data.eval``) is the default set and reports
under ``eval/`` (``eval/reward_mean``, ``eval/accuracy``, ``eval/pass@k``, one
``eval/<component>_mean`` per reward component). Each entry of ``eval.datasets`` is another set
with its own prompts, reward, sampling, samples per prompt, pass@k and schedule, reporting
under ``eval/<name>/``.

Eval samples like training except for the temperature: each sampling field a set leaves unset
comes from ``eval.sampling``, then from ``rollout.sampling`` (``max_new_tokens``,
``stop_token_ids``, ``top_p``, ``top_k``), so eval answers are cut where training answers are;
the temperature is greedy (0) unless set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from rl_buffer.scoring import Scorer
from rl_core import registry
from rl_core.evaluation import summarize_eval
from rl_core.interfaces import DataSource, RewardFn, Tokenizer
from rl_core.types import Group, Prompt, SamplingParams
from rl_trainer.build import build_callable, component_name
from rl_trainer.config import EvalConfig, SamplingConfig

__all__ = ["EvalSet", "build_eval_sets"]


@dataclass(kw_only=True, slots=True)
class EvalSet:
    """One evaluation dataset, resolved from the config."""

    name: str | None
    """``None`` for the default held-out set, else the dataset's name."""
    prompts: list[Prompt]
    """The same prompts every time."""
    scorer: Scorer
    """Applies the set's reward function."""
    sampling: SamplingParams
    """Sampling for every request of this set."""
    n_samples: int
    """Samples per prompt."""
    pass_k: list[int]
    """pass@k values to report."""
    threshold: float
    """Reward at or above which a sample is correct."""
    every: int
    """Evaluate every N RL steps (and at RL step 0 and the last step); 0: never."""

    @property
    def prefix(self) -> str:
        """Metric name prefix (``eval/`` or ``eval/<name>/``)."""
        return "eval/" if self.name is None else f"eval/{self.name}/"

    def due(self, step: int, last_step: int) -> bool:
        """Whether this set is evaluated after RL step ``step`` (0 = before any update)."""
        if not self.every:  # 0 disables the set (step 0 included), as the docs say
            return False
        if step == 0:
            return True
        return step % self.every == 0 or step == last_step

    def metrics(self, groups: Sequence[Group]) -> dict[str, float]:
        """Reward mean, accuracy, pass@k and per-component means of scored groups.

        Failed rollouts score 0 and count as incorrect (the convention of every reward mean
        the trainer shows, ``rollout/reward_mean`` too); ``failed_fraction`` is their share. A
        prompt whose ``generate_fn`` failed (no rollouts) counts as ``n_samples`` failed
        samples.
        """
        summary = summarize_eval(
            [[r.reward for r in g.rollouts] or [None] * self.n_samples for g in groups],
            ks=self.pass_k,
            threshold=self.threshold,
        )
        out = {f"{self.prefix}{k}": v for k, v in summary.items()}
        total = sum(len(g.rollouts) or self.n_samples for g in groups)
        if total:
            scored = sum(1 for g in groups for r in g.rollouts if r.reward is not None)
            out[f"{self.prefix}failed_fraction"] = (total - scored) / total
        rollouts = [r for g in groups for r in g.rollouts]
        for key in sorted({k for r in rollouts for k in r.reward_info} - {"reward"}):
            values = [r.reward_info.get(key, 0.0) for r in rollouts]
            out[f"{self.prefix}{key}_mean"] = math.fsum(values) / len(values)
        return out


def _take_prompts(source: DataSource, max_prompts: int | None) -> list[Prompt]:
    n = len(source) if max_prompts is None else min(max_prompts, len(source))
    return source.next_prompts(n)


def build_eval_sets(
    cfg: EvalConfig,
    *,
    default_source: DataSource | None,
    default_reward: RewardFn,
    tokenizer: Tokenizer,
    train_sampling: SamplingConfig | None = None,
    default_reward_name: str = "reward",
) -> list[EvalSet]:
    """Resolve the eval section: the default held-out set (when there is a source) and every
    ``cfg.datasets`` entry, building their data sources and rewards through the registry.

    Sampling fields a set leaves unset follow ``train_sampling`` (``rollout.sampling``; its
    defaults when ``None``), the temperature excepted (greedy unless set).
    """
    train = train_sampling if train_sampling is not None else SamplingConfig()
    sets: list[EvalSet] = []
    if default_source is not None:
        sets.append(
            EvalSet(
                name=None,
                prompts=_take_prompts(default_source, cfg.max_prompts),
                scorer=Scorer(default_reward, tokenizer, reward_name=default_reward_name),
                sampling=cfg.sampling.resolve(train).to_params(),
                n_samples=cfg.n_samples,
                pass_k=list(cfg.pass_k),
                threshold=cfg.correct_threshold,
                every=cfg.every,
            )
        )
    for i, ds in enumerate(cfg.datasets):
        where = f"eval.datasets[{i}]"
        source = registry.build("data_source", ds.data, field=f"{where}.data", tokenizer=tokenizer)
        reward, reward_name = default_reward, default_reward_name
        if ds.reward is not None:
            reward = build_callable("reward", ds.reward, RewardFn, field=f"{where}.reward")
            reward_name = component_name(f"{where}.reward", ds.reward)
        sets.append(
            EvalSet(
                name=ds.name,
                prompts=_take_prompts(source, ds.max_prompts),
                scorer=Scorer(reward, tokenizer, reward_name=reward_name),
                sampling=ds.sampling.resolve(train, cfg.sampling).to_params(),
                n_samples=ds.n_samples if ds.n_samples is not None else cfg.n_samples,
                pass_k=list(ds.pass_k if ds.pass_k is not None else cfg.pass_k),
                threshold=(
                    ds.correct_threshold
                    if ds.correct_threshold is not None
                    else cfg.correct_threshold
                ),
                every=ds.every if ds.every is not None else cfg.every,
            )
        )
    return sets
