"""reasoning-gym connector: its procedural tasks and scorers as a task (data + reward) and as
an environment (``pip install 'rlpost-agents[reasoning-gym]'``).

`reasoning-gym <https://github.com/open-thought/reasoning-gym>`_ generates questions from a
seed (``reasoning_gym.create_dataset(name, seed=..., size=..., **options)``) and scores an
answer with the dataset's own ``score_answer(answer, entry)``. Nothing here re-implements a
task or a scorer; the connector only turns entries into prompts and calls the scorer.

- :class:`ReasoningGymTask` (``task: {type: "rl_agents.envs.reasoning_gym:ReasoningGymTask",
  dataset: spell_backward, ...}``): writes the train and held-out splits (``prompt``: the
  question through ``prompt_template``, ``label``: the reference answer, which the SFT warm-up
  trains on) and scores a response with the dataset's scorer.
- :class:`ReasoningGymEnv` (``generate_fn: {type: env, env:
  "rl_agents.envs.reasoning_gym:ReasoningGymEnv", env_options: {...}}`` with
  ``reward: {type: env_reward}``): the same entries as a multi-turn environment; a wrong answer
  gets ``feedback`` and another attempt, up to ``max_attempts``; the reward is the best
  attempt's score (``reward: best``, a second try never costs) or the last one's (``last``).

Use the same dataset options in both (the environment finds a prompt's entry, metadata
included, by its text; a prompt it does not know is scored against its label alone).

Offline: most datasets generate from code and small data files shipped in the wheel
(``spell_backward``, ``letter_counting``, ``basic_arithmetic``, ``leg_counting``,
``number_sorting``, ``word_sorting`` were checked to need no download). A dataset that needs a
download or an external tool fails when the task is built, with reasoning-gym's error.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from rl_agents.envs.base import Action, StepResult
from rl_core.config import PositiveInt, Seed
from rl_core.errors import ConfigError, DataError
from rl_core.splits import held_out_split, write_jsonl_splits
from rl_core.types import Prompt, Rollout

__all__ = ["ReasoningGymEnv", "ReasoningGymSpec", "ReasoningGymTask"]


@dataclass(kw_only=True, slots=True)
class ReasoningGymSpec:
    """Which reasoning-gym entries to use, and how they become prompts and answers."""

    dataset: str
    """reasoning-gym dataset name (``reasoning_gym.factory.DATASETS``), e.g. ``spell_backward``."""
    dataset_config: dict[str, Any] = field(default_factory=dict)
    """Options of the dataset's config (e.g. ``{min_word_len: 3, max_word_len: 5}``)."""
    n_train: PositiveInt = 4000
    """Training prompts."""
    n_eval: PositiveInt = 128
    """Held-out prompts; their questions never appear in the training split."""
    seed: Seed = 1234
    """Seed of the entries (the eval split uses ``seed + 1``); independent of the run seed."""
    prompt_template: str = "{question}\n"
    """The prompt text; ``{question}`` is the entry's question."""
    answer_format: Literal["raw", "answer_tag"] = "raw"
    """How the answer is read from a response: ``raw`` (the whole response, stripped: for tiny
    models trained to answer directly) or ``answer_tag`` (reasoning-gym's ``extract_answer``:
    the last ``<answer>...</answer>``)."""

    FIELD: ClassVar[str] = "task"
    """Where the recipe sets these options (for error messages)."""

    def __post_init__(self) -> None:
        w = self.FIELD
        _datasets_or_raise(self.dataset, w)
        if "{question}" not in self.prompt_template:
            raise ConfigError(
                f"{w}.prompt_template: must contain '{{question}}', got {self.prompt_template!r}."
            )
        if self.answer_format not in ("raw", "answer_tag"):
            raise ConfigError(
                f"{w}.answer_format: {self.answer_format!r}; choose 'raw' or 'answer_tag'."
            )


def _datasets_or_raise(name: str, where: str) -> None:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ConfigError(
            "reasoning-gym is not installed; pip install 'rlpost-agents[reasoning-gym]' "
            f"(reasoning-gym>=0.1.25,<0.2) to use the reasoning-gym connector ({e})."
        ) from None
    if name not in DATASETS:
        close = sorted(n for n in DATASETS if name[:4] in n)[:8] or sorted(DATASETS)[:8]
        raise ConfigError(
            f"{where}.dataset: reasoning-gym has no dataset {name!r}; e.g. {', '.join(close)} "
            "(reasoning_gym.factory.DATASETS lists them all)."
        )


class _Entries:
    """The two splits of one spec: the datasets (for their scorers) and the entries by prompt."""

    def __init__(self, spec: ReasoningGymSpec, where: str) -> None:
        import reasoning_gym

        opts = dict(spec.dataset_config)
        try:
            self.eval_ds = reasoning_gym.create_dataset(
                spec.dataset, seed=spec.seed + 1, size=spec.n_eval, **opts
            )
            # more than n_train: entries whose question is held out are skipped
            self.train_ds = reasoning_gym.create_dataset(
                spec.dataset, seed=spec.seed, size=4 * spec.n_train + 64, **opts
            )
        except TypeError as e:
            raise ConfigError(
                f"{where}.dataset_config: {e}; see the fields of reasoning-gym's "
                f"{spec.dataset} config."
            ) from None
        except AssertionError as e:
            raise ConfigError(f"{where}.dataset_config: reasoning-gym refused it: {e}") from None
        self.by_prompt: dict[str, tuple[Any, dict[str, Any]]] = {}
        self.splits: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}

        def candidates(ds: Any, n: int) -> Iterator[tuple[str, Any, dict[str, Any]]]:
            for i in range(n):
                entry = ds[i]
                yield spec.prompt_template.format(question=entry["question"]), ds, entry

        evals, train = held_out_split(
            candidates(self.eval_ds, spec.n_eval),
            candidates(self.train_ds, len(self.train_ds)),
            n_eval=spec.n_eval,
            n_train=spec.n_train,
            prompt=lambda c: c[0],
            distinct_eval=False,  # every eval entry is kept, as the dataset made them
        )
        for split, chosen in (("eval", evals), ("train", train)):
            for prompt, ds, entry in chosen:
                self.by_prompt.setdefault(prompt, (ds, entry))
                self.splits[split].append({"prompt": prompt, "label": str(entry["answer"])})
        if len(self.splits["train"]) < spec.n_train:
            raise ConfigError(
                f"{where}.n_train: only {len(self.splits['train'])} training questions of "
                f"{spec.dataset} differ from the {spec.n_eval} held-out ones; lower n_train or "
                "n_eval, or widen dataset_config."
            )


_CACHE: dict[str, _Entries] = {}


def _entries_of(spec: ReasoningGymSpec) -> _Entries:
    """The entries of ``spec``'s options, built once per process (the task and every episode's
    environment share them; the 8 most recent option sets are kept)."""
    opts = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ReasoningGymSpec)}
    key = json.dumps(opts, sort_keys=True)
    if key not in _CACHE:
        while len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = _Entries(spec, spec.FIELD)
    return _CACHE[key]


def _score(spec: ReasoningGymSpec, entries: _Entries, prompt: Prompt, response: str) -> float:
    """The dataset's score of ``response`` for ``prompt`` (its entry, else its label)."""
    if spec.answer_format == "answer_tag":
        from reasoning_gym.utils import extract_answer

        answer = extract_answer(response)
    else:
        answer = response.strip()
    text = prompt.input if isinstance(prompt.input, str) else None
    found = entries.by_prompt.get(text) if text is not None else None
    if found is not None:
        ds, entry = found
    else:  # a prompt from elsewhere (data.train set by hand): score against its label
        if prompt.label is None:
            raise DataError(
                f"reasoning-gym: prompt {prompt.uid} is not one of the {spec.dataset} entries "
                "and has no label to score against; use the task's own splits."
            )
        ds, entry = entries.eval_ds, {"question": text, "answer": prompt.label, "metadata": {}}
    return float(ds.score_answer(answer, entry))


class ReasoningGymTask:
    """A task from a reasoning-gym dataset: its splits and its scorer (see the module
    docstring). Reward components: ``reward`` (the dataset's score, in [0, 1]) and ``exact``
    (1 for a full score)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ReasoningGymSpec):
        """Options of :class:`ReasoningGymTask` (all from :class:`ReasoningGymSpec`)."""

    def __init__(self, config: ReasoningGymSpec) -> None:
        self.config = config
        self._entries = _entries_of(config)

    def examples(self, split: str) -> list[dict[str, Any]]:
        """The examples of ``split`` (``train`` or ``eval``): ``prompt`` and ``label``."""
        return self._entries.splits[split]

    def write_splits(self, directory: str | Path) -> dict[str, Path]:
        """Write ``train.jsonl`` and ``eval.jsonl`` under ``directory`` (idempotent)."""
        return write_jsonl_splits(directory, self.examples)

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> dict[str, float]:
        """RewardFn: the dataset's score of ``response``."""
        score = _score(self.config, self._entries, prompt, response)
        return {"reward": score, "exact": float(score >= 1.0)}


class ReasoningGymEnv:
    """An environment over reasoning-gym entries: each model turn is an attempt scored by the
    dataset; a full score or the last attempt ends the episode, otherwise ``feedback`` is
    appended and the model tries again. The episode's reward is the best (or the last)
    attempt's score, given at the end. ``info``: ``exact`` (1 when that score is full),
    ``attempts`` and ``first_attempt`` (the first attempt's score: what a single-turn run would
    have scored)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ReasoningGymSpec):
        """Options of :class:`ReasoningGymEnv`: the entries (as for the task) and the
        attempts."""

        max_attempts: PositiveInt = 2
        """Attempts per episode (set ``generate_fn.max_turns`` at least as high)."""
        feedback: str = "\nwrong, again:\n"
        """Text appended after a wrong attempt (observation tokens, loss mask 0)."""
        reward: Literal["best", "last"] = "best"
        """The episode's reward: the best attempt's score, or the last attempt's."""

        FIELD: ClassVar[str] = "generate_fn.env_options"
        """Where the recipe sets these options (for error messages)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self._entries = _entries_of(config)
        if config.reward not in ("best", "last"):
            raise ConfigError(
                f"generate_fn.env_options.reward: {config.reward!r}; choose 'best' or 'last'."
            )
        self._prompt: Prompt | None = None
        self._scores: list[float] = []

    def reset(self, prompt: Prompt) -> None:
        """Start an episode on ``prompt`` (one of the task's prompts); nothing is appended."""
        self._prompt = prompt
        self._scores = []

    def step(self, action: Action) -> StepResult:
        """Score the attempt; end the episode on a full score or the last attempt."""
        if self._prompt is None:
            raise DataError("ReasoningGymEnv.step before reset; the loop calls reset first.")
        score = _score(self.config, self._entries, self._prompt, action.text)
        self._scores.append(score)
        reward = max(self._scores) if self.config.reward == "best" else score
        info = {
            "exact": float(reward >= 1.0),
            "attempts": len(self._scores),
            "first_attempt": self._scores[0],
        }
        if score >= 1.0 or len(self._scores) >= self.config.max_attempts:
            return StepResult(reward=reward, done=True, info=info)
        return StepResult(observation=self.config.feedback, info=info)
