"""One prompt, many samples: a main agent that delegates to sub-agents, each sub-agent's
trajectory its own training sample, all linked by one ``rollout_id``.

Per sample ``k`` of a prompt (one *episode*):

1. the main agent answers the prompt (model tokens, loss mask 1);
2. it calls ``n`` sub-agents, ``n`` decided by what it sampled (``sum(output_ids) %
   (max_subagents + 1)``, so it varies from episode to episode like a real agent's choice).
   Each sub-agent is a fresh conversation (its own prompt, its own tokens): a separate
   :class:`~rl_agents.trajectory.TrajectoryBuilder`. Its answer comes back to the main agent as
   observation tokens (mask 0);
3. the main agent writes its final answer; the episode's reward scores it against
   ``prompt.label`` (``scorer``, default: fraction of characters in the right position);
4. :func:`~rl_agents.trajectory.siblings` turns main + sub-agents into ``1 + n`` rollouts sharing
   ``rollout_id = "<prompt uid>/<k>"``, each with ``metadata["session_reward"]`` (train with
   ``reward: {type: session_reward}``) and ``metadata["subagents"] = n``.

So the number of training samples per step varies. How the trainer treats siblings: the
advantage baseline counts each episode once (one entry per ``rollout_id``, the siblings'
tokens end to end), every sibling gets its episode's advantage; with ``algorithm.aggregation:
rollout`` the loss is normalised *per episode* (each episode weighs the same, its tokens
averaged across its siblings), not per sample; the FLOPs balancer puts all siblings of an
episode on the same data-parallel rank, and they always train in the same step (a group moves
as a whole).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from rl_agents.trajectory import TrajectoryBuilder, siblings
from rl_core.config import NonNegInt, PositiveInt
from rl_core.errors import ConfigError, RewardError
from rl_core.interfaces import RolloutContext
from rl_core.types import Prompt, Rollout

__all__ = ["SubAgentRollout", "position_score"]


def position_score(prompt: Prompt, response: str, rollout: Rollout | None = None) -> float:
    """Fraction of positions where ``response`` (stripped) equals ``str(prompt.label)``, over
    the longer of the two (1.0 only for an exact match)."""
    target, text = str(prompt.label), response.strip()
    if not target and not text:
        return 1.0
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target))


class SubAgentRollout:
    """GenerateFn: ``ctx.n_samples`` episodes per prompt, each 1 + n sibling samples; see the
    module docstring."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`SubAgentRollout`."""

        max_subagents: NonNegInt = 2
        """Sub-agents per episode at most."""
        subagent_prompt: str = "Sub-task {j} of {uid}:"
        """The text of a sub-agent's prompt (``{j}``: its index, ``{uid}``: the prompt uid)."""
        max_length: PositiveInt = 256
        """Token budget of the main trajectory."""
        scorer: str | None = None
        """``"module:attr"`` of ``fn(prompt, final_answer, rollout) -> float`` scoring the
        main agent's final answer; default :func:`position_score` against the label."""

        def __post_init__(self) -> None:
            if "{j}" not in self.subagent_prompt:
                raise ConfigError(
                    "generate_fn.subagent_prompt: must contain '{j}' (the sub-agent index), got "
                    f"{self.subagent_prompt!r}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or SubAgentRollout.Config()
        self._score: Any = position_score
        if self.config.scorer is not None:
            from rl_core.registry import load_object

            self._score = load_object(self.config.scorer)

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """All siblings of ``ctx.n_samples`` episodes."""
        runs = await asyncio.gather(*(self._episode(prompt, ctx, k) for k in range(ctx.n_samples)))
        return [r for rs in runs for r in rs]

    async def _episode(self, prompt: Prompt, ctx: RolloutContext, k: int) -> list[Rollout]:
        c, tok = self.config, ctx.tokenizer
        rid = f"{prompt.uid}/{k}"

        def sampling(turn: int):
            sp = ctx.sampling
            if sp.seed is not None:
                sp = dataclasses.replace(
                    sp, seed=(sp.seed * 1_000_003 + k * 1_009 + turn) & 0x7FFFFFFF
                )
            return sp

        main = TrajectoryBuilder(
            prompt.token_ids,
            TrajectoryBuilder.Config(max_length=c.max_length),
            version=ctx.policy_version,
        )
        first = await ctx.generate(
            main.input_ids, main.clamp(sampling(0)), request_id=f"{rid}/main/0"
        )
        main.append_model(first)
        n = sum(first.output_ids) % (c.max_subagents + 1)
        subs: list[TrajectoryBuilder] = []
        for j in range(n):
            if main.is_full:
                break
            text = c.subagent_prompt.format(j=j, uid=prompt.uid)
            sub = TrajectoryBuilder(
                tok.encode(text, add_special_tokens=False), version=ctx.policy_version
            )
            res = await ctx.generate(sub.input_ids, sampling(100 + j), request_id=f"{rid}/sub/{j}")
            sub.append_model(res)
            subs.append(sub)
            main.append_text(f"\n[sub-agent {j}: {len(res.output_ids)} tokens]\n", tok)
        final = None
        if not main.is_full:
            final = await ctx.generate(
                main.input_ids, main.clamp(sampling(1)), request_id=f"{rid}/main/1"
            )
            main.append_model(final)
        answer = tok.decode(list((final or first).output_ids), skip_special_tokens=True)
        value = self._score(prompt, answer, None)
        if inspect.isawaitable(value):
            value = await value
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RewardError(f"generate_fn.scorer returned {value!r}; expected a float.")
        meta = {"subagents": len(subs), "session_reward": float(value)}
        return siblings([main, *subs], prompt_uid=prompt.uid, rollout_id=rid, metadata=meta)
