"""A rollout function that calls two server groups of an :class:`~rl_sglang.SGLangTopology`.

The policy group (the topology's default group, through ``ctx.generator``) samples the answers;
a second group, named by ``judge_group`` and serving a fixed model, then continues every
prompt + answer greedily for ``judge_tokens`` tokens, its verdict. The verdict goes into
``rollout.metadata["judge"]`` (tokens, the group, the judge's weight version), where a reward
function can read it (``rollout.metadata``) or ``rl-train show`` displays it::

    rollout:
      generate_fn: {type: "rl_sglang.examples.judged:JudgedRollout", judge_group: judge}

Recipe: ``rl-train run sglang_topology``. Only the answers are trained on (the verdict tokens
are not part of the rollout).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rl_core.config import PositiveInt
from rl_core.errors import ConfigError
from rl_core.interfaces import RolloutContext
from rl_core.types import FinishReason, GenerationRequest, Prompt, Rollout, SamplingParams

__all__ = ["JudgedRollout"]


class JudgedRollout:
    """GenerateFn: answers from the policy group, a verdict on each from another group."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`JudgedRollout`."""

        judge_group: str = "judge"
        """The topology group that judges the answers (``generator.groups[*].name``)."""
        judge_tokens: PositiveInt = 4
        """Greedy tokens of each verdict."""

    def __init__(self, config: JudgedRollout.Config | None = None) -> None:
        """Keep the settings; the groups come from ``ctx.generator`` at every call."""
        self.config = config or JudgedRollout.Config()

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """``ctx.n_samples`` rollouts of ``prompt``, each with its verdict in its metadata."""
        group = getattr(ctx.generator, "group", None)
        if group is None:
            raise ConfigError(
                f"rollout.generate_fn (JudgedRollout): the generator "
                f"{type(ctx.generator).__name__} has no server groups; use generator type "
                f"sglang_topology with a group named {self.config.judge_group!r}."
            )
        judge = group(self.config.judge_group)
        seed = ctx.sampling.seed
        answers = await ctx.generator.generate(
            [
                GenerationRequest(
                    request_id=f"{prompt.uid}/{j}",
                    input_ids=tuple(prompt.token_ids),
                    sampling=dataclasses.replace(
                        ctx.sampling, seed=None if seed is None else seed + j
                    ),
                    return_routing=ctx.return_routing,
                )
                for j in range(ctx.n_samples)
            ]
        )
        verdicts = await judge.generate(
            [
                GenerationRequest(
                    request_id=f"{prompt.uid}/{j}/judge",
                    input_ids=(*prompt.token_ids, *a.output_ids),
                    sampling=SamplingParams(
                        temperature=0.0, max_new_tokens=self.config.judge_tokens
                    ),
                )
                for j, a in enumerate(answers)
            ]
        )
        return [
            _rollout(prompt, a, {"group": self.config.judge_group, **_verdict(v)})
            for a, v in zip(answers, verdicts)
        ]


def _verdict(result: Any) -> dict[str, Any]:
    return {
        "tokens": list(result.output_ids),
        "weight_version": result.weight_version,
        "finish": result.finish_reason.value,
    }


def _rollout(prompt: Prompt, result: Any, judge: dict[str, Any]) -> Rollout:
    """The single-turn rollout of ``result`` (token-in/token-out), with the verdict."""
    n = len(result.output_ids)
    metadata: dict[str, Any] = {"judge": judge}
    if result.finish_reason == FinishReason.ERROR:
        metadata["failure"] = "generation_error"
    return Rollout(
        prompt_uid=prompt.uid,
        rollout_id=result.request_id,
        sample_id=result.request_id,
        tokens=(*prompt.token_ids, *result.output_ids),
        response_start=len(prompt.token_ids),
        loss_mask=(1,) * n,
        rollout_logprobs=tuple(result.output_logprobs),
        versions=(result.weight_version,) * n,
        status=result.finish_reason.to_status(),
        metadata=metadata,
    )
