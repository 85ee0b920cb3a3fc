"""Configs read from a run's files name no code that gets imported.

A dump's ``dump.json`` and a checkpoint's stored config are files people download and share.
Their config may name user code (``"module:attr"``, ``"path/to/file.py:attr"``: a reward, a
filter, a rollout function); importing it would run whatever that code does. ``rl-train replay``
and ``rl-train eval`` therefore use a stored config only when it names no code
(:func:`refuse_stored_code`), and with a recipe they check that the recipe's code references are
the ones the stored config names (:func:`check_same_code`), naming both when they differ.
Registry names (installed entry points such as ``reverse`` or ``hf``) are not code references.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_core.errors import ConfigError

__all__ = ["check_same_code", "code_refs", "refuse_stored_code"]

_ATTR = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def _is_code_ref(value: str) -> bool:
    target, sep, attr = value.rpartition(":")
    if not sep or not target or not _ATTR.fullmatch(attr):
        return False
    return target.endswith(".py") or bool(_MODULE.fullmatch(target))


def code_refs(config: Any, prefix: str = "") -> dict[str, str]:
    """``{field: reference}`` of every string in ``config`` that names code to import."""
    out: dict[str, str] = {}
    if isinstance(config, Mapping):
        for k, v in config.items():
            out.update(code_refs(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(config, list | tuple):
        for i, v in enumerate(config):
            out.update(code_refs(v, f"{prefix}[{i}]"))
    elif isinstance(config, str) and _is_code_ref(config):
        out[prefix] = config
    return out


def refuse_stored_code(config: Mapping[str, Any], source: Path, command: str) -> None:
    """Raise :class:`ConfigError` when the ``config`` stored in ``source`` names code."""
    refs = code_refs(config)
    if refs:
        listed = "\n  ".join(f"{k}: {v}" for k, v in refs.items())
        raise ConfigError(
            f"{source}: its stored config names code to import:\n  {listed}\nA stored config is "
            "data (it may come from anyone), so its code is not imported. Pass the recipe you "
            f"trust, whose code references must be these: {command}"
        )


def check_same_code(
    stored: Mapping[str, Any], recipe: Mapping[str, Any], source: Path, recipe_path: Any
) -> None:
    """Raise :class:`ConfigError` when the recipe's code references differ from the stored
    config's (each differing field with both values)."""
    a, b = code_refs(stored), code_refs(recipe)
    diff = {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}
    if diff:
        listed = "\n  ".join(
            f"{k}: {source} names {x!r}, the recipe {y!r}" for k, (x, y) in diff.items()
        )
        raise ConfigError(
            f"{source}: the code it was made with differs from the recipe {recipe_path}'s:\n  "
            f"{listed}\nUse the recipe (and code) that wrote it."
        )
