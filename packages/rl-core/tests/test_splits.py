"""rl_core.splits: the held-out train/eval split the built-in tasks and reasoning-gym share."""

from __future__ import annotations

import itertools
import json

from rl_core.splits import held_out_split, write_jsonl_splits


def _draws(prompts):
    return ({"prompt": p, "label": i} for i, p in enumerate(prompts))


def test_eval_is_distinct_and_never_trained_on():
    """Eval takes the first distinct prompts; training skips every eval prompt (repeats too)."""
    evals, train = held_out_split(_draws("aabcd"), _draws("xaybzcw"), n_eval=3, n_train=4)
    assert [e["prompt"] for e in evals] == ["a", "b", "c"]
    assert [t["prompt"] for t in train] == ["x", "y", "z", "w"]


def test_one_generator_feeds_eval_then_train_and_stops_at_the_last_taken():
    """Shared iterator: train starts right after the last eval example; neither reads ahead."""
    pulled = []

    def gen():
        for i in itertools.count():
            pulled.append(i)
            yield {"prompt": str(i % 5)}

    draws = gen()
    evals, train = held_out_split(draws, draws, n_eval=2, n_train=3)
    assert [e["prompt"] for e in evals] == ["0", "1"]
    assert [t["prompt"] for t in train] == ["2", "3", "4"]
    assert pulled == [0, 1, 2, 3, 4]


def test_duplicates_kept_when_asked_and_short_candidates_give_short_lists():
    """distinct_eval=False keeps every eval candidate; too few candidates: shorter lists (the
    caller reports it); a custom prompt key."""
    evals, train = held_out_split(
        [("a", 1), ("a", 2)],
        [("a", 3), ("b", 4)],
        n_eval=2,
        n_train=5,
        prompt=lambda c: c[0],
        distinct_eval=False,
    )
    assert evals == [("a", 1), ("a", 2)]
    assert train == [("b", 4)]


def test_write_jsonl_splits_is_idempotent(tmp_path):
    """Both files, one object a line; a file already there is kept as is."""
    splits = {"train": [{"prompt": "x", "label": 1}], "eval": [{"prompt": "y", "label": None}]}
    paths = write_jsonl_splits(tmp_path / "d", splits.__getitem__)
    assert {k: [json.loads(x) for x in p.read_text().splitlines()] for k, p in paths.items()} == (
        splits
    )
    paths["train"].write_text("kept\n")
    assert write_jsonl_splits(tmp_path / "d", splits.__getitem__) == paths
    assert paths["train"].read_text() == "kept\n"
    assert not list((tmp_path / "d").glob("*.tmp"))
