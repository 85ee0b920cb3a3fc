"""Small Python tasks with hidden unit tests, for the coding agent.

Each example is ``{"prompt": <task text>, "label": {"file": "solution.py", "tests": [...]}}``:
the agent sees only the prompt; the tests (Python ``assert`` statements over the module
``solution``) stay with the rollout, which runs them in a fresh sandbox after the episode
(:func:`test_script`). :class:`CodingTasks` writes the train/eval splits like the trainer's
built-in tasks (``task: {type: "rl_agents.examples.coding_agent.tasks:CodingTasks"}``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rl_core.config import PositiveInt, Seed
from rl_core.errors import ConfigError, RewardError
from rl_core.types import Prompt, Rollout

__all__ = ["PROBLEMS", "CodingTasks", "test_script"]

PROBLEMS: list[tuple[str, str, list[str]]] = [
    ("add", "add(a, b) returning a + b", ["add(2, 3) == 5", "add(-1, 1) == 0", "add(0, 0) == 0"]),
    ("square", "square(x) returning x squared", ["square(3) == 9", "square(-2) == 4"]),
    ("is_even", "is_even(n) returning True when n is even", ["is_even(4)", "not is_even(7)"]),
    (
        "reverse",
        "reverse(s) returning the string s reversed",
        ["reverse('abc') == 'cba'", "reverse('') == ''"],
    ),
    (
        "count_vowels",
        "count_vowels(s) returning how many of a, e, i, o, u are in s",
        ["count_vowels('banana') == 3", "count_vowels('xyz') == 0"],
    ),
    (
        "factorial",
        "factorial(n) returning n! for n >= 0",
        ["factorial(0) == 1", "factorial(5) == 120"],
    ),
    (
        "fib",
        "fib(n) returning the n-th Fibonacci number (fib(0) = 0, fib(1) = 1)",
        ["fib(0) == 0", "fib(1) == 1", "fib(10) == 55"],
    ),
    (
        "max_of",
        "max_of(xs) returning the largest number of a non-empty list",
        ["max_of([1, 5, 2]) == 5", "max_of([-3]) == -3"],
    ),
]
"""(function name, what it does, hidden test expressions)."""


def test_script(tests: list[str], module: str = "solution") -> str:
    """A script that imports ``module``, evaluates each test expression on its own and prints
    ``{"passed": k, "total": n}`` as its last line."""
    return (
        "import json\n"
        f"tests = {json.dumps(tests)}\n"
        "passed = 0\n"
        "try:\n"
        f"    from {module} import *\n"
        "except BaseException as e:\n"
        "    print('import failed:', repr(e))\n"
        "else:\n"
        "    for t in tests:\n"
        "        try:\n"
        "            ok = bool(eval(t))\n"
        "        except BaseException as e:\n"
        "            ok = False\n"
        "            print('error:', t, repr(e))\n"
        "        passed += ok\n"
        "print(json.dumps({'passed': passed, 'total': len(tests)}))\n"
    )


class CodingTasks:
    """The task set: each problem in the train split, ``n_eval`` of them in the eval split
    (the set is tiny: the recipe shows the plumbing, not generalisation)."""

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of :class:`CodingTasks`."""

        n_train: PositiveInt = 64
        """Training examples (problems repeated in random order)."""
        n_eval: PositiveInt = 4
        """Evaluation examples."""
        seed: Seed = 0
        """Order of the examples."""

        def __post_init__(self) -> None:
            if self.n_train < 1 or self.n_eval < 1:
                raise ConfigError("task.n_train and task.n_eval: must be >= 1.")

    def __init__(self, config: Config | None = None) -> None:
        self.config = config or CodingTasks.Config()

    def examples(self, split: str) -> list[dict[str, Any]]:
        """``prompt`` (the task text) and ``label`` (file and hidden tests) per example."""
        rng = random.Random(self.config.seed + (split == "eval"))
        n = self.config.n_train if split == "train" else self.config.n_eval
        out = []
        for _ in range(n):
            _, what, tests = rng.choice(PROBLEMS)
            prompt = (
                f"Write a Python file solution.py that defines {what}. Use the write_file tool, "
                "then check it with run_shell."
            )
            out.append({"prompt": prompt, "label": {"file": "solution.py", "tests": tests}})
        return out

    def write_splits(self, directory: str | Path) -> dict[str, Path]:
        """Write ``train.jsonl`` and ``eval.jsonl`` (idempotent) and return their paths."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        out = {}
        for split in ("train", "eval"):
            p = d / f"{split}.jsonl"
            if not p.exists():
                tmp = p.with_suffix(".tmp")
                tmp.write_text("".join(json.dumps(ex) + "\n" for ex in self.examples(split)))
                tmp.replace(p)
            out[split] = p
        return out

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> float:
        """RewardFn: the hidden tests' pass rate the rollout recorded."""
        if "session_reward" not in rollout.metadata:
            raise RewardError(
                f"rollout {rollout.sample_id}: no test result; run the coding task with "
                "generate_fn: {type: 'rl_agents.examples.coding_agent:CodingAgentRollout'}."
            )
        return float(rollout.metadata["session_reward"])
