"""Damaged checkpoints are never resumed: ``--resume`` verifies the newest checkpoint against its
manifest, then falls back to the newest intact one (and the run then equals one resumed from an
undamaged copy of it) or refuses with a :class:`CheckpointError` naming the damaged file."""

from __future__ import annotations

import json
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from rl_core.errors import CheckpointError
from rl_trainer.config import load_trainer_config
from rl_trainer.lifecycle.checkpoint import CheckpointWarning, verify_checkpoint
from rl_trainer.loop import Trainer

NEWEST, PREVIOUS = "step_000002", "step_000001"


def _recipe(make, run_dir: Path, rl_steps: int, on_damaged: str = "fallback") -> dict:
    return make(
        run_dir,
        seed=5,
        rl={"steps": rl_steps},
        eval={"every": 0},
        checkpoint={"every": 1, "keep": 3, "on_damaged": on_damaged},
    )


def _trainer(make, run_dir: Path, *, on_damaged: str = "fallback") -> Trainer:
    """A trainer resuming ``run_dir`` towards 3 RL steps."""
    return Trainer(load_trainer_config(_recipe(make, run_dir, 3, on_damaged)), resume=True)


def _strip(records):
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]


def _final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_recipe_dict) -> Path:
    """A run stopped after RL step 2 with intact checkpoints at steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("integrity") / "base"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir, 2))).run()
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == [PREVIOUS, NEWEST]
    return run_dir


@pytest.fixture(scope="module")
def from_previous(base, tmp_path_factory, tiny_recipe_dict):
    """Records and final weights of the run resumed from an undamaged copy of step 1."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    shutil.copytree(base, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / NEWEST)
    trainer = _trainer(tiny_recipe_dict, run_dir)
    assert trainer.run_state.resume.checkpoint == run_dir / "checkpoints" / PREVIOUS
    return _strip(trainer.run()), _final_weights(run_dir)


@pytest.fixture
def run_copy(base, tmp_path) -> Path:
    """A fresh copy of the base run to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(base, run_dir)
    return run_dir


# ----------------------------------------------------------------------------- corruptions
def _truncate(path: Path, size: int) -> None:
    with path.open("r+b") as f:
        f.truncate(size)


def _flip(path: Path, offset: int, bit: int = 0) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ (1 << bit)]))


def _flip_weight(ckpt: Path) -> Path:
    """Flip the lowest mantissa bit of one stored weight (inside the data, not the header)."""
    path = ckpt / "policy" / "model.safetensors"
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    _flip(path, 8 + header_len + 1000)
    return path


def _truncate_weights(ckpt: Path) -> Path:
    path = ckpt / "policy" / "model.safetensors"
    _truncate(path, path.stat().st_size // 2)
    return path


def _flip_trainer_state(ckpt: Path) -> Path:
    path = ckpt / "trainer_state.pt"
    _flip(path, path.stat().st_size // 2, bit=3)
    return path


def _delete_optimizer(ckpt: Path) -> Path:
    path = ckpt / "policy" / "rl_policy_state.pt"
    path.unlink()
    return path


def _add_stray(ckpt: Path) -> Path:
    path = ckpt / "policy" / "model-extra.safetensors"
    shutil.copy(ckpt / "policy" / "model.safetensors", path)
    return path


def _flip_manifest(ckpt: Path) -> Path:
    path = ckpt / "MANIFEST.json"
    _flip(path, path.read_bytes().index(b'"size"') + 10)
    return path


CORRUPTIONS = {
    "truncated_weights": _truncate_weights,
    "flipped_weight_bit": _flip_weight,
    "flipped_trainer_state_bit": _flip_trainer_state,
    "deleted_optimizer_state": _delete_optimizer,
    "stray_file": _add_stray,
    "flipped_manifest_bit": _flip_manifest,
}


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_fallback_resumes_the_previous_checkpoint_exactly(
    corrupt, run_copy, from_previous, tiny_recipe_dict
):
    ckpts = run_copy / "checkpoints"
    damaged = corrupt(ckpts / NEWEST)
    with pytest.warns(CheckpointWarning) as caught:
        trainer = _trainer(tiny_recipe_dict, run_copy)
    message = "\n".join(str(w.message) for w in caught)
    assert str(damaged) in message and f"Resuming from {ckpts / PREVIOUS}" in message
    assert trainer.run_state.resume.checkpoint == ckpts / PREVIOUS
    # the damaged checkpoint is set aside (kept, never picked up again)
    assert (ckpts / f"damaged-{NEWEST}").is_dir()
    records = _strip(trainer.run())
    want_records, want_weights = from_previous
    assert records == want_records
    assert _same_weights(_final_weights(run_copy), want_weights)
    assert sorted(p.name for p in ckpts.iterdir()) == [
        f"damaged-{NEWEST}",
        PREVIOUS,
        NEWEST,
        "step_000003",
    ]
    assert verify_checkpoint(ckpts / NEWEST).intact  # rewritten by the resumed run


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS.keys())
def test_refuse_names_the_damaged_file(corrupt, run_copy, tiny_recipe_dict):
    damaged = corrupt(run_copy / "checkpoints" / NEWEST)
    with pytest.raises(CheckpointError) as err:
        _trainer(tiny_recipe_dict, run_copy, on_damaged="refuse")
    assert str(damaged) in str(err.value)
    assert "checkpoint.on_damaged=fallback" in str(err.value)
    assert (run_copy / "checkpoints" / NEWEST).is_dir()  # nothing moved


def test_intact_checkpoints_resume_the_newest(run_copy, tiny_recipe_dict):
    with warnings.catch_warnings():
        warnings.simplefilter("error", CheckpointWarning)
        trainer = _trainer(tiny_recipe_dict, run_copy, on_damaged="refuse")
    assert trainer.run_state.resume.checkpoint == run_copy / "checkpoints" / NEWEST


def test_every_checkpoint_damaged_is_an_error(run_copy, tiny_recipe_dict):
    ckpts = run_copy / "checkpoints"
    a, b = _flip_weight(ckpts / NEWEST), _flip_trainer_state(ckpts / PREVIOUS)
    with pytest.raises(CheckpointError, match="every checkpoint is damaged") as err:
        _trainer(tiny_recipe_dict, run_copy)
    assert str(a) in str(err.value) and str(b) in str(err.value)
    assert "without --resume" in str(err.value)


def test_checkpoint_without_manifest_resumes_with_a_warning(run_copy, tiny_recipe_dict):
    """A checkpoint written before manifests existed: resumed unverified, with a warning."""
    ckpt = run_copy / "checkpoints" / NEWEST
    (ckpt / "MANIFEST.json").unlink()
    (ckpt / "COMPLETE").write_text(f"{NEWEST}\n")  # what the writer wrote before manifests
    with pytest.warns(CheckpointWarning, match="resuming from it unverified"):
        trainer = _trainer(tiny_recipe_dict, run_copy)
    assert trainer.run_state.resume.checkpoint == ckpt
    # a deleted manifest is damage when the marker records one
    (ckpt / "COMPLETE").write_text(f"{NEWEST}\nMANIFEST.json xxh3_128={'0' * 32}\n")
    with pytest.raises(CheckpointError, match="MANIFEST.json: missing"):
        _trainer(tiny_recipe_dict, run_copy, on_damaged="refuse")


def test_unreadable_trainer_state_of_an_unverified_checkpoint_names_it(run_copy, tiny_recipe_dict):
    """Without a manifest the damage shows only on load: a CheckpointError naming the file."""
    ckpt = run_copy / "checkpoints" / NEWEST
    (ckpt / "MANIFEST.json").unlink()
    (ckpt / "COMPLETE").write_text(f"{NEWEST}\n")
    _truncate(ckpt / "trainer_state.pt", 100)
    with pytest.warns(CheckpointWarning), pytest.raises(CheckpointError) as err:
        _trainer(tiny_recipe_dict, run_copy)
    assert str(ckpt / "trainer_state.pt") in str(err.value) and f"Delete {ckpt}" in str(err.value)


def test_manifest_covers_every_file(base):
    ckpt = base / "checkpoints" / NEWEST
    listed = {e["path"] for e in json.loads((ckpt / "MANIFEST.json").read_text())["files"]}
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert listed == on_disk - {"MANIFEST.json", "COMPLETE"}
    assert {"trainer_state.pt", "policy/model.safetensors", "policy/rl_policy_state.pt"} <= listed


# ----------------------------------------------------------------------------- fuzz
_FILES = st.sampled_from(
    [
        "COMPLETE",
        "MANIFEST.json",
        "trainer_state.pt",
        "policy/model.safetensors",
        "policy/rl_policy_state.pt",
        "policy/config.json",
        "policy/tokenizer.json",
    ]
)


def _damage(path: Path, kind: str, where: float, bit: int) -> None:
    size = path.stat().st_size
    offset = min(int(where * size), size - 1)
    if kind == "truncate":
        _truncate(path, offset)
    else:
        _flip(path, offset, bit)


@settings(max_examples=200, deadline=None)
@given(
    rel=_FILES,
    kind=st.sampled_from(["truncate", "flip"]),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
)
def test_fuzz_verify_finds_every_single_corruption(base, tmp_path_factory, rel, kind, where, bit):
    """One truncation or bit flip anywhere in any file is found and named (checksum level)."""
    ckpt = tmp_path_factory.mktemp("fuzz") / NEWEST
    shutil.copytree(base / "checkpoints" / NEWEST, ckpt)
    try:
        _damage(ckpt / rel, kind, where, bit)
        verdict = verify_checkpoint(ckpt)
        assert not verdict.intact
        assert any(str(ckpt / rel) in p for p in verdict.problems), verdict.problems
    finally:
        shutil.rmtree(ckpt)


@settings(max_examples=12, deadline=None)
@given(
    rel=_FILES,
    kind=st.sampled_from(["truncate", "flip"]),
    where=st.floats(0, 1),
    bit=st.integers(0, 7),
    mode=st.sampled_from(["fallback", "refuse"]),
)
def test_fuzz_resume_never_loads_damaged_state(
    base, tmp_path_factory, tiny_recipe_dict, rel, kind, where, bit, mode
):
    """Random damage to a random file of the newest checkpoint: the resume falls back with a
    warning naming that file, or (refuse) raises a CheckpointError naming it; nothing else."""
    run_dir = tmp_path_factory.mktemp("fuzz") / "run"
    shutil.copytree(base, run_dir)
    try:
        _resume_damaged(run_dir, tiny_recipe_dict, rel, kind, where, bit, mode)
    finally:
        shutil.rmtree(run_dir)


def _resume_damaged(run_dir, make, rel, kind, where, bit, mode) -> None:
    ckpts = run_dir / "checkpoints"
    _damage(ckpts / NEWEST / rel, kind, where, bit)
    damaged = str(ckpts / NEWEST / rel)
    if mode == "refuse":
        with pytest.raises(CheckpointError) as err:
            _trainer(make, run_dir, on_damaged="refuse")
        assert damaged in str(err.value)
    else:
        with pytest.warns(CheckpointWarning) as caught:
            trainer = _trainer(make, run_dir)
        assert any(damaged in str(w.message) for w in caught)
        assert trainer.run_state.resume.checkpoint == ckpts / PREVIOUS


def test_cli_refusal_names_the_file_and_the_fix(run_copy, tiny_recipe_dict, tmp_path, capsys):
    """``rl-train run --resume`` on a damaged checkpoint: exit 2, the file and the fix, no trace."""
    import yaml

    from rl_trainer.cli import main

    damaged = _flip_weight(run_copy / "checkpoints" / NEWEST)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_recipe_dict, run_copy, 3, "refuse")))
    assert main(["run", str(recipe), "--resume", "--no-report"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: CheckpointError: ") and "Traceback" not in err
    assert str(damaged) in err and "the manifest says" in err
    assert "checkpoint.on_damaged=fallback" in err


def test_unloadable_policy_state_of_an_unverified_checkpoint_names_it(run_copy, tiny_recipe_dict):
    """A damaged file the policy's loader trips on (no manifest to catch it first): a
    CheckpointError naming the policy directory and the fix, not the loader's raw error."""
    ckpt = run_copy / "checkpoints" / NEWEST
    (ckpt / "MANIFEST.json").unlink()
    (ckpt / "COMPLETE").write_text(f"{NEWEST}\n")
    _truncate(ckpt / "policy" / "rl_policy_state.pt", 1000)
    with pytest.warns(CheckpointWarning):
        trainer = _trainer(tiny_recipe_dict, run_copy)
    with pytest.raises(CheckpointError) as err:
        trainer.run()
    assert str(ckpt / "policy") in str(err.value) and f"delete {ckpt}" in str(err.value)
