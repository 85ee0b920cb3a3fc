"""The Weights & Biases sink, offline: the run directory wandb writes is read back and checked
(config, step metrics, the samples tables, the report image)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from rl_trainer.cli import main

wandb = pytest.importorskip("wandb")  # installed by `make test` (the [wandb] extra)


def _records(path: Path):
    """The protobuf records of a ``.wandb`` transaction log (LevelDB log format: 32 KiB blocks
    of chunks with a 7-byte header ``crc32, length, type``; wandb ships no Python reader)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # block trailer padding
            pos += left
            continue
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        if kind == 0 and n == 0:
            continue
        parts += payload
        if kind in (1, 4):  # FULL or LAST chunk
            rec = pb.Record()
            rec.ParseFromString(parts)
            parts = b""
            yield rec


def test_offline_run_holds_config_metrics_samples_and_report(
    tmp_path, tiny_recipe_dict, monkeypatch
):
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    # What a test does not check and costs seconds: git, code, pip list, machine, system stats.
    for var in ("DISABLE_GIT", "DISABLE_CODE", "X_DISABLE_META", "X_DISABLE_MACHINE_INFO"):
        monkeypatch.setenv(f"WANDB_{var}", "true")
    monkeypatch.setenv("WANDB_X_DISABLE_STATS", "true")
    monkeypatch.setenv("WANDB_X_SAVE_REQUIREMENTS", "false")
    run_dir = tmp_path / "run"
    recipe = tiny_recipe_dict(
        run_dir,
        logging={
            "tensorboard": False,
            "progress": False,
            "samples_every": 2,
            "samples_groups": 1,
            "wandb": {"mode": "offline", "project": "ops-test", "tags": ["t"]},
        },
    )
    (tmp_path / "r.json").write_text(json.dumps(recipe))
    assert main(["run", str(tmp_path / "r.json"), "--no-report"]) == 0
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (log,) = offline.glob("run-*.wandb")
    config, history, tables = {}, {}, []
    for rec in _records(log):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            config.update({u.key: json.loads(u.value_json) for u in rec.run.config.update})
            assert rec.run.project == "ops-test" and list(rec.run.tags) == ["t"]
        elif kind == "config":  # wandb may send init's config as a later config record
            config.update({u.key: json.loads(u.value_json) for u in rec.config.update})
        elif kind == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in rec.history.item
            }
            history.setdefault(items["_step"], {}).update(items)
        elif kind == "files":
            tables += [f.path for f in rec.files.files if f.path.startswith("media/table/")]
    assert config["rl"]["steps"] == 2 and config["run_dir"] == str(run_dir)
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in metrics:  # every step's numeric metrics at its step
        assert (
            history[m["step"]]["rollout/reward_mean" if m["step"] else "eval/reward_mean"]
            == (m["rollout/reward_mean" if m["step"] else "eval/reward_mean"])
        )
        if m["step"]:
            assert history[m["step"]]["train/loss"] == pytest.approx(m["train/loss"])
    assert history[2]["samples/_type"] == "table-file" and "samples/_type" not in history[1]
    (table,) = tables  # samples_every: 2 of 2 steps -> one table
    rows = json.loads((offline / "files" / table).read_text())
    assert rows["columns"][:3] == ["step", "prompt_uid", "prompt"]
    assert len(rows["data"]) == 2 and all(r[0] == 2 for r in rows["data"])  # 1 group x 2
    assert list((offline / "files" / "media" / "images").glob("report_*.png"))
