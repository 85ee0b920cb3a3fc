"""``--resume`` checks what it resumes: the recipe against the config the checkpoint was written
with, and the data the run reads against the digest the checkpoint recorded.

Fields that change the math or the model (the model, the policy and its optimizer, the
algorithm, the data and its content, rollout sampling, the reward...) must be equal: a change is
refused with a :class:`ConfigError` listing each ``field: old -> new`` and how to accept it
(``--allow-changed FIELD``, a field or a section prefix such as ``policy``). Fields that are safe
to change on resume (:data:`SAFE_FIELDS`: ``rl.steps``, ``sft.steps``, logging, the eval
schedule, checkpoint cadence, ``run_dir``, threads and runtime placement, timeouts, dumps) are
allowed and logged.

Data identity is a content digest (xxh3_128, read in streaming chunks) of every file or directory
the config's data sections name (``data``, ``task``), not a row count: a file edited with its
row count kept is a change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import xxhash

from rl_core.config import to_dict
from rl_core.errors import ConfigError

__all__ = ["SAFE_FIELDS", "check_resume", "config_diff", "data_digest"]

logger = logging.getLogger(__name__)

SAFE_FIELDS = (
    "rl.steps",
    "sft.steps",
    "logging",
    "eval",
    "checkpoint",
    "run_dir",
    "threads",
    "runtime",
    "rollout.dump_dir",
    "rollout.reward_timeout_s",
    "rollout.reward_round_timeout_s",
)
"""Fields (or section prefixes) a resumed run may change."""

DATA_SECTIONS = ("data", "task")
"""Config sections whose file paths are digested as the run's data identity."""

_CHUNK = 8 << 20
_ABSENT = "<absent>"


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, Mapping) and data:
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: data}


def _covered(field: str, prefixes: Iterable[str]) -> bool:
    return any(field == p or field.startswith(f"{p}.") for p in prefixes)


def _defaults() -> dict[str, Any]:
    from rl_trainer.config import TrainerConfig

    return _flatten(to_dict(TrainerConfig()))


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{field: (old, new)}`` for every leaf that differs. A field one side lacks (a config
    written before the field existed) counts as changed only when the other side is not its
    default."""
    a, b, defaults = _flatten(old), _flatten(new), None
    out = {}
    for key in sorted(set(a) | set(b)):
        va, vb = a.get(key, _ABSENT), b.get(key, _ABSENT)
        if va == vb:
            continue
        if _ABSENT in (va, vb):
            defaults = defaults if defaults is not None else _defaults()
            present = vb if va == _ABSENT else va
            if key in defaults and defaults[key] == present:
                continue
        out[key] = (va, vb)
    return out


def _digest_path(path: Path) -> str:
    h = xxhash.xxh3_128()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        h.update(f"{f.relative_to(path) if f != path else f.name}\0".encode())
        with f.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def data_digest(config: Mapping[str, Any], *, exclude: Path | None = None) -> dict[str, str]:
    """``{field: xxh3_128}`` of every existing file or directory a string field of the data
    sections names (see the module docstring). Paths under ``exclude`` (the run directory:
    data a task writes there is regenerated from its config) are skipped."""
    out = {}
    flat = _flatten({k: config.get(k) for k in DATA_SECTIONS})
    for key, value in flat.items():
        if not isinstance(value, str) or not value or "\n" in value or len(value) > 4096:
            continue
        path = Path(value).expanduser()
        try:
            if not path.exists():
                continue
            resolved = path.resolve()
            if exclude is not None and resolved.is_relative_to(exclude.resolve()):
                continue
            out[key] = _digest_path(resolved)
        except OSError as e:
            raise ConfigError(f"{key}: cannot read {path} to check the data ({e}).") from e
    return out


def check_resume(
    checkpoint: Path,
    saved: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    *,
    saved_digest: Mapping[str, str] | None,
    current_digest: Mapping[str, str],
    allow: Iterable[str] = (),
) -> dict[str, tuple[Any, Any]]:
    """Compare the checkpoint's config and data digest with this run's; returns the allowed
    changes (logged here).

    Raises:
        ConfigError: a field outside :data:`SAFE_FIELDS` and ``allow`` changed, or the data
            changed; the message lists ``field: old -> new`` and the fix.
    """
    allow = list(allow)
    changes = config_diff(saved, current) if saved is not None else {}
    if saved_digest is not None:
        for key in sorted(set(saved_digest) | set(current_digest)):
            a, b = saved_digest.get(key, _ABSENT), current_digest.get(key, _ABSENT)
            if a != b:
                changes[f"{key} (content xxh3_128)"] = (a, b)
    refused = {
        k: v
        for k, v in changes.items()
        if not _covered(k.split(" ", 1)[0], SAFE_FIELDS) and not _covered(k.split(" ", 1)[0], allow)
    }
    if refused:
        lines = "\n  ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in refused.items())
        flags = " ".join(f"--allow-changed {k.split(' ', 1)[0]}" for k in refused)
        raise ConfigError(
            f"--resume: the recipe differs from the one that wrote {checkpoint} in fields that "
            f"change the math, the model or the data (old -> new):\n  {lines}\nResume with the "
            f"recipe that wrote it (saved as {checkpoint / 'config.yaml'}), or accept the change "
            f"knowingly: {flags}"
        )
    allowed = {k: v for k, v in changes.items() if k not in refused}
    for k, (old, new) in allowed.items():
        logger.warning("--resume: %s changed: %r -> %r", k, old, new)
    return allowed
