"""Megatron distributed checkpoints: exact resume, and resume at another parallel layout.

A world-of-one run in this process saves a checkpoint after two steps; one two-rank job
(``_ckpt_worker.py``, gloo on 127.0.0.1) runs TP=2, DP=2 (distributed optimizer), PP=2 (plain
and distributed optimizer) and the critic, saving and loading across layouts; the tests then
load the two-rank checkpoints here at a world of one. "Step ``k``" is the ``k``-th SFT step on the batch of ``_dist_worker``; a resumed
run must take the same step as the uninterrupted one: bitwise at the same layout, within fp32
round-off (1e-5) at another layout, and measurably different from a step with fresh Adam state.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.algorithms import ValueLoss
from rl_core.errors import CheckpointError
from rl_core.testing.policy import random_batch, sft_loss
from rl_megatron.checkpoint import DIST_DIR
from rl_megatron.critic import MegatronCritic
from rl_megatron.policy import STATE_FILE, MegatronPolicy

WORKER = Path(__file__).with_name("_ckpt_worker.py")
LENGTHS = [5, 8, 3, 6, 4, 7]
LR = 1e-3


def _batch(vocab: int) -> Any:
    """The worker's step batch (``_dist_worker.global_batch``)."""
    return random_batch(vocab, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6))


def _policy(path: Path, **kw: Any) -> MegatronPolicy:
    return MegatronPolicy(MegatronPolicy.Config(model_path=str(path), lr=LR, **kw))


def _step(policy: MegatronPolicy) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    metrics = policy.train_step(_batch(policy.model_shape.vocab_size), sft_loss)
    return metrics, {n: t.detach().clone() for n, t in policy.named_weights()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _run_job(out: Path, model_dirs: dict[str, Path], launch_ranks: Any) -> dict[str, Any]:
    models = json.dumps({k: str(v) for k, v in model_dirs.items()})
    launch_ranks([sys.executable, str(WORKER), str(out), models], 2)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.fixture(scope="module")
def job(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, launch_ranks: Any
) -> dict[str, Any]:
    """World of one: two steps, save ``w1_plain``, a third step (``w1/step3``); then the
    two-rank job; its results plus ``_out``, the directory holding every checkpoint."""
    out = tmp_path_factory.mktemp("ckpt")
    policy = _policy(model_dirs["qwen2"])
    _step(policy)
    _step(policy)
    policy.save(out / "w1_plain", with_optimizer=True)
    w1_step3 = _step(policy)
    del policy
    res = _run_job(out, model_dirs, launch_ranks)
    res["w1/step3/metrics"], res["w1/step3/weights"] = w1_step3
    res["_out"] = out
    return res


def _assert_same_step(job: dict[str, Any], mine: str, theirs: str, atol: float) -> None:
    m, t = job[f"{mine}/metrics"], job[f"{theirs}/metrics"]
    assert m["loss"] == pytest.approx(t["loss"], rel=1e-6, abs=atol)
    assert m["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-6, abs=atol)
    assert _max_diff(job[f"{mine}/weights"], job[f"{theirs}/weights"]) <= atol


@pytest.mark.parametrize("key", ["tp2", "dp2d"])
def test_resume_at_the_same_layout_is_exact(job: dict[str, Any], key: str) -> None:
    """TP=2 (plain Adam) and DP=2 (distributed optimizer): a fresh policy that loads the
    checkpoint takes the uninterrupted run's third step bitwise (loss, grad norm, weights), and
    the version and schedule position come back."""
    assert job[f"{key}/loaded_version"] == 2
    assert job[f"{key}/resumed/version"] == job[f"{key}/step3/version"] == 3
    _assert_same_step(job, f"{key}/resumed", f"{key}/step3", atol=0.0)
    assert _max_diff(job[f"{key}/step3/weights"], job[f"{key}/step2/weights"]) > 1e-4


def test_checkpoint_files_record_the_layout(job: dict[str, Any]) -> None:
    """A checkpoint is a HF directory plus the ``torch_dist`` directory; the state file records
    the format, the layout and the optimizer kind."""
    ckpt = job["_out"] / "ck_dp2d"
    assert (ckpt / "model.safetensors").is_file() and (ckpt / "config.json").is_file()
    assert (ckpt / DIST_DIR / "metadata.json").is_file()
    state = torch.load(ckpt / STATE_FILE, weights_only=True)
    assert state["format"] == 2 and state["optimizer_format"] == "torch_dist"
    assert state["layout"] == {
        "tp_size": 1,
        "pp_size": 1,
        "dp_size": 2,
        "use_distributed_optimizer": True,
    }
    assert state["version"] == 2 and state["applied_steps"] == 2


def test_reshard_between_world_one_tp2_and_pp2(job: dict[str, Any]) -> None:
    """world 1 -> TP=2, TP=2 -> PP=2 and PP=2 -> TP=2 (tied embeddings split over the stages,
    vocabulary padding 384 vs 512 rows): the step after loading equals the uninterrupted step
    at the saved layout within 1e-5."""
    _assert_same_step(job, "w1_to_tp2", "w1/step3", atol=1e-5)
    _assert_same_step(job, "tp2_to_pp2", "tp2/step3", atol=1e-5)
    _assert_same_step(job, "pp2_to_tp2", "pp2/step4", atol=1e-5)


def test_distributed_optimizer_reshards_dp2_to_pp2(job: dict[str, Any]) -> None:
    """The distributed optimizer's state saved at DP=2 (each rank holding half of every
    buffer) loads at PP=2 (DP=1): the next step equals the DP=2 run's."""
    _assert_same_step(job, "dp2d_to_pp2d", "dp2d/step3", atol=1e-5)


def test_distributed_optimizer_at_pp2_with_tied_embeddings(
    job: dict[str, Any], model_dirs: dict[str, Path]
) -> None:
    """PP=2 with the distributed optimizer and tied embeddings: the embedding has a DDP bucket
    of its own after a padded one, which megatron-core 0.16.1 saved shifted by that padding. A
    fresh PP=2 policy resumes bitwise; TP=2 and world-of-one policies (distributed optimizer)
    take the same step within 1e-5. Without the workaround the save is refused, naming the fix.
    """
    assert job["pp2d/unpadded_buckets"] >= 1  # the layout that triggers the megatron bug
    assert job["pp2d/resumed/version"] == job["pp2d/step4/version"] == 4
    _assert_same_step(job, "pp2d/resumed", "pp2d/step4", atol=0.0)
    _assert_same_step(job, "pp2d_to_tp2d", "pp2d/step4", atol=1e-5)
    assert "use_distributed_optimizer=False" in job["pp2d/refused_unfixed"]
    assert "embedding.word_embeddings.weight" in job["pp2d/refused_unfixed"]

    policy = _policy(model_dirs["qwen2"], use_distributed_optimizer=True)
    policy.load(job["_out"] / "ck_pp2d", with_optimizer=True)
    assert policy.version == 3
    metrics, weights = _step(policy)
    assert metrics["loss"] == pytest.approx(job["pp2d/step4/metrics"]["loss"], rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(job["pp2d/step4/metrics"]["grad_norm"], rel=1e-5)
    assert _max_diff(weights, job["pp2d/step4/weights"]) <= 1e-5


def test_two_rank_checkpoints_load_at_world_one(job: dict[str, Any], model_dirs: dict[str, Path]):
    """TP=2 (plain Adam) -> world 1 and DP=2 (distributed optimizer) -> world 1: the next step
    equals the two-rank run's within 1e-5. Control: the same load without the optimizer state
    (fresh Adam) gives a step that differs, so the Adam moments really were restored."""
    out = job["_out"]
    policy = _policy(model_dirs["qwen2"])
    policy.load(out / "ck_tp2", with_optimizer=True)
    assert policy.version == 2
    metrics, weights = _step(policy)
    assert metrics["loss"] == pytest.approx(job["tp2/step3/metrics"]["loss"], rel=1e-6)
    assert metrics["grad_norm"] == pytest.approx(job["tp2/step3/metrics"]["grad_norm"], rel=1e-6)
    assert _max_diff(weights, job["tp2/step3/weights"]) <= 1e-5

    policy.load(out / "ck_tp2", with_optimizer=False)
    _, fresh_adam = _step(policy)
    assert _max_diff(fresh_adam, job["tp2/step3/weights"]) > 1e-4
    del policy

    policy = _policy(model_dirs["qwen2"], use_distributed_optimizer=True)
    policy.load(out / "ck_dp2d", with_optimizer=True)
    metrics, weights = _step(policy)
    assert metrics["grad_norm"] == pytest.approx(job["dp2d/step3/metrics"]["grad_norm"], rel=1e-5)
    assert _max_diff(weights, job["dp2d/step3/weights"]) <= 1e-5


def test_other_optimizer_kind_is_refused(job: dict[str, Any], model_dirs: dict[str, Path]):
    """Distributed-optimizer state into plain Adam (and back) is refused before anything is
    read, naming the setting and the fix."""
    assert "use_distributed_optimizer=True" in job["refused_distopt"]
    policy = _policy(model_dirs["qwen2"], use_distributed_optimizer=True)
    before = {n: t.clone() for n, t in policy.named_weights()}
    with pytest.raises(CheckpointError, match=r"set policy\.use_distributed_optimizer=False"):
        policy.load(job["_out"] / "w1_plain", with_optimizer=True)
    assert policy.version == 0
    assert _max_diff(dict(policy.named_weights()), before) == 0.0


def test_critic_resumes_exactly_and_reshards(job: dict[str, Any], model_dirs: dict[str, Path]):
    """The critic at TP=2 (value head and its Adam state in the distributed checkpoint): a
    fresh critic resumes bitwise; a world-of-one critic loading it takes the same step within
    1e-5."""
    m, t = job["critic/resumed/metrics"], job["critic/step3/metrics"]
    assert m == t
    torch.testing.assert_close(
        job["critic/resumed/values"], job["critic/step3/values"], atol=0, rtol=0
    )
    critic = MegatronCritic(MegatronCritic.Config(model_path=str(model_dirs["qwen2"]), lr=1e-2))
    critic.load(job["_out"] / "ck_critic", with_optimizer=True)
    batch = _batch(critic.model_shape.vocab_size)
    returns_T = torch.where(batch.seq_index() % 2 == 0, 1.0, -1.0) * batch.loss_mask
    targets = dataclasses.replace(
        batch, returns=returns_T, old_values=critic.compute_values(batch)
    )  # as _dist_worker.critic_targets
    mine = critic.train_step(targets, ValueLoss(ValueLoss.Config(clip=0.5)))
    assert mine["loss"] == pytest.approx(t["loss"], rel=1e-5)
    assert mine["grad_norm"] == pytest.approx(t["grad_norm"], rel=1e-5)
    assert torch.count_nonzero(job["critic/step3/values"]) > 0
    torch.testing.assert_close(
        critic.compute_values(batch), job["critic/step3/values"], atol=1e-5, rtol=0
    )


def test_missing_or_old_optimizer_state_is_refused(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint saved without optimizer state, or by the per-rank format 1, is refused for
    ``with_optimizer=True`` with the fix (its weights still load with ``with_optimizer=False``)."""
    policy = _policy(model_dirs["qwen2"])
    _step(policy)
    policy.save(tmp_path / "weights_only", with_optimizer=False)
    assert not (tmp_path / "weights_only" / DIST_DIR).exists()
    with pytest.raises(CheckpointError, match="saved without optimizer state"):
        policy.load(tmp_path / "weights_only", with_optimizer=True)
    policy.save(tmp_path / "old", with_optimizer=True)
    state_path = tmp_path / "old" / STATE_FILE
    state = torch.load(state_path, weights_only=True)
    state.update(format=1, optimizer_format=None)
    torch.save(state, state_path)
    with pytest.raises(CheckpointError, match="format 1.*with_optimizer=False"):
        policy.load(tmp_path / "old", with_optimizer=True)
    policy.load(tmp_path / "old", with_optimizer=False)
    assert policy.version == 1
