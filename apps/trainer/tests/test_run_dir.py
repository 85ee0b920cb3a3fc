"""A run owns its directory: a second run on a locked directory is refused naming the holder; a
new run into an earlier run's directory is refused unless ``--resume`` or ``--overwrite`` (which
moves the earlier run aside, never deletes it); the resolved config is in the run directory and
in every checkpoint; ``--resume`` checks the recipe and the data against the checkpoint's."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from rl_core.errors import ConfigError
from rl_trainer.cli import main
from rl_trainer.config import load_trainer_config
from rl_trainer.lifecycle.rundir import claim
from rl_trainer.loop import Trainer


def _recipe(make, run_dir: Path, **sections) -> dict:
    return make(
        run_dir,
        seed=3,
        rl={"steps": 1},
        eval={"every": 0},
        checkpoint={"every": 1, "keep": 2},
        **sections,
    )


@pytest.fixture(scope="module")
def done_run(tmp_path_factory, tiny_recipe_dict) -> Path:
    """A finished one-step run with a checkpoint."""
    run_dir = tmp_path_factory.mktemp("rundir") / "run"
    Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir))).run()
    return run_dir


def test_a_second_run_on_a_locked_directory_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from rl_trainer.lifecycle.rundir import claim
                lock = claim({str(run_dir)!r}, resume=False)
                print("locked", flush=True)
                sys.stdin.read()
                """
            ),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match=f"in use by another run.*pid.*{holder.pid}"):
            claim(run_dir, resume=True)
    finally:
        holder.communicate("", timeout=30)
    claim(run_dir, resume=True).release()  # the holder ended: the lock is free again


def test_the_run_writes_its_config_to_the_run_dir_and_every_checkpoint(done_run):
    cfg = yaml.safe_load((done_run / "config.yaml").read_text())
    assert cfg["run_dir"] == str(done_run) and cfg["seed"] == 3
    ckpt = done_run / "checkpoints" / "step_000001"
    assert yaml.safe_load((ckpt / "config.yaml").read_text()) == cfg
    assert load_trainer_config(cfg).seed == 3  # loads back as a recipe
    # files the run wrote share one mode (safetensors used to write 0600)
    modes = {
        stat.S_IMODE(p.stat().st_mode)
        for p in [*done_run.rglob("*.safetensors"), done_run / "metrics.jsonl"]
    }
    assert len(modes) == 1, modes


def test_a_new_run_into_an_earlier_run_is_refused(done_run, tiny_recipe_dict):
    before = sorted(p.name for p in done_run.iterdir())
    with pytest.raises(ConfigError, match=r"holds an earlier run.*--resume.*--overwrite"):
        Trainer(load_trainer_config(_recipe(tiny_recipe_dict, done_run)))
    assert sorted(p.name for p in done_run.iterdir()) == before


def test_overwrite_moves_the_earlier_run_aside(done_run, tmp_path, tiny_recipe_dict, capsys):
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(done_run, run_dir)
    old_metrics = (run_dir / "metrics.jsonl").read_text()
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe(tiny_recipe_dict, run_dir)))
    assert main(["run", str(recipe), "--no-report"]) == 2
    assert "holds an earlier run" in capsys.readouterr().err
    assert main(["run", str(recipe), "--no-report", "--overwrite"]) == 0
    (aside,) = tmp_path.glob("run.old-*")
    assert (aside / "metrics.jsonl").read_text() == old_metrics
    assert (aside / "checkpoints" / "step_000001").is_dir()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [json.loads(x)["step"] for x in old_metrics.splitlines()]  # one run, not two


def test_a_read_only_run_dir_is_a_config_error_naming_it(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into read-only directories")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(ConfigError, match=str(ro / "run")):
            claim(ro / "run", resume=False)
    finally:
        ro.chmod(0o755)


def _claim_elsewhere(run_dir: Path) -> subprocess.CompletedProcess:
    """Try to claim ``run_dir`` (as a resume) from another process."""
    code = f"from rl_trainer.lifecycle.rundir import claim; claim({str(run_dir)!r}, resume=True)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_trainer_holds_its_run_dir_until_its_run_ends(tmp_path, tiny_recipe_dict):
    run_dir = tmp_path / "run"
    trainer = Trainer(load_trainer_config(_recipe(tiny_recipe_dict, run_dir)))
    other = _claim_elsewhere(run_dir)
    assert other.returncode != 0 and "in use by another run" in other.stderr
    assert f'"pid": {os.getpid()}' in other.stderr  # the holder is named
    trainer.run()
    assert _claim_elsewhere(run_dir).returncode == 0  # released at the end of the run
