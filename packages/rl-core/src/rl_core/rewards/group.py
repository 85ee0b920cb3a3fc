"""Group rewards (:class:`~rl_core.interfaces.GroupRewardFn`): score all rollouts of a prompt
together.

:class:`MajorityVote` is a label-free reward in the style of test-time RL (TTRL): the answers
of a group vote, and a rollout scores 1 when its answer is the group's majority answer. With
answers ``["19", "19", "18", "19 "]`` (normalised: ``"19"`` x3, ``"18"`` x1) the rewards are
``[1, 1, 0, 1]``. Semantics:

- the answer of a response is the last match of ``answer_pattern`` (group 1 if it has one), or
  the whole response, normalised like :class:`~rl_core.rewards.text.ExactMatch`;
- a response without an answer (no match, empty, not a string) scores 0 and does not vote;
- the majority answer must be strictly more frequent than every other answer (a tie at the top
  means no consensus: all 0), and hold at least ``min_share`` of the whole group;
- each rollout also gets ``agreement``: the share of the group that gave its answer.

Group rewards are called as ``fn(prompt, responses, rollouts)`` and return one value per
rollout, in order.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from rl_core.config import Probability
from rl_core.errors import ConfigError, RewardError
from rl_core.rewards._common import compile_pattern, extract, normalise
from rl_core.types import Prompt, Rollout

__all__ = ["MajorityVote"]


class MajorityVote:
    """Label-free majority-vote group reward (see the module docstring)."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`MajorityVote`."""

        answer_pattern: str | None = None
        """Regex extracting the answer (last match; group 1 if any); ``None``: whole response."""
        case_sensitive: bool = False
        """Compare answers case-sensitively."""
        min_share: Probability = 0.0
        """Minimum share of the group (0..1) the majority answer must have to count."""

        def __post_init__(self) -> None:
            if not (0.0 <= self.min_share <= 1.0) or math.isnan(self.min_share):
                raise ConfigError(f"reward.min_share: must be in [0, 1], got {self.min_share}.")
            compile_pattern(self.answer_pattern, "reward.answer_pattern")

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or MajorityVote.Config()
        self._pattern = compile_pattern(self.config.answer_pattern, "reward.answer_pattern")

    def _answer(self, response: object) -> str | None:
        if not isinstance(response, str):
            return None
        raw = extract(response, self._pattern)
        if raw is None:
            return None
        ans = normalise(raw, case_sensitive=self.config.case_sensitive)
        return ans or None

    def __call__(
        self, prompt: Prompt, responses: Sequence[str], rollouts: Sequence[Rollout]
    ) -> list[dict[str, float]]:
        """One ``{"reward", "agreement"}`` per response, in order."""
        if isinstance(responses, str) or len(responses) != len(rollouts):
            raise RewardError(
                "majority_vote is a group reward: call it with the group's responses and "
                "rollouts (two sequences of equal length), not as a per-rollout RewardFn."
            )
        n = len(responses)
        answers = [self._answer(r) for r in responses]
        counts = Counter(a for a in answers if a is not None)
        top = counts.most_common(2)
        winner = None
        unique_top = bool(top) and (len(top) == 1 or top[0][1] > top[1][1])
        if unique_top and top[0][1] / n >= self.config.min_share:
            winner = top[0][0]
        return [
            {
                "reward": 1.0 if a is not None and a == winner else 0.0,
                "agreement": counts[a] / n if a is not None else 0.0,
            }
            for a in answers
        ]
