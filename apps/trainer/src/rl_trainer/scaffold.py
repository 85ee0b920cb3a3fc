"""``rl-train new NAME``: write a working task directory to start an own task from.

The directory holds everything a run needs, next to each other, with relative paths::

    NAME/
      recipe.yaml   # tiny model (model.init: no download), SFT warm-up then GRPO
      train.jsonl   # {"prompt": "Reverse: abc", "label": "cba"} per line
      eval.jsonl    # held-out rows, never in train.jsonl
      reward.py     # score(prompt, response, rollout) -> float in [0, 1]
      README.md     # what each file is and what to change first

``rl-train check NAME/recipe.yaml`` passes on it and ``rl-train run NAME/recipe.yaml`` learns the
task in about a minute on a laptop CPU, from any working directory. The files are package data
under ``rl_trainer/templates/task``; ``recipe.yaml`` and ``README.md`` get ``${name}`` replaced.
"""

from __future__ import annotations

import re
import string
from importlib import resources
from pathlib import Path

from rl_core.errors import ConfigError

__all__ = ["TEMPLATE_FILES", "write_task"]

TEMPLATE_FILES: tuple[str, ...] = (
    "README.md",
    "eval.jsonl",
    "recipe.yaml",
    "reward.py",
    "train.jsonl",
)
"""Files of the task template, written as they are except for ``${name}``."""

_SUBSTITUTED = {"recipe.yaml", "README.md"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def write_task(name: str, directory: str | Path = ".") -> Path:
    """Write the task template to ``directory/name`` and return that path.

    Raises:
        ConfigError: ``name`` is not a plain directory name, or ``directory/name`` exists and is
            not empty (nothing is overwritten).
    """
    if not _NAME_RE.match(name):
        raise ConfigError(
            f"rl-train new: {name!r} is not a plain name; use letters, digits, '_', '-' or '.' "
            "(no '/'), and --dir to choose where it goes."
        )
    out = Path(directory) / name
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"rl-train new: {out} already exists and is not empty; pick another name or remove it."
        )
    out.mkdir(parents=True, exist_ok=True)
    template = resources.files("rl_trainer") / "templates" / "task"
    for fname in TEMPLATE_FILES:
        text = (template / fname).read_text(encoding="utf-8")
        if fname in _SUBSTITUTED:
            text = string.Template(text).safe_substitute(name=name)
        (out / fname).write_text(text, encoding="utf-8")
    return out
