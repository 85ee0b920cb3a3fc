"""The task of the ``smollm2_math`` recipe: one-digit sums in a fixed answer format, for
SmolLM2-135M-Instruct (a real instruct model with a ChatML chat template).

Each prompt is a chat rendered in SmolLM2's ChatML: a system message asking for
``ANSWER: <number>``, one worked exchange (``What is 3 + 4?`` -> ``ANSWER: 7``) and the question
``What is a + b?`` (1 <= a, b <= 9). Reward: 1.0 for ``ANSWER: <the sum>``, 0.3 for a
well-formed ``ANSWER: <another number>``, 0 otherwise; ``format`` and ``exact`` are reported
too. Measured on the starting model (64 samples at temperature 1): format 0.69, exact 0.05,
reward ~0.24, so both the format and the sums leave room to learn.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from rl_core.config import PositiveInt, Seed
from rl_trainer.tasks import Task, _split

__all__ = ["SYSTEM_PROMPT", "SmolMathTask", "chatml"]

SYSTEM_PROMPT = "Solve the problem. Reply with ANSWER: followed by the number, nothing else."
"""The system message of every prompt."""
_ANSWER = re.compile(r"ANSWER:\s*(-?\d+)\.?")


def chatml(messages: list[dict[str, str]]) -> str:
    """``messages`` as SmolLM2's chat template renders them, with the generation prompt (the
    template is ChatML; the data source encodes this text, special tokens as single ids)."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


class SmolMathTask(Task):
    """``What is a + b?`` answered as ``ANSWER: <a+b>`` (the label; see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of the SmolLM2 arithmetic task."""

        n_train: PositiveInt = 2000
        """Training prompts (drawn with repetition from the 81 sums and phrasings)."""
        n_eval: PositiveInt = 32
        """Held-out prompts (never in the training split)."""
        max_operand: PositiveInt = 9
        """Largest operand."""
        format_reward: float = 0.3
        """Reward of a well-formed answer with the wrong number."""
        seed: Seed = 1234
        """Seed of the data (independent of the run seed)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        c = config
        phrasings = ("What is {a} + {b}?", "Compute {a} + {b}.", "{a} plus {b} equals?")

        def make(rng: random.Random) -> dict[str, Any]:
            a, b = rng.randint(1, c.max_operand), rng.randint(1, c.max_operand)
            question = rng.choice(phrasings).format(a=a, b=b)
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": "What is 3 + 4?"},
                {"role": "assistant", "content": "ANSWER: 7"},
                {"role": "user", "content": question},
            ]
            return {"prompt": chatml(messages), "label": f"ANSWER: {a + b}"}

        self._splits = _split(make, c.n_train, c.n_eval, c.seed)

    def examples(self, split: str) -> list[dict[str, Any]]:
        """Examples of ``split``."""
        return self._splits[split]

    def score(self, response: str, label: Any) -> dict[str, float]:
        """``reward`` (1 right, ``format_reward`` well-formed, else 0), ``format``, ``exact``."""
        text = response.replace("<|im_end|>", "").strip()
        m, want = _ANSWER.fullmatch(text), _ANSWER.fullmatch(str(label))
        exact = bool(m) and want is not None and m.group(1) == want.group(1)
        reward = 1.0 if exact else (self.config.format_reward if m else 0.0)
        return {"reward": reward, "format": float(bool(m)), "exact": float(exact)}
