"""Train/eval splits of generated tasks with a held-out eval: no eval prompt is ever trained on.

A task draws candidate examples (dicts with a ``prompt``); :func:`held_out_split` takes the
first ``n_eval`` of the eval candidates, then the first ``n_train`` training candidates whose
prompt is not among them, consuming each iterator only as far as it needs (so one generator
can feed both, eval first)::

    rng = random.Random(seed)
    draws = (make(rng) for _ in itertools.count())
    evals, train = held_out_split(draws, draws, n_eval=128, n_train=4000)
    write_jsonl_splits("data/", {"train": train, "eval": evals}.__getitem__)
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

__all__ = ["held_out_split", "write_jsonl_splits"]

T = TypeVar("T")


def held_out_split(
    eval_candidates: Iterable[T],
    train_candidates: Iterable[T],
    *,
    n_eval: int,
    n_train: int,
    prompt: Callable[[T], str] = lambda ex: ex["prompt"],  # type: ignore[index]
    distinct_eval: bool = True,
) -> tuple[list[T], list[T]]:
    """The eval examples and the training examples, held out from each other.

    Args:
        eval_candidates: eval examples, in order; the first ``n_eval`` are taken (with
            ``distinct_eval``, a prompt already taken is skipped).
        train_candidates: training examples, in order; those whose prompt is an eval prompt are
            skipped, until ``n_train`` are taken.
        n_eval: eval examples to take.
        n_train: training examples to take.
        prompt: the prompt of a candidate (default ``ex["prompt"]``).
        distinct_eval: skip an eval candidate whose prompt is already in the eval split.

    Returns:
        ``(eval, train)``; either is shorter than asked when its candidates run out (the caller
        says what to change). Each iterator is advanced no further than its last example taken.
    """
    evals: list[T] = []
    held_out: set[str] = set()
    if n_eval > 0:
        for ex in eval_candidates:
            key = prompt(ex)
            if distinct_eval and key in held_out:
                continue
            held_out.add(key)
            evals.append(ex)
            if len(evals) >= n_eval:
                break
    train: list[T] = []
    if n_train > 0:
        for ex in train_candidates:
            if prompt(ex) in held_out:  # held-out prompts never appear in training
                continue
            train.append(ex)
            if len(train) >= n_train:
                break
    return evals, train


def write_jsonl_splits(
    directory: str | Path, examples: Callable[[str], Iterable[dict[str, Any]]]
) -> dict[str, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` under ``directory`` from ``examples(split)``, one
    JSON object a line; a file already there is kept (idempotent; each is written to a temporary
    file and renamed, so a half-written split is never read). Returns the two paths by split."""
    out = {}
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    for split in ("train", "eval"):
        p = d / f"{split}.jsonl"
        if not p.exists():
            tmp = p.with_suffix(".tmp")
            with tmp.open("w") as f:
                for ex in examples(split):
                    f.write(json.dumps(ex) + "\n")
            tmp.replace(p)
        out[split] = p
    return out
