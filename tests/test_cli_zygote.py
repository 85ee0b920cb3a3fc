"""The ``cli`` fixture forks its ``rl-train`` runs from a pre-imported session process
(``tests/_cli_zygote.py``); a forked run must behave as the plain ``python -m rl_trainer.cli``
process it replaces: the same output, records, final weights and exit status. (Signals, process
groups, ``cwd``, ``PYTHONPATH`` and environment variables of forked runs are exercised by
``test_e2e_stop``, ``test_e2e_resume``, ``test_e2e_tools`` and ``test_e2e_subagents``.)"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file


def _records(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def _normalised(out: str, run_dir: Path) -> str:
    return re.sub(r'"wall_time_s": [0-9.]+', "", out.replace(str(run_dir), "RUN"))


def _run_both(cli, monkeypatch, *args: str) -> tuple[tuple[object, str], tuple[object, str]]:
    forked = cli(*args)
    forked_out, _ = forked.communicate(timeout=300)
    with monkeypatch.context() as m:
        m.setenv("RL_TEST_NO_ZYGOTE", "1")
        plain = cli(*args)
    plain_out, _ = plain.communicate(timeout=300)
    assert not isinstance(forked, subprocess.Popen) and isinstance(plain, subprocess.Popen)
    return (forked, forked_out), (plain, plain_out)


def test_a_forked_run_matches_a_plain_process(tiny_recipe, cli, monkeypatch):
    recipe_a, run_a = tiny_recipe("forked", rl_steps=2)
    recipe_b, run_b = tiny_recipe("plain", rl_steps=2)
    forked = cli("run", str(recipe_a), "--no-report")
    forked_out, _ = forked.communicate(timeout=300)
    with monkeypatch.context() as m:
        m.setenv("RL_TEST_NO_ZYGOTE", "1")
        plain = cli("run", str(recipe_b), "--no-report")
    plain_out, _ = plain.communicate(timeout=300)
    assert not isinstance(forked, subprocess.Popen) and isinstance(plain, subprocess.Popen)
    assert forked.returncode == plain.returncode == 0, forked_out + plain_out
    assert _normalised(forked_out, run_a) == _normalised(plain_out, run_b)
    assert _records(run_a) == _records(run_b)
    wa = load_file(str(run_a / "final_model" / "model.safetensors"))
    wb = load_file(str(run_b / "final_model" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_forked_run_fails_as_a_plain_process(tmp_path, cli, monkeypatch):
    """A user's mistake: the same message on the same stream, the same exit status."""
    missing = str(tmp_path / "missing.yaml")
    (forked, forked_out), (plain, plain_out) = _run_both(cli, monkeypatch, "run", missing)
    assert forked.returncode == plain.returncode == 2
    assert forked_out == plain_out and "missing.yaml" in forked_out
