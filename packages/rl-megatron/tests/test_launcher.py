"""The multi-rank launcher of these tests (``conftest._launch_ranks``): a rank forked from the
session's pre-imported zygote runs its script as ``python script args`` would (argv, ``RANK``
and the job's environment, ``__main__``, its own log), a failing rank's traceback reaches the
test and stops the others, and a hung job ends at its timeout."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

SCRIPT = """
import os, sys, time
assert __name__ == "__main__"
print("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"], "argv", sys.argv[1:],
      "extra", os.environ.get("RL_TEST_EXTRA"), "path0", sys.path[0], flush=True)
if sys.argv[1] == "fail" and os.environ["RANK"] == "1":
    raise ValueError("rank 1 fails on purpose")
if sys.argv[1] in ("fail", "hang"):
    time.sleep(120)
"""


def _script(tmp_path: Path) -> str:
    path = tmp_path / "rank_script.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return str(path)


def test_ranks_run_their_script_with_their_argv_and_environment(
    tmp_path: Path, launch_ranks: Any
) -> None:
    script = _script(tmp_path)
    out = launch_ranks(
        [sys.executable, script, "ok"], 3, env={"RL_TEST_EXTRA": "x"}, log_dir=tmp_path
    )
    for rank, (code, log) in enumerate(out):
        assert code == 0, log
        assert f"rank {rank} of 3 argv ['ok'] extra x path0 {tmp_path}" in log, log


def test_a_failing_rank_stops_the_job_and_a_hung_one_times_out(
    tmp_path: Path, launch_ranks: Any
) -> None:
    script = _script(tmp_path)
    out = launch_ranks([sys.executable, script, "fail"], 3, check=False)
    assert [code for code, _ in out] == [-9, 1, -9]  # the others were stopped, not waited for
    assert "ValueError: rank 1 fails on purpose" in out[1][1]
    out = launch_ranks([sys.executable, script, "hang"], 2, timeout=2, check=False)
    assert [code for code, _ in out] == [-9, -9]
