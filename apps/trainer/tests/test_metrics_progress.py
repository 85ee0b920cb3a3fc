"""The metrics logger counts SFT and RL steps apart: the summary's step counts and the progress
bar's one line per phase, also on a resumed run."""

from __future__ import annotations

import json

from rl_trainer.ops.metrics import PROGRESS_REFRESH_PER_S, MetricsLogger, count_steps


def _records(sft: int, rl: int) -> list[dict]:
    out = [{"phase": "sft", "step": s, "train/loss": 1.0} for s in range(1, sft + 1)]
    out.append({"phase": "rl", "step": 0, "eval/reward_mean": 0.1})  # eval before RL step 1
    out += [{"phase": "rl", "step": s, "rollout/reward_mean": 0.2} for s in range(1, rl + 1)]
    return out


def test_count_steps_skips_the_eval_record_at_rl_step_0():
    assert count_steps(_records(30, 200)) == {"sft": 30, "rl": 200}
    assert count_steps([{"phase": "rl", "step": 0}]) == {}


def _progress(logger: MetricsLogger) -> dict[str, tuple[float, float | None]]:
    return {t.description: (t.completed, t.total) for t in logger._progress.tasks}


def test_progress_has_one_line_per_phase(tmp_path):
    logger = MetricsLogger(
        tmp_path,
        tensorboard=False,
        progress=True,
        phase_steps={"sft": 3, "rl": 5},
        resume_lines=None,
    )
    try:
        assert logger._progress.live.refresh_per_second == PROGRESS_REFRESH_PER_S
        for i, rec in enumerate(_records(3, 2)):
            logger.log(rec, global_step=i)
        assert _progress(logger) == {"sft": (3, 3), "rl": (2, 5)}
    finally:
        logger.close()


def test_progress_resumes_each_phase_where_the_kept_records_end(tmp_path):
    lines = [json.dumps(r) for r in _records(3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    # the checkpoint was taken after RL step 2: its metrics line count is 3 + 1 + 2
    logger = MetricsLogger(
        tmp_path,
        tensorboard=False,
        progress=True,
        phase_steps={"sft": 0, "rl": 6},
        resume_lines=6,
    )
    try:
        assert logger.lines == 6
        assert _progress(logger) == {"rl": (2, 6)}  # no line for a phase without steps
    finally:
        logger.close()
