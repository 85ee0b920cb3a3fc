"""benchmarks/_e2e_worker.py runs our trainer and records the held-out eval curve (issue #36): the
benchmark's samples/s and time-to-target rest on it, and a trainer refactor once left the
worker's eval timing unhooked (an empty curve, the benchmark crashed after SFT)."""

from __future__ import annotations

import json
from pathlib import Path

from rl_core.testing.modules import load_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
worker = load_module("_e2e_worker_run", BENCH / "_e2e_worker.py")


def test_sft_and_two_rl_steps_record_the_eval_curve_and_the_chosen_defaults(tmp_path) -> None:
    from rl_trainer.phases import eval as evaluation

    evaluate_before = evaluation.evaluate
    base = {
        "work_dir": str(tmp_path),
        "seed": 1,
        "steps": 2,
        "eval_every": 2,
        "prompts_per_step": 4,
        "n_samples": 4,
        "max_new_tokens": 4,
        "temperature": 0.7,
        "lr": 3e-4,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "sft_steps": 2,
        "ours_threads": 1,
        "async": False,
    }
    worker.run_ours(base, str(tmp_path / "sft.json"), sft_only=True)
    # A second benchmark run in the same work dir starts afresh (not "holds an earlier run").
    worker.run_ours(base, str(tmp_path / "sft.json"), sft_only=True)
    sft = json.loads((tmp_path / "sft.json").read_text())
    assert [c["step"] for c in sft["curve"]] == [0]
    worker.run_ours({**base, "run_name": "rl"}, str(tmp_path / "rl.json"))
    rl = json.loads((tmp_path / "rl.json").read_text())
    assert [c["step"] for c in rl["curve"]] == [0, 2]
    assert rl["steps"] == 2 and rl["samples"] == 2 * 4 * 4
    assert rl["train_s"] > 0 and rl["eval_s"] > 0
    assert rl["auto_choices"]["runtime.generator_process"] is False
    # The eval timing wraps the trainer's eval for the worker's run only: this process's next
    # trainer (the rest of a test session) gets the module's own function back.
    assert evaluation.evaluate is evaluate_before
