"""The reward of this task: how much of the reversed string the response gets right.

The trainer calls ``score(prompt, response, rollout)`` once per sampled response:

- ``prompt``: the :class:`rl_core.types.Prompt`; ``prompt.label`` is the row's ``label``.
- ``response``: the decoded response text (special tokens removed).
- ``rollout``: the :class:`rl_core.types.Rollout` (token ids, status, metadata).

Return a float (or a dict of floats with a ``"reward"`` entry: the others are logged as
metrics). It must return a number for ANY text, the empty response included; a raise marks
the rollout failed. ``rl-train check recipe.yaml`` tries it on test responses and the labels.
"""


def score(prompt, response, rollout):
    """Fraction of positions where the response matches the label, over the longer of the two
    (so extra or missing letters cost): 1.0 only for the exact answer."""
    target = str(prompt.label)
    answer = response.strip()
    if not target and not answer:
        return 1.0
    hits = sum(a == b for a, b in zip(answer, target))
    return hits / max(len(answer), len(target))
