"""Nothing read from a run's files runs code: ``trainer_state.pt`` is read with
``weights_only=True`` (a crafted pickle is refused, its code never runs), an old pickled state is
refused with the one-time conversion named, and saved models get the umask's file mode."""

from __future__ import annotations

import builtins
import os
import random
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_core.errors import CheckpointError, ConfigError
from rl_trainer.cli import main
from rl_trainer.lifecycle.checkpoint import (
    MARKER,
    _write_manifest,
    capture_rng,
    load_trainer_state,
    restore_rng,
    verify_checkpoint,
    write_checkpoint,
)
from rl_trainer.ops.eval_only import resolve_checkpoint


class _WritesMarker:
    """Unpickling this object creates ``path`` (what a malicious file would do, harmlessly)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def _crafted_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A checkpoint whose trainer_state.pt would create a marker file when unpickled, with a
    manifest that matches it (an attacker can write one)."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    (ckpt / "policy").mkdir(parents=True)
    marker = tmp_path / "pwned"
    torch.save(
        {"state": {"rl_step": 1}, "config": _WritesMarker(marker)}, ckpt / "trainer_state.pt"
    )
    _write_manifest(ckpt, ckpt.name)
    assert verify_checkpoint(ckpt).intact
    return ckpt, marker


def test_a_crafted_trainer_state_is_refused_and_runs_nothing(tmp_path):
    ckpt, marker = _crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="convert-checkpoint") as err:
        load_trainer_state(ckpt)
    assert str(ckpt / "trainer_state.pt") in str(err.value)
    assert not marker.exists()


def test_rl_train_eval_of_a_crafted_checkpoint_runs_nothing(tmp_path):
    ckpt, marker = _crafted_checkpoint(tmp_path)
    with pytest.raises(CheckpointError):
        resolve_checkpoint(ckpt)
    (ckpt.parent.parent / "final_model").mkdir()
    with pytest.raises(CheckpointError):
        resolve_checkpoint(ckpt.parent.parent / "final_model")
    assert not marker.exists()


def test_convert_checkpoint_needs_trust_and_then_reads_the_old_format(tmp_path, capsys):
    """A checkpoint of the old format (RNG states as getstate() tuples with a NumPy array) is
    refused until converted with --trust; the converted one loads and restores the RNGs."""
    ckpt = tmp_path / "run" / "checkpoints" / "step_000003"
    ckpt.mkdir(parents=True)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    old_rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    expect = (random.random(), np.random.rand(), torch.rand(1).item())
    torch.save({"state": {"rl_step": 3}, "rng": old_rng, "config": {}}, ckpt / "trainer_state.pt")
    _write_manifest(ckpt, ckpt.name)
    with pytest.raises(CheckpointError, match="--trust"):
        load_trainer_state(ckpt)
    assert main(["convert-checkpoint", str(ckpt)]) != 0  # no --trust: refused
    assert "--trust" in capsys.readouterr().err
    assert main(["convert-checkpoint", str(ckpt), "--trust"]) == 0
    assert verify_checkpoint(ckpt).intact  # the manifest was rewritten
    state = load_trainer_state(ckpt)
    assert state["state"] == {"rl_step": 3}
    random.seed(0)
    np.random.seed(0)
    restore_rng(state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expect


def test_trainer_state_round_trips_without_pickle(tmp_path):
    random.seed(7)
    np.random.seed(7)
    rng = capture_rng()
    expect = (random.random(), np.random.rand())
    state = {"state": {"rl_step": 2}, "rng": rng, "pipeline": {"ready": {3: {"m": np.float32(1)}}}}
    ckpt = write_checkpoint(tmp_path, 2, save_models={}, trainer_state=state, keep=2)
    loaded = load_trainer_state(ckpt)
    assert loaded["pipeline"] == {"ready": {3: {"m": 1.0}}}
    restore_rng(loaded["rng"])
    assert (random.random(), np.random.rand()) == expect


def test_an_object_in_the_state_is_refused_at_save_naming_its_key(tmp_path):
    state = {"buffer": {"groups": [{"metadata": {"when": object()}}]}}
    with pytest.raises(CheckpointError, match=r"buffer\.groups\[0\]\.metadata\.when"):
        write_checkpoint(tmp_path, 1, save_models={}, trainer_state=state, keep=2)
    assert not (tmp_path / "checkpoints").exists()  # refused before anything was written


def test_checkpoint_files_get_the_umask_mode(tmp_path):
    """safetensors writes 0600; every file of a checkpoint gets the mode of the run's files."""
    from safetensors.torch import save_file

    def save(d: Path) -> None:
        d.mkdir()
        save_file({"w": torch.zeros(2)}, str(d / "model.safetensors"))

    old = os.umask(0o022)
    try:
        ckpt = write_checkpoint(tmp_path, 1, save_models={"policy": save}, trainer_state={}, keep=2)
    finally:
        os.umask(old)
    for p in ckpt.rglob("*"):
        if p.is_file():
            assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert (ckpt / MARKER).is_file()


# ----------------------------------------------------------------------------- stored configs
EVIL = """
from pathlib import Path
Path({marker!r}).write_text("imported")

def score(prompt, response, rollout):
    return 0.0
"""


@pytest.fixture
def evil_code(tmp_path) -> tuple[str, Path]:
    """A reward reference whose import writes a marker file, and that marker."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_reward.py").write_text(EVIL.format(marker=str(marker)))
    return f"{tmp_path / 'evil_reward.py'}:score", marker


def test_a_dump_naming_code_is_inert(tmp_path, evil_code, tiny_recipe_dict, capsys):
    from rl_trainer.ops import dumps

    ref, marker = evil_code
    config = tiny_recipe_dict(tmp_path / "orig", reward={"type": ref})
    dumps.write_manifest(tmp_path / "dump", config)
    run_dir = tmp_path / "replayed"
    assert main(["replay", str(tmp_path / "dump"), "--set", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert f"reward.type: {ref}" in err and "RECIPE" in err
    # with a recipe naming other code: refused naming both
    (tmp_path / "trust_dump_reward.py").write_text(
        "def score(prompt, response, rollout):\n    return 1.0\n"
    )
    recipe = tiny_recipe_dict(
        run_dir, reward={"type": f"{tmp_path / 'trust_dump_reward.py'}:score"}
    )
    (tmp_path / "recipe.json").write_text(__import__("json").dumps(recipe))
    assert main(["replay", str(tmp_path / "dump"), str(tmp_path / "recipe.json")]) == 2
    err = capsys.readouterr().err
    assert "differs" in err and ref in err and "trust_dump_reward.py:score" in err
    assert not marker.exists()


def test_eval_of_a_checkpoint_whose_config_names_code_is_refused(
    tmp_path, evil_code, tiny_recipe_dict
):
    from rl_trainer.ops.eval_only import eval_config

    ref, marker = evil_code
    config = tiny_recipe_dict(tmp_path / "run", reward={"type": ref})
    state = {"state": {"rl_step": 1}, "config": config}
    ckpt = write_checkpoint(tmp_path / "run", 1, save_models={}, trainer_state=state, keep=2)
    with pytest.raises(ConfigError, match=r"reward\.type: .*evil_reward\.py:score"):
        eval_config(ckpt, None, [])
    assert not marker.exists()
