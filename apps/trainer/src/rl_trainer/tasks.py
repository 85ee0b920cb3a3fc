"""Built-in verifiable tasks for demos and tests: they write their own train/eval split and
score responses exactly.

- ``reverse``: ``"abcd="`` -> ``"dcba"``; reward = fraction of positions right (exact match 1).
- ``addition``: ``"12+7="`` -> ``"19"``; reward = fraction of answer digits right.
- ``calculator`` (tool use): ``"23*47="``; the model calls the calculator tool and answers,
  ``"CALC: 23*47\n= 1081\nANSWER: 1081"`` (the ``= 1081`` line is the tool's observation);
  reward = fraction of answer digits right. Run it with
  :class:`rl_agents.examples.calculator.CalculatorRollout` as the rollout.

Both use plain-text prompts (no chat template) so a tiny model spends its capacity on the task.
A task is a class with a nested ``Config``, registered under the ``rl.tasks`` entry-point group.
"""

from __future__ import annotations

import abc
import itertools
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from rl_core.config import NonNegInt, PositiveInt, Probability, Seed
from rl_core.errors import ConfigError
from rl_core.splits import held_out_split, write_jsonl_splits
from rl_core.types import Prompt, Rollout

__all__ = ["AdditionTask", "CalculatorTask", "ReverseTask", "Task", "position_match"]


def position_match(response: str, target: str) -> float:
    """Fraction of positions where ``response`` equals ``target``, over the longer of the two
    (so extra or missing characters cost). 1.0 only for an exact match."""
    if not target and not response:
        return 1.0
    hits = sum(a == b for a, b in zip(response, target))
    return hits / max(len(response), len(target))


class Task(abc.ABC):
    """A verifiable task: data splits it generates itself and a reward function."""

    @abc.abstractmethod
    def examples(self, split: str) -> list[dict[str, Any]]:
        """The examples of ``split`` ("train" or "eval"): dicts with ``prompt`` and ``label``."""

    @abc.abstractmethod
    def score(self, response: str, label: Any) -> dict[str, float]:
        """Reward components; ``reward`` is the one trained on."""

    def write_splits(self, directory: str | Path) -> dict[str, Path]:
        """Write ``train.jsonl`` and ``eval.jsonl`` (idempotent) and return their paths."""
        return write_jsonl_splits(directory, self.examples)

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> dict[str, float]:
        """RewardFn: score the decoded response against the prompt's label."""
        return self.score(response.strip(), prompt.label)


def _split(make, n_train: int, n_eval: int, seed: int) -> dict[str, list]:
    """``n_eval`` distinct held-out examples, then ``n_train`` others, drawn by ``make`` from
    one generator seeded by ``seed``."""
    rng = random.Random(seed)
    draws = (make(rng) for _ in itertools.count())
    evals, train = held_out_split(draws, draws, n_eval=n_eval, n_train=n_train)
    return {"train": train, "eval": evals}


class ReverseTask(Task):
    """Reverse a short string of letters: ``"abcd="`` -> ``"dcba"``."""

    inline: ClassVar[bool] = True
    """Scored inline on the event loop, not in the reward worker thread: the score is string
    arithmetic on one response, quick and bounded (:mod:`rl_buffer.bounded`)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the reverse task."""

        n_train: PositiveInt = 4000
        """Training examples."""
        n_eval: PositiveInt = 128
        """Held-out examples (never in the training split)."""
        min_len: PositiveInt = 3
        """Shortest string."""
        max_len: PositiveInt = 6
        """Longest string."""
        alphabet: str = "abcdefghij"
        """Letters to draw from."""
        seed: Seed = 1234
        """Seed of the data (independent of the run seed, so splits are stable)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        c = config

        def make(rng: random.Random) -> dict[str, Any]:
            n = rng.randint(c.min_len, c.max_len)
            s = "".join(rng.choice(c.alphabet) for _ in range(n))
            return {"prompt": f"{s}=", "label": s[::-1]}

        self._splits = _split(make, c.n_train, c.n_eval, c.seed)

    def examples(self, split: str) -> list[dict[str, Any]]:
        """Examples of ``split``."""
        return self._splits[split]

    def score(self, response: str, label: Any) -> dict[str, float]:
        """``reward``: position match; ``exact``: 1 for an exact answer."""
        return {"reward": position_match(response, str(label)), "exact": float(response == label)}


class AdditionTask(Task):
    """Add two numbers: ``"12+7="`` -> ``"19"``."""

    inline: ClassVar[bool] = True
    """Scored inline on the event loop, not in the reward worker thread: the score is string
    arithmetic on one response, quick and bounded (:mod:`rl_buffer.bounded`)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the addition task."""

        n_train: PositiveInt = 4000
        """Training examples."""
        n_eval: PositiveInt = 128
        """Held-out examples."""
        max_digits: PositiveInt = 2
        """Digits per operand at most."""
        seed: Seed = 1234
        """Seed of the data."""

    def __init__(self, config: Config) -> None:
        self.config = config
        hi = 10**config.max_digits - 1

        def make(rng: random.Random) -> dict[str, Any]:
            a, b = rng.randint(0, hi), rng.randint(0, hi)
            return {"prompt": f"{a}+{b}=", "label": str(a + b)}

        self._splits = _split(make, config.n_train, config.n_eval, config.seed)

    def examples(self, split: str) -> list[dict[str, Any]]:
        """Examples of ``split``."""
        return self._splits[split]

    def score(self, response: str, label: Any) -> dict[str, float]:
        """``reward``: digit position match; ``exact``: 1 for the right sum."""
        return {
            "reward": position_match(response, str(label)),
            "exact": float(response == str(label)),
        }


class CalculatorTask(Task):
    """Multiply two numbers with a calculator tool: ``"23*47="``.

    The label is a worked tool-use transcript, ``"CALC: 23*47\\n= 1081\\nANSWER: 1081"``, so the
    SFT warm-up (which trains on labels) teaches the call and answer format; in RL the ``= ...``
    line is written by the tool (:class:`rl_agents.examples.calculator.CalculatorRollout`), not
    the model. The operands are too large for a tiny model to multiply in its head: the reward
    is earned by calling the tool with the right expression and copying its result.

    A share ``direct_fraction`` of the training labels answer without the tool
    (``"ANSWER: 1081"``), as demonstrations often do, so the warm-up model calls the tool only
    sometimes; RL has to learn that calling it pays.
    """

    ANSWER = re.compile(r"ANSWER:\s*(\S+)")
    """The final answer: the last ``ANSWER: <value>`` of a response."""
    CALL = re.compile(r"CALC:\s*([^\n]+)")
    """A tool call line."""

    inline: ClassVar[bool] = True
    """Scored inline on the event loop, not in the reward worker thread: the score is string
    arithmetic on one response, quick and bounded (:mod:`rl_buffer.bounded`)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the calculator task."""

        n_train: PositiveInt = 4000
        """Training examples."""
        n_eval: PositiveInt = 128
        """Held-out examples (never in the training split)."""
        min_value: NonNegInt = 10
        """Smallest operand."""
        max_value: NonNegInt = 99
        """Largest operand."""
        direct_fraction: Probability = 0.0
        """Share of training labels that answer directly, without a tool call."""
        seed: Seed = 1234
        """Seed of the data."""

    def __init__(self, config: Config) -> None:
        if not 0.0 <= config.direct_fraction <= 1.0:
            raise ConfigError(
                f"task.direct_fraction: must be in [0, 1], got {config.direct_fraction}."
            )
        self.config = config
        c = config

        def make(rng: random.Random) -> dict[str, Any]:
            a, b = rng.randint(c.min_value, c.max_value), rng.randint(c.min_value, c.max_value)
            expr, value = f"{a}*{b}", a * b
            if rng.random() < c.direct_fraction:
                return {"prompt": f"{expr}=", "label": f"ANSWER: {value}"}
            return {"prompt": f"{expr}=", "label": f"CALC: {expr}\n= {value}\nANSWER: {value}"}

        self._splits = _split(make, c.n_train, c.n_eval, c.seed)

    def examples(self, split: str) -> list[dict[str, Any]]:
        """Examples of ``split``."""
        return self._splits[split]

    def score(self, response: str, label: Any) -> dict[str, float]:
        """``reward``: digit position match of the final answer (0 without one); ``exact``: 1
        for the right product; ``tool_call``: 1 when the response called the tool."""
        want = self.ANSWER.findall(str(label))
        if not want:
            raise ValueError(f"calculator label {label!r} has no 'ANSWER: <value>' line.")
        got = self.ANSWER.findall(response)
        answer = got[-1] if got else None
        return {
            "reward": position_match(answer, want[-1]) if answer is not None else 0.0,
            "exact": float(answer == want[-1]),
            "tool_call": float(bool(self.CALL.search(response))),
        }
