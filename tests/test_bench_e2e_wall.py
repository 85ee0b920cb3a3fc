"""benchmarks/e2e.py reports the end-to-end wall time (the command to the process's exit after
the last step) per system, its median over seeds, and TRL's over ours (issue #36)."""

from __future__ import annotations

from pathlib import Path

from rl_core.testing.modules import load_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
e2e = load_module("e2e_bench_wall", BENCH / "e2e.py")


def _run(total_s: float, train_s: float) -> dict:
    return {
        "train_s": train_s,
        "train_cpu_s": train_s,
        "samples": 640,
        "steps": 10,
        "response_tokens": 6400,
        "curve": [
            {"step": 0, "reward": 0.1, "train_s": 0.0},
            {"step": 10, "reward": 0.3, "train_s": train_s},
        ],
        "train_reward_mean": [0.2] * 10,
        "perf_sums_s": {},
        "peak_rss_mb": 100.0,
        "cpu_s": train_s,
        "process_total_s": total_s,
    }


def test_end_to_end_time_is_the_median_command_to_exit_and_compared_with_trl() -> None:
    ours = [_run(30.0, 4.0), _run(10.0, 4.0), _run(12.0, 4.0)]  # one slow start-up
    trl = [_run(40.0, 10.0), _run(36.0, 10.0), _run(50.0, 10.0)]
    results = {
        name: {"summary": e2e.summarize(rs, 0.9, one_process=True), "runs": rs}
        for name, rs in {"ours_sync_t2": ours, "trl_t2": trl}.items()
    }
    e2e.add_speedups(results)
    s = results["ours_sync_t2"]["summary"]
    assert s["end_to_end_s"] == 12.0
    assert results["trl_t2"]["summary"]["end_to_end_s"] == 40.0
    assert s["end_to_end_speedup_vs_trl"] == 40.0 / 12.0
    # The per-step figure still excludes start-up: 2.5x per step, 3.3x end to end here.
    assert s["speedup_vs_trl"]["samples_per_s"] == 2.5


def _with_rewards(run: dict, final: float, train: float) -> dict:
    run = dict(run)
    run["curve"] = [run["curve"][0], {**run["curve"][1], "reward": final}]
    run["train_reward_mean"] = [train] * 10
    return run


def test_bars_cover_end_to_end_and_async_reward_within_the_sync_seeds_spread() -> None:
    sync = [_with_rewards(_run(20.0, 4.0), f, t) for f, t in [(0.5, 0.4), (0.6, 0.45), (0.4, 0.3)]]
    good = [_with_rewards(_run(15.0, 3.0), f, t) for f, t in [(0.45, 0.35), (0.5, 0.4), (0.5, 0.3)]]
    bad = [_with_rewards(_run(15.0, 3.0), 0.3, 0.2) for _ in range(3)]
    trl = [_run(45.0, 10.0) for _ in range(3)]
    for async_runs, met in [(good, True), (bad, False)]:
        results = {
            name: {"summary": e2e.summarize(rs, 0.9, one_process=True), "runs": rs}
            for name, rs in {"ours_sync": sync, "ours_async": async_runs, "trl_t2": trl}.items()
        }
        e2e.add_speedups(results)
        bars = e2e.check_bars("small", results)
        assert bars["end_to_end"]["measured"] == 45.0 / 15.0 and bars["end_to_end"]["met"]
        assert bars["end_to_end"]["by"] == "ours_async"
        # 10 / 3 = 3.33x per step: above small's 2.5x async bar; sync 2.5x >= 1.6x.
        assert bars["ours_async"]["met"] and bars["ours_sync"]["met"]
        assert bars["async_reward_final_reward"]["met"] is met
        assert bars["async_reward_train_reward_last20"]["met"] is met
    assert bars["async_reward_final_reward"]["sync_by_seed"] == [0.5, 0.6, 0.4]
