"""benchmarks/e2e.py's run options: ``--set`` recipe overrides reach our runs' recipe, and thread
count systems (``ours_async_t2``) are parsed back to their system and count."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_core.testing.modules import load_module

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
e2e = load_module("e2e_bench", BENCH / "e2e.py")
worker = load_module("_e2e_worker", BENCH / "_e2e_worker.py")


def test_set_values_parse_as_json_or_stay_strings() -> None:
    got = e2e.parse_overrides(["policy.compile_model=true", "policy.adamw_impl=fused", "threads=2"])
    assert got == {"policy.compile_model": True, "policy.adamw_impl": "fused", "threads": 2}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        e2e.parse_overrides(["policy.compile_model"])


def test_thread_count_systems_split_for_sync_and_async() -> None:
    assert e2e.split_system("ours_async_t2") == ("ours_async", 2)
    assert e2e.split_system("ours_sync_t1") == ("ours_sync", 1)
    assert e2e.split_system("ours_async") == ("ours_async", None)
    assert e2e.label("ours_async_t2").endswith("2thr")


def test_recipe_overrides_reach_the_recipe_and_extra_wins(tmp_path: Path) -> None:
    settings = {
        "seed": 3,
        "prompts_per_step": 8,
        "n_samples": 4,
        "temperature": 0.7,
        "max_new_tokens": 8,
        "lr": 1e-4,
        "eps_low": 0.2,
        "eps_high": 0.28,
        "eval_every": 10,
        "ours_threads": 2,
        "recipe_overrides": {"policy.compile_model": True, "rl.max_staleness": 3},
    }
    rec = worker._recipe(settings, tmp_path / "run", **{"rl.max_staleness": 1})
    assert rec["policy"]["compile_model"] is True
    assert rec["rl"]["max_staleness"] == 1  # the run's own setting wins over --set
    assert rec["threads"] == 2


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")
def test_cpu_time_counts_live_child_processes() -> None:
    """The benchmark's CPU clock counts a generator process (runtime.generator_process) too."""
    import subprocess
    import sys
    import time

    before = worker.cpu_time()
    busy = "import time\nt = time.process_time()\nwhile time.process_time() - t < 30: pass\n"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.3)
        deadline = time.monotonic() + 20
        while worker.cpu_time() - before < 0.5:  # this process sleeps: the child's CPU
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        child.kill()
        child.wait()
