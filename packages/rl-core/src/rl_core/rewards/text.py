"""Text rewards: exact match, token-level F1 and regex format checks.

Semantics (all return a float in [0, 1]):

- :class:`ExactMatch`: 1 when the (normalised, optionally extracted) answer equals one of the
  reference answers in ``Prompt.label``, else 0.
- :class:`F1`: SQuAD-style token F1 between the answer and the best-matching reference, tokens
  being whitespace-separated words after normalisation. Both empty -> 1; one empty -> 0.
- :class:`FormatMatch`: 1 when the response matches a regex (``search`` anywhere, or
  ``fullmatch`` the whole response), else 0. It needs no label; combine it with a correctness
  reward through :class:`~rl_core.rewards.combine.Combine`.

Garbage responses (non-strings, no match for ``answer_pattern``) score 0. A prompt without a
label is a configuration problem and raises :class:`~rl_core.errors.RewardError` (the trainer
marks that rollout failed and counts it). Invalid options raise
:class:`~rl_core.errors.ConfigError` when the reward is built.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

from rl_core.rewards._common import compile_pattern, extract, labels_of, normalise
from rl_core.types import Prompt, Rollout

__all__ = ["F1", "ExactMatch", "FormatMatch", "f1_score"]


class ExactMatch:
    """1.0 when the response's answer equals a reference answer in ``Prompt.label``, else 0.0.

    Registered as ``exact_match``. Example: with the default config, response ``"  Paris "``
    and label ``["paris", "Paris, France"]`` score 1.0; ``"Lyon"`` scores 0.0.
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Normalisation and extraction options of :class:`ExactMatch` (applied to both sides)."""

        strip: bool = True
        """Ignore leading and trailing whitespace."""
        case_sensitive: bool = False
        """Compare case-sensitively (``False``: ``casefold`` both sides)."""
        collapse_whitespace: bool = True
        """Treat any whitespace run (spaces, tabs, newlines) as one space."""
        answer_pattern: str | None = None
        """Regex that extracts the answer from the response (its last match; group 1 if it has
        a group), e.g. ``"Answer:\\\\s*(.+)"``; no match scores 0. ``None``: the whole response."""

        def __post_init__(self) -> None:
            compile_pattern(self.answer_pattern, "reward.answer_pattern")

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or ExactMatch.Config()
        self._pattern = compile_pattern(self.config.answer_pattern, "reward.answer_pattern")

    def _norm(self, text: str) -> str:
        c = self.config
        return normalise(
            text,
            strip=c.strip,
            case_sensitive=c.case_sensitive,
            collapse_whitespace=c.collapse_whitespace,
        )

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout | None = None) -> float:
        """Score one response (see the class docstring)."""
        labels = labels_of(prompt, "exact_match")
        if not isinstance(response, str):
            return 0.0
        answer = extract(response, self._pattern)
        if answer is None:
            return 0.0
        got = self._norm(answer)
        return 1.0 if any(got == self._norm(lab) for lab in labels) else 0.0


def f1_score(prediction: str, reference: str) -> float:
    """Token F1 of two whitespace-tokenised strings (multiset overlap).

    ``f1_score("the cat sat", "a cat sat down")``: overlap 2 ("cat", "sat"), precision 2/3,
    recall 2/4, F1 = 2 * (2/3 * 1/2) / (2/3 + 1/2) = 4/7.
    """
    p, r = prediction.split(), reference.split()
    if not p or not r:
        return 1.0 if not p and not r else 0.0
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


class F1:
    """Token-level F1 between the response's answer and the best reference in ``Prompt.label``.

    Registered as ``f1``.
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Normalisation options of :class:`F1` (applied to both sides before splitting)."""

        case_sensitive: bool = False
        """Compare tokens case-sensitively."""
        strip_punctuation: bool = True
        """Remove ASCII punctuation before splitting (``"Paris."`` matches ``"paris"``)."""
        answer_pattern: str | None = None
        """Regex extracting the answer (last match; group 1 if any); no match scores 0."""

        def __post_init__(self) -> None:
            compile_pattern(self.answer_pattern, "reward.answer_pattern")

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or F1.Config()
        self._pattern = compile_pattern(self.config.answer_pattern, "reward.answer_pattern")

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout | None = None) -> float:
        """Score one response (see the class docstring)."""
        labels = labels_of(prompt, "f1")
        if not isinstance(response, str):
            return 0.0
        answer = extract(response, self._pattern)
        if answer is None:
            return 0.0
        c = self.config

        def norm(s: str) -> str:
            return normalise(
                s, case_sensitive=c.case_sensitive, strip_punctuation=c.strip_punctuation
            )

        return max(f1_score(norm(answer), norm(lab)) for lab in labels)


class FormatMatch:
    """1.0 when the response matches ``Config.pattern``, else 0.0; needs no label.

    Registered as ``format_match``. Example: ``pattern = "<think>.*</think>\\\\s*<answer>.*</answer>"``
    with ``mode = "fullmatch"`` and ``dotall = True`` checks a reasoning format.
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`FormatMatch`."""

        pattern: str
        """The regular expression (Python ``re`` syntax)."""
        mode: Literal["search", "fullmatch"] = "search"
        """``search``: match anywhere in the response; ``fullmatch``: the whole response."""
        ignore_case: bool = False
        """``re.IGNORECASE``."""
        dotall: bool = False
        """``re.DOTALL``: ``.`` also matches newlines."""
        multiline: bool = False
        """``re.MULTILINE``: ``^``/``$`` match at line boundaries."""

        def __post_init__(self) -> None:
            from rl_core.errors import ConfigError

            if self.mode not in ("search", "fullmatch"):
                raise ConfigError(
                    f"reward.mode: {self.mode!r} is not allowed; choose 'search' or 'fullmatch'."
                )
            compile_pattern(self.pattern, "reward.pattern")

        def flags(self) -> int:
            """The ``re`` flags selected."""
            return (
                (re.IGNORECASE if self.ignore_case else 0)
                | (re.DOTALL if self.dotall else 0)
                | (re.MULTILINE if self.multiline else 0)
            )

    def __init__(self, config: Config) -> None:
        self.config = config
        self._pattern = compile_pattern(config.pattern, "reward.pattern", config.flags())

    def __call__(self, prompt: Any, response: str, rollout: Rollout | None = None) -> float:
        """Score one response (see the class docstring)."""
        if not isinstance(response, str) or self._pattern is None:
            return 0.0
        match = (
            self._pattern.fullmatch(response)
            if self.config.mode == "fullmatch"
            else self._pattern.search(response)
        )
        return 1.0 if match else 0.0
