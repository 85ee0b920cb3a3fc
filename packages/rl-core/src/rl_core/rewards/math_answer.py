"""Math answer equivalence with the maintained ``math-verify`` library (extra ``rlpost-core[math]``).

:class:`MathEquiv` parses the reference answer (``Prompt.label``) and the response with
``math_verify.parse`` (LaTeX, ``\\boxed{}``, plain expressions) and compares them symbolically
and numerically with ``math_verify.verify``: ``"\\boxed{\\frac{1}{2}}"`` equals the label
``"0.5"``; ``"x = 19"`` equals ``"19"``. Returns 1.0 when equivalent, else 0.0.

``math_verify`` is imported when the reward is built, never when :mod:`rl_core` or
:mod:`rl_core.rewards` is imported. Without it, building the reward raises
:class:`~rl_core.errors.RewardError` saying how to install it.

Semantics: a response that cannot be parsed (garbage, no answer) scores 0. A label that cannot
be parsed raises :class:`~rl_core.errors.RewardError` naming the prompt (the dataset is wrong,
not the model). ``math_verify`` bounds its own parsing and comparison time with ``SIGALRM``,
which only works in the main thread; in any other thread the reward runs without that timeout.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from rl_core.config import NonNegInt, PositiveInt
from rl_core.errors import ConfigError, RewardError
from rl_core.rewards._common import labels_of
from rl_core.types import Prompt, Rollout

log = logging.getLogger(__name__)

__all__ = ["MathEquiv"]


class MathEquiv:
    """1.0 when the response's final answer is mathematically equivalent to ``Prompt.label``.

    Registered as ``math_equiv``. A list label accepts any of its answers.
    """

    main_thread: ClassVar[bool] = True
    """Call it on the main thread: math-verify's ``timeout_seconds`` is a ``SIGALRM`` alarm,
    which works only there (the trainer runs other synchronous rewards in a worker thread it
    can abandon, :mod:`rl_buffer.bounded`)."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`MathEquiv` (passed to ``math_verify``)."""

        float_rounding: NonNegInt = 6
        """Decimal places numbers are rounded to before comparison."""
        strict: bool = True
        """``math_verify``'s strict mode: variables and relations must match too (``x = 1`` vs
        ``1`` only compares the right-hand side when ``False``)."""
        timeout_seconds: PositiveInt | None = 5
        """Time limit for parsing and for comparison, each (main thread only); ``None``: none."""

        def __post_init__(self) -> None:
            if self.float_rounding < 0:
                raise ConfigError(
                    f"reward.float_rounding: must be >= 0, got {self.float_rounding}."
                )
            if self.timeout_seconds is not None and self.timeout_seconds < 1:
                raise ConfigError(
                    f"reward.timeout_seconds: must be >= 1 or None, got {self.timeout_seconds}."
                )

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or MathEquiv.Config()
        try:
            import math_verify
        except ImportError as e:
            raise RewardError(
                f"math_equiv needs the math-verify package ({e}); install it with "
                "`pip install 'rlpost-core[math]'`."
            ) from None
        self._mv = math_verify
        self._gold_cache: dict[str, list[Any]] = {}
        self.errors: dict[str, int] = {"parse": 0, "verify": 0}
        """How many ``math_verify`` calls raised, by kind (``parse``: the text counts as
        unparsable; ``verify``: the answer counts as not shown equal). The first of each kind is
        logged as a warning with its error, later ones at debug level."""

    def _record_error(self, kind: str, error: Exception, text: str) -> None:
        self.errors[kind] += 1
        level = logging.WARNING if self.errors[kind] == 1 else logging.DEBUG
        log.log(
            level,
            "math_equiv: math_verify.%s raised on %r (%s: %s); scored as %s (further ones are "
            "logged at debug level and counted in MathEquiv.errors)",
            kind,
            text[:200],
            type(error).__name__,
            error,
            "unparsable" if kind == "parse" else "not equal",
        )

    def _timeout(self) -> int | None:
        if threading.current_thread() is not threading.main_thread():
            return None
        return self.config.timeout_seconds

    def _parse(self, text: str) -> list[Any]:
        try:
            return list(self._mv.parse(text, parsing_timeout=self._timeout()))
        except (
            Exception
        ) as e:  # math_verify reports unparsable input as [] but may raise on odd input
            self._record_error("parse", e, text)
            return []

    def _gold(self, label: str, prompt: Any) -> list[Any]:
        if label not in self._gold_cache:
            parsed = self._parse(label)
            if not parsed:
                # A bare number or expression without LaTeX delimiters: try it in math mode.
                parsed = self._parse(f"${label}$")
            if not parsed:
                raise RewardError(
                    f"math_equiv: the label {label!r} of prompt {getattr(prompt, 'uid', '?')!r} "
                    "cannot be parsed by math-verify; write it as a number, an expression or "
                    "LaTeX (e.g. '\\frac{1}{2}')."
                )
            self._gold_cache[label] = parsed
        return self._gold_cache[label]

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout | None = None) -> float:
        """Score one response (see the module docstring)."""
        labels = labels_of(prompt, "math_equiv")
        golds = [self._gold(lab, prompt) for lab in labels]
        if not isinstance(response, str) or not response.strip():
            return 0.0
        answer = self._parse(response)
        if not answer:
            return 0.0
        for gold in golds:
            try:
                ok = self._mv.verify(
                    gold,
                    answer,
                    float_rounding=self.config.float_rounding,
                    strict=self.config.strict,
                    timeout_seconds=self._timeout(),
                )
            except Exception as e:  # a comparison math_verify cannot do means "not shown equal"
                self._record_error("verify", e, response)
                ok = False
            if ok:
                return 1.0
        return 0.0
