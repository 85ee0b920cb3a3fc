"""Reward functions with documented semantics, ready to name in a recipe.

Every reward here is a :class:`~rl_core.interfaces.RewardFn` ``(prompt, response, rollout) ->
float | Mapping[str, float]`` (some are async), built from a nested ``Config`` and registered in
the ``rl.rewards`` entry-point group, so a recipe says ``reward: {type: exact_match,
answer_pattern: "Answer: (.+)"}``:

============== ============================================== ===================================
name           class                                          returns
============== ============================================== ===================================
exact_match    :class:`~rl_core.rewards.text.ExactMatch`      1/0: normalised answer == a label
math_equiv     :class:`~rl_core.rewards.math_answer.MathEquiv` 1/0: math-verify equivalence
f1             :class:`~rl_core.rewards.text.F1`              token F1 in [0, 1] vs the best label
format_match   :class:`~rl_core.rewards.text.FormatMatch`     1/0: regex search / full match
remote         :class:`~rl_core.rewards.remote.RemoteReward`  an HTTP reward model's answer
combine        :class:`~rl_core.rewards.combine.Combine`      weighted sum + every component
============== ============================================== ===================================

:class:`~rl_core.rewards.group.MajorityVote` is a :class:`~rl_core.interfaces.GroupRewardFn`
example (label-free majority vote over a group). :class:`~rl_core.rewards.shaping.OverlongPenalty`
shapes a reward after it was computed (DAPO's soft overlong punishment; the trainer's
``rollout.overlong_penalty``).

Rules they all follow: a wrong or unparsable response scores 0 (never an exception); an error
is raised only for misconfiguration (:class:`~rl_core.errors.ConfigError` when built, or
:class:`~rl_core.errors.RewardError` e.g. for a prompt without the label the reward needs) and
for remote failures, and the trainer turns those into a counted, failed rollout.

Optional dependencies are imported lazily: ``math_equiv`` needs ``math-verify`` (extra
``rlpost-core[math]``) only when it is built; nothing here imports it at module import.
"""

from __future__ import annotations

from rl_core.rewards.combine import Combine, CombineComponent
from rl_core.rewards.group import MajorityVote
from rl_core.rewards.math_answer import MathEquiv
from rl_core.rewards.remote import RemoteReward
from rl_core.rewards.shaping import OverlongPenalty, overlong_penalty
from rl_core.rewards.text import F1, ExactMatch, FormatMatch, f1_score

__all__ = [
    "F1",
    "Combine",
    "CombineComponent",
    "ExactMatch",
    "FormatMatch",
    "MajorityVote",
    "MathEquiv",
    "OverlongPenalty",
    "RemoteReward",
    "f1_score",
    "overlong_penalty",
]
