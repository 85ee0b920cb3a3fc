"""Evaluation statistics over sampled groups: mean reward and unbiased pass@k.

``pass@k`` is the probability that at least one of ``k`` samples drawn without replacement
from the ``n`` a prompt received is correct, estimated without bias from the ``c`` correct
ones (Chen et al., 2021, "Evaluating Large Language Models Trained on Code")::

    pass@k = 1 - C(n - c, k) / C(n, k)

averaged over prompts. A sample counts as correct when its reward is at least a threshold;
a failed sample (reward ``None``) counts as incorrect.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from rl_core.errors import ConfigError

__all__ = ["pass_at_k", "summarize_eval"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with ``n`` samples of which ``c`` are correct.

    Raises :class:`~rl_core.errors.ConfigError` when ``k`` is not in ``1..n`` or ``c`` is not
    in ``0..n``.
    """
    if not 1 <= k <= n:
        raise ConfigError(f"pass@k: k must be in 1..n_samples ({n}), got {k}.")
    if not 0 <= c <= n:
        raise ConfigError(f"pass@k: correct count {c} is outside 0..{n}.")
    if n - c < k:
        return 1.0
    # 1 - prod_{i=n-c+1}^{n} (1 - k / i): numerically stable form of the binomial ratio.
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def summarize_eval(
    rewards_per_prompt: Iterable[Sequence[float | None]],
    *,
    ks: Sequence[int] = (),
    threshold: float = 1.0,
) -> dict[str, float]:
    """Mean reward, mean per-prompt accuracy and pass@k over prompts.

    ``rewards_per_prompt`` holds one sequence of sample rewards per prompt (``None`` for a
    failed sample, scored 0 and incorrect). Returns ``reward_mean``, ``accuracy`` (fraction of
    samples with reward >= ``threshold``) and ``pass@k`` for each ``k`` in ``ks``. Every prompt
    must have at least ``max(ks)`` samples.
    """
    groups = [list(g) for g in rewards_per_prompt]
    if not groups:
        return {}
    flat = [0.0 if r is None else float(r) for g in groups for r in g]
    correct = [sum(1 for r in g if r is not None and float(r) >= threshold) for g in groups]
    out = {
        "reward_mean": math.fsum(flat) / len(flat),
        "accuracy": sum(correct) / len(flat),
    }
    for k in sorted(set(ks)):
        out[f"pass@{k}"] = math.fsum(
            pass_at_k(len(g), c, k) for g, c in zip(groups, correct)
        ) / len(groups)
    return out
