"""benchmarks/real_model.py's summaries (issue #36): a run's per-step train seconds and skipped
share from its metrics, samples/s pooled over interleaved seeds, and the zero-advantage skip's
saving from a skip-on and a skip-off run of the same seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_core.testing.modules import load_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
load_module("e2e", BENCH / "e2e.py")  # real_model.py imports it by that name
real_model = load_module("real_model_bench", BENCH / "real_model.py")


def _write_run(run_dir: Path, train_s: list[float], skipped: list[float]) -> None:
    records = [{"step": 0, "phase": "rl", "eval/reward_mean": 0.1, "perf/elapsed_s": 1.0}]
    for i, (t, f) in enumerate(zip(train_s, skipped)):
        records.append(
            {
                "step": i + 1,
                "phase": "rl",
                "rollout/groups_kept": 8,
                "rollout/reward_mean": 0.5,
                "perf/step_time": t + 2.0,
                "perf/step_cpu_s": t + 1.0,
                "perf/gen_time": 2.0,
                "perf/train_time": t,
                "train/skipped_samples_frac": f,
                "perf/elapsed_s": 10.0 * (i + 1),
            }
        )
    records.append({"step": 2, "phase": "rl", "eval/reward_mean": 0.7})
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_summarise_reads_steps_train_time_and_skipped_share(tmp_path: Path) -> None:
    _write_run(tmp_path / "on", [4.0, 2.0], [0.25, 0.75])
    s = real_model.summarise(tmp_path / "on", 8)
    assert s["rl_steps"] == 2 and s["samples"] == 128
    assert s["samples_per_s"] == pytest.approx(128 / 10.0, abs=1e-3)
    assert s["train_s"] == [4.0, 2.0] and s["skipped_samples_frac"] == [0.25, 0.75]
    assert s["gain"] == pytest.approx(0.6) and s["wall_time_s"] == 20.0


def test_pooled_sums_samples_over_summed_seconds() -> None:
    runs = [
        {"samples": 64, "rl_step_time_s": 16.0, "samples_per_s": 4.0, "cpu_s_per_sample": 0.25},
        {"samples": 64, "rl_step_time_s": 48.0, "samples_per_s": 1.333, "cpu_s_per_sample": 0.5},
    ]
    p = real_model.pooled(runs)
    assert p["samples_per_s"] == 2.0  # not the mean of the rates (2.67)
    assert p["cpu_s_per_sample"] == 0.375


def test_skip_saving_compares_train_time_per_step(tmp_path: Path) -> None:
    _write_run(tmp_path / "on", [4.0, 2.0], [0.25, 0.75])
    _write_run(tmp_path / "off", [5.0, 8.0], [0.0, 0.0])
    on, off = real_model.summarise(tmp_path / "on", 8), real_model.summarise(tmp_path / "off", 8)
    sv = real_model.skip_saving(on, off)
    assert sv["skipped_samples_frac"] == [0.25, 0.75]
    assert sv["train_s_skip_on"] == [4.0, 2.0] and sv["train_s_skip_off"] == [5.0, 8.0]
    assert sv["train_s_saved_share"] == pytest.approx(1 - 6 / 13, abs=1e-3)
    assert sv["steps_most_skipped"] == [2]
    assert sv["train_s_saved_share_most_skipped"] == 0.75
    assert sv["same_rewards"] is True
