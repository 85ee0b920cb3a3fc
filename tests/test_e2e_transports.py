"""The trainer runs with each weight transport chosen by config, and because every transport is
lossless the runs are identical: same rewards, losses and final weights as in-process sync."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file


def _run(cli, recipe, transport):
    proc = cli("run", str(recipe), "--no-report", "--set", f"weight_transport.type={transport}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out


def _records(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def test_every_transport_matches_in_process(tiny_recipe, cli):
    runs = {}
    for transport in ("inprocess", "disk_full", "disk_delta", "broadcast"):
        recipe, run_dir = tiny_recipe(transport, rl_steps=4)
        _run(cli, recipe, transport)
        runs[transport] = run_dir
    base = _records(runs["inprocess"])
    assert any(r.get("rollout/reward_mean") for r in base)
    ref = load_file(str(runs["inprocess"] / "final_model" / "model.safetensors"))
    for transport in ("disk_full", "disk_delta", "broadcast"):
        assert _records(runs[transport]) == base, transport
        w = load_file(str(runs[transport] / "final_model" / "model.safetensors"))
        assert all(torch.equal(w[k], ref[k]) for k in ref), transport
    # The disk transports really went through disk: versioned directories with completion markers.
    full = sorted(p.name for p in (runs["disk_full"] / "weights").iterdir())
    assert full[-1] == "weight_v000004"
    assert (runs["disk_full"] / "weights" / full[-1] / "COMPLETE").exists()
    assert (runs["disk_delta"] / "weights_local" / "model.safetensors").exists()
