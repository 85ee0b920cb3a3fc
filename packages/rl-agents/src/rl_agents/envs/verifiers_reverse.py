"""A small verifiers environment for the verifiers connector's recipe
(``recipes/env_verifiers.yaml``) and tests: a ``verifiers.SingleTurnEnv`` whose rubric scores
the reply against the answer (the built-in ``reverse`` task's label) by position match.

Its dataset is an in-memory placeholder (verifiers requires one); under
:class:`~rl_agents.envs.verifiers_env.VerifiersRollout` the recipe's data source supplies the
prompts and their answers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load_environment", "position_match"]


def position_match(completion: Any, answer: str, **kwargs: Any) -> float:
    """Rubric function: share of positions of the (stripped) reply equal to ``answer``, over
    the longer of the two; 1 only for an exact reply."""
    text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
    reply = (text or "").strip()
    if not reply and not answer:
        return 1.0
    return sum(a == b for a, b in zip(reply, answer)) / max(len(reply), len(answer))


def load_environment() -> Any:
    """The environment: ``SingleTurnEnv`` + ``Rubric([position_match])``."""
    import verifiers as vf
    from datasets import Dataset

    placeholder = Dataset.from_list([{"question": "abc=", "answer": "cba"}])
    return vf.SingleTurnEnv(dataset=placeholder, rubric=vf.Rubric(funcs=[position_match]))
