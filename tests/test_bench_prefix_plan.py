"""benchmarks/prefix_plan.py's worker, a smoke run: three RL steps of the demo recipe at a
512-token cap, token-only and grouped planning, each in its own process. Grouping a GRPO group
into one micro-batch makes the model run on fewer of the packed tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_plan.py"


def _case(plan: str, work: Path) -> dict:
    out = subprocess.run(
        [sys.executable, str(BENCH), "--worker", plan, "512", "3", str(work)],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_grouped_plan_runs_the_model_on_fewer_tokens(tmp_path: Path) -> None:
    token, grouped = _case("token", tmp_path), _case("grouped", tmp_path)
    assert token["steps"] == grouped["steps"] == 3
    # the same rollouts up to float rounding of the updates (the plans order sums differently)
    assert abs(token["packed_tokens"] - grouped["packed_tokens"]) <= 0.02 * token["packed_tokens"]
    assert grouped["forwards"] >= token["forwards"] > 3 * 2  # several micro-batches a step
    assert grouped["model_token_share"] < token["model_token_share"] - 0.1
