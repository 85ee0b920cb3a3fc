"""File-system failures end in named errors: a read-only run directory, a read-only resume that
must set a damaged checkpoint aside, a file-size limit hit inside ``torch.save`` and a full disk
are a :class:`ConfigError` / :class:`CheckpointError` naming the path and the cause, and nothing
half-written is taken for a checkpoint.

The real-file-system variants mount a small tmpfs (root only; skipped otherwise, saying why);
the others simulate the error where the writer raises it."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rl_core.errors import CheckpointError, ConfigError
from rl_trainer.lifecycle import checkpoint as ckpt_mod
from rl_trainer.lifecycle.checkpoint import latest_checkpoint, resume_checkpoint, write_checkpoint
from rl_trainer.lifecycle.rundir import claim

BIG = {"blob": torch.zeros(512 * 1024)}  # 2 MiB of float32


def _leftovers(run_dir: Path) -> list[str]:
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@contextlib.contextmanager
def _tmpfs(path: Path, *options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``path`` for the block (skips the test when mounting is not allowed)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    opts = ",".join(("size=1m", *options))
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], check=False)
    if res.returncode != 0:
        pytest.skip("mount -t tmpfs is not permitted here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _remount_ro(path: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)


# ----------------------------------------------------------------------------- full disk
def test_a_full_disk_is_a_checkpoint_error_and_leaves_nothing(tmp_path):
    with _tmpfs(tmp_path / "small") as small:
        run_dir = small / "run"
        with pytest.raises(CheckpointError) as err:
            write_checkpoint(run_dir, 1, save_models={}, trainer_state=BIG, keep=2)
        msg = str(err.value)
        assert str(run_dir / "checkpoints") in msg and "step_000001" in msg
        assert "free space" in msg or "ENOSPC" in msg
        assert _leftovers(run_dir) == [] and latest_checkpoint(run_dir) is None


def test_enospc_from_the_writer_names_the_path_and_the_cause(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, 1, save_models={}, trainer_state={"a": 1}, keep=2)

    def full(obj, f, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    monkeypatch.setattr(ckpt_mod.torch, "save", full)
    with pytest.raises(CheckpointError, match=r"ENOSPC: No space left on device; the disk is full"):
        write_checkpoint(tmp_path, 2, save_models={}, trainer_state={"a": 2}, keep=2)
    assert _leftovers(tmp_path) == ["step_000001"]  # the half-written step 2 is gone
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_000001"


# ----------------------------------------------------------------------------- file-size limit
def test_a_file_size_limit_inside_torch_save_is_a_checkpoint_error(tmp_path):
    script = textwrap.dedent(
        f"""
        import resource, signal, sys
        from pathlib import Path
        import torch
        from rl_core.errors import CheckpointError
        from rl_trainer.lifecycle.checkpoint import write_checkpoint, latest_checkpoint
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        run_dir = Path({str(tmp_path / "run")!r})
        try:
            write_checkpoint(run_dir, 1, save_models={{}},
                             trainer_state={{"blob": torch.zeros(512 * 1024)}}, keep=2)
        except CheckpointError as e:
            print("ERROR", e)
            print("LEFT", sorted(p.name for p in (run_dir / "checkpoints").iterdir()))
            print("LATEST", latest_checkpoint(run_dir))
            sys.exit(0)
        sys.exit(3)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "ERROR" in out and str(tmp_path / "run" / "checkpoints") in out
    assert "file-size limit (ulimit -f) is 1048576 bytes" in out  # the cause, found and named
    assert "LEFT []" in out and "LATEST None" in out


# ----------------------------------------------------------------------------- read-only
def test_a_read_only_run_dir_is_a_config_error(tmp_path, capsys, tiny_recipe_dict):
    import json

    from rl_trainer.cli import main

    with _tmpfs(tmp_path / "ro", "ro") as ro:
        with pytest.raises(ConfigError, match=rf"{ro / 'run'} cannot be created.*EROFS"):
            claim(ro / "run", resume=False)
        recipe = tmp_path / "r.json"
        recipe.write_text(json.dumps(tiny_recipe_dict(ro / "run")))
        assert main(["run", str(recipe), "--no-report"]) == 2
        assert f"run_dir: {ro / 'run'} cannot be created" in capsys.readouterr().err


def test_a_read_only_resume_that_must_set_a_damaged_checkpoint_aside(tmp_path):
    with _tmpfs(tmp_path / "fs") as fs:
        run_dir = fs / "run"
        for step in (1, 2):
            write_checkpoint(run_dir, step, save_models={}, trainer_state={"s": step}, keep=2)
        damaged = run_dir / "checkpoints" / "step_000002"
        with (damaged / "trainer_state.pt").open("r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 1]))
        _remount_ro(fs)
        with pytest.raises(CheckpointError) as err:
            resume_checkpoint(run_dir, on_damaged="fallback")
        msg = str(err.value)
        assert str(damaged) in msg and "cannot be set aside" in msg and "EROFS" in msg
        assert "on_damaged=refuse" in msg


def test_setting_aside_without_permission_is_named(tmp_path, monkeypatch):
    for step in (1, 2):
        write_checkpoint(tmp_path, step, save_models={}, trainer_state={"s": step}, keep=2)
    damaged = tmp_path / "checkpoints" / "step_000002"
    (damaged / "trainer_state.pt").write_bytes(b"damaged")

    def denied(self, target):
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(Path, "rename", denied)
    with pytest.raises(CheckpointError, match=r"cannot be set aside.*EACCES"):
        resume_checkpoint(tmp_path, on_damaged="fallback")


def test_a_full_disk_while_saving_the_final_model_ends_the_run_naming_it(
    tmp_path, monkeypatch, tiny_recipe_dict
):
    """Beyond checkpoints: a run-directory write that fails (here the final model on a full
    disk) is a CheckpointError naming the file and the cause, not a raw OSError."""
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer
    from rl_trainer.step import lora

    def full(policy, directory):
        raise OSError(errno.ENOSPC, "No space left on device", str(directory / "model.safetensors"))

    monkeypatch.setattr(lora, "save_final", full)
    run_dir = tmp_path / "run"
    recipe = tiny_recipe_dict(run_dir, rl={"steps": 1}, eval={"every": 0})
    with pytest.raises(CheckpointError) as err:
        Trainer(load_trainer_config(recipe)).run()
    msg = str(err.value)
    assert str(run_dir / "final_model" / "model.safetensors") in msg and "ENOSPC" in msg
    # an OSError outside the run directory is left as it is (not the run directory's fault)
    assert ckpt_mod.run_dir_write_error(OSError(errno.ENOSPC, "x", "/elsewhere/f"), run_dir) is None
