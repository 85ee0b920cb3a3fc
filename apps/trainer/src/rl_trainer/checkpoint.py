"""Atomic checkpoints that resume a run exactly.

Layout::

    <run_dir>/checkpoints/step_000040/
        policy/            weights (Hugging Face format) and optimizer state
        trainer_state.pt   step, phase, weight version, data cursors, buffer, RNG states
        COMPLETE           written last

A checkpoint is written into ``.tmp-step_000040``, every file fsynced, ``COMPLETE`` written, and
the directory renamed into place; readers only trust directories that hold ``COMPLETE``.
"""

from __future__ import annotations

import os
import random
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_core.errors import CheckpointError

__all__ = ["capture_rng", "latest_checkpoint", "restore_rng", "write_checkpoint"]

MARKER = "COMPLETE"


def capture_rng() -> dict[str, Any]:
    """The Python, NumPy and torch RNG states."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with p.open("rb") as f:
                os.fsync(f.fileno())
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    run_dir: Path,
    step_index: int,
    *,
    save_models: Mapping[str, Callable[[Path], None]],
    trainer_state: dict[str, Any],
    keep: int,
) -> Path:
    """Write checkpoint ``step_index`` atomically and prune all but the newest ``keep``.

    ``save_models`` maps a sub-directory name (``policy``, ``critic``) to the function that writes
    that model into it.
    """
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step_index:06d}"
    final = root / name
    tmp = root / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    for name_, save in save_models.items():
        save(tmp / name_)
    torch.save(trainer_state, tmp / "trainer_state.pt")
    _fsync_tree(tmp)
    (tmp / MARKER).write_text(name + "\n")
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists())
    for old in done[: max(0, len(done) - keep)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of ``run_dir`` (partial ones are ignored)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / MARKER).exists())
    return done[-1] if done else None


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """Read ``trainer_state.pt`` of a complete checkpoint."""
    if not (checkpoint / MARKER).exists():
        raise CheckpointError(f"{checkpoint}: incomplete checkpoint (no {MARKER} marker).")
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False)
