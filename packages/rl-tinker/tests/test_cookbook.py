"""tinker-cookbook's own trainers, unmodified, against the service (short versions; the full
runs and their curves are ``benchmarks/service.py``)."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("tinker_cookbook")


def test_cookbook_supervised_train_loss_falls(serve, tiny_model, tmp_path):
    """supervised.train on the cookbook's example conversations: NLL falls over 4 steps."""
    from rl_tinker.recipes import cookbook

    svc = serve()
    rows = cookbook.supervised(
        svc.url, str(tiny_model), str(tmp_path / "sl"), batch_size=4, max_length=96, max_steps=4
    )
    nll = [r["train_mean_nll"] for r in rows if "train_mean_nll" in r]
    assert len(nll) == 4
    assert nll[-1] < nll[0]


def test_cookbook_rl_train_runs_on_our_task(serve, tiny_model, tmp_path):
    """rl.train (importance_sampling) on LettersTask: every step samples, scores, trains."""
    from rl_tinker.recipes import cookbook

    svc = serve()
    rows = cookbook.rl(
        svc.url,
        str(tiny_model),
        str(tmp_path / "rl"),
        steps=2,
        batch_size=2,
        group_size=4,
        max_tokens=6,
    )
    rewards = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    assert len(rewards) == 2 and all(0 <= r <= 1 and math.isfinite(r) for r in rewards)
    ops = svc.service.metrics
    assert any(k.endswith("/sample") and v["count"] >= 8 for k, v in ops.items())
    assert any(k.endswith("/optim_step") and v["count"] == 2 for k, v in ops.items())
