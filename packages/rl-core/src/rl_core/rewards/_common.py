"""Helpers shared by the reward functions: label access, answer extraction, normalisation."""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

from rl_core.errors import ConfigError, RewardError


def compile_pattern(pattern: str | None, field: str, flags: int = 0) -> re.Pattern[str] | None:
    """Compile a user regex, naming the config field when it is invalid."""
    if pattern is None:
        return None
    try:
        return re.compile(pattern, flags)
    except re.error as e:
        raise ConfigError(f"{field}: invalid regular expression {pattern!r}: {e}.") from None


def extract(text: str, pattern: re.Pattern[str] | None) -> str | None:
    """The answer in ``text``: the last match of ``pattern`` (group 1 if it has groups), the
    whole text without a pattern, or ``None`` when the pattern does not match."""
    if pattern is None:
        return text
    last = None
    for m in pattern.finditer(text):
        last = m
    if last is None:
        return None
    return last.group(1) if pattern.groups else last.group(0)


def labels_of(prompt: Any, reward: str) -> list[str]:
    """``prompt.label`` as a list of acceptable answers (a str/number, or a list of them).

    Raises :class:`RewardError` when the prompt has no usable label: the reward is configured for
    a dataset without reference answers.
    """
    label = getattr(prompt, "label", None)
    uid = getattr(prompt, "uid", "?")
    items: Sequence[Any] = label if isinstance(label, list | tuple) else [label]
    out = [str(x) for x in items if x is not None and isinstance(x, str | int | float)]
    if not out:
        raise RewardError(
            f"{reward}: prompt {uid!r} has label {label!r}; this reward needs a reference answer "
            "(a string or number, or a list of them) in Prompt.label. Set the dataset's label "
            "field, or use a label-free reward."
        )
    return out


_WS = re.compile(r"\s+")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalise(
    text: str,
    *,
    strip: bool = True,
    case_sensitive: bool = False,
    collapse_whitespace: bool = True,
    strip_punctuation: bool = False,
) -> str:
    """Normalise text for comparison (each step optional, applied in this order): drop
    punctuation, lower-case, collapse whitespace runs to one space, strip the ends."""
    if strip_punctuation:
        text = text.translate(_PUNCT)
    if not case_sensitive:
        text = text.casefold()
    if collapse_whitespace:
        text = _WS.sub(" ", text)
    if strip:
        text = text.strip()
    return text
