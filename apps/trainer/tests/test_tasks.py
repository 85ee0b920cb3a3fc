"""The built-in tasks: their rewards and held-out eval splits (the scoring machinery's own tests
are rl-buffer's: packages/rl-buffer/tests/test_scoring.py)."""

from __future__ import annotations

from rl_trainer.tasks import AdditionTask, ReverseTask, position_match


def test_tasks_score_and_hold_out():
    assert position_match("dcba", "dcba") == 1.0
    assert position_match("dcb", "dcba") == 0.75
    assert position_match("dcbaa", "dcba") == 0.8
    assert position_match("", "ab") == 0.0
    t = ReverseTask(ReverseTask.Config(n_train=200, n_eval=20))
    train = {e["prompt"] for e in t.examples("train")}
    evals = [e["prompt"] for e in t.examples("eval")]
    assert len(set(evals)) == 20 and not train & set(evals)
    assert all(e["label"] == e["prompt"][:-1][::-1] for e in t.examples("train"))
    assert t.score("cba", "abc") == {"reward": 1 / 3, "exact": 0.0}
    assert t.score("cba", "cba") == {"reward": 1.0, "exact": 1.0}
    a = AdditionTask(AdditionTask.Config(n_train=50, n_eval=10))
    ex = a.examples("eval")[0]
    x, y = ex["prompt"][:-1].split("+")
    assert ex["label"] == str(int(x) + int(y))
    assert a.score(ex["label"], ex["label"])["exact"] == 1.0


def test_built_in_tasks_are_scored_inline_on_the_event_loop(text_group, char_tokenizer):
    """The built-in tasks' scores are quick and bounded, so the scorer calls them inline
    (``inline``, :mod:`rl_buffer.bounded`) instead of handing each response to its worker
    thread; a user's ``Task`` subclass is not inline unless it says so."""
    import asyncio
    import threading

    from rl_buffer.failures import RolloutStats
    from rl_buffer.scoring import Scorer
    from rl_trainer.tasks import CalculatorTask, Task

    assert ReverseTask.inline and AdditionTask.inline and CalculatorTask.inline
    assert not getattr(Task, "inline", False)
    names: list[str] = []

    class Watched(ReverseTask):
        def score(self, response, label):
            names.append(threading.current_thread().name)
            return super().score(response, label)

    task = Watched(ReverseTask.Config(n_train=10, n_eval=2))
    group = text_group("p", ["ba", "aa"], label="ba")
    asyncio.run(Scorer(task, char_tokenizer, timeout_s=5).score([group], RolloutStats()))
    assert names == ["MainThread", "MainThread"]
    assert [r.reward for r in group.rollouts] == [1.0, 0.5]
