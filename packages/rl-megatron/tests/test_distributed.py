"""MegatronPolicy across two CPU processes (gloo): DP=2, TP=2, distributed optimizer, relayout.

One two-rank job (``_dist_worker.py``, launched like ``torchrun`` on 127.0.0.1 with a free port
and one thread per process) runs every scenario once per module; the tests compare its results
with :class:`~rl_hf.HFPolicy` run in this process on the same weights and batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rl_core.testing.policy import random_batch, sft_loss
from rl_hf import HFPolicy

WORKER = Path(__file__).with_name("_dist_worker.py")
LENGTHS = [5, 8, 3, 6, 4, 7]
LR = 1e-3


@pytest.fixture(scope="module")
def job(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, launch_ranks: Any
) -> dict[str, Any]:
    """Run the two-rank job once; its results keyed by scenario, plus the output directory."""
    out = tmp_path_factory.mktemp("dist")
    models = json.dumps({k: str(v) for k, v in model_dirs.items()})
    launch_ranks([sys.executable, str(WORKER), str(out), models], 2)
    res = torch.load(out / "results.pt", weights_only=False)
    res["_out"] = out
    return res


def _reference(path: Path, vocab_batch: bool = True) -> tuple[HFPolicy, Any]:
    ref = HFPolicy(HFPolicy.Config(model_path=str(path), lr=LR))
    batch = random_batch(
        ref.model_shape.vocab_size, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6)
    )
    return ref, batch


@pytest.mark.parametrize("dist_opt", [0, 1])
def test_dp2_logprobs_and_step_match_reference(
    job: dict[str, Any], model_dirs: dict[str, Path], dist_opt: int, assert_same_update: Any
) -> None:
    """DP=2 (plain DDP and distributed optimizer): log-probs within 1e-5 of HFPolicy; one step
    over the two shards gives the reference's whole-batch loss, grad norm and update (gradients
    summed, not averaged, across data-parallel ranks); every rank reports the same metrics."""
    key = f"dp2_distopt{dist_opt}"
    ref, batch = _reference(model_dirs["qwen2"])
    expected = ref.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(job[f"{key}/logprobs"], expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(job[f"{key}/entropy"], expected.entropy, atol=1e-5, rtol=0)
    before = {n: t.clone() for n, t in ref.named_weights()}
    m_ref = ref.train_step(batch, sft_loss)
    m = job[f"{key}/metrics"]
    assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    assert m["tokens"] == float(batch.loss_mask.sum())
    assert job[f"{key}/metrics_all_ranks"][0] == job[f"{key}/metrics_all_ranks"][1]
    assert_same_update(job[f"{key}/weights"], dict(ref.named_weights()), before)


@pytest.mark.parametrize(
    ("layout", "arch"),
    [("tp2", "qwen2"), ("tp2", "llama"), ("tp2", "qwen3"), ("pp2", "qwen2"), ("pp2", "llama")],
)
def test_roundtrip_exact_and_logprobs_match(
    job: dict[str, Any], model_dirs: dict[str, Path], layout: str, arch: str
) -> None:
    """TP=2 / PP=2: HF -> Megatron shards/stages -> gathered HF tensors is bitwise exact (vocab
    padding trimmed, tied lm_head omitted, the last stage's embedding copy not exported);
    log-probs and entropy within 1e-5 of HFPolicy, identical on both ranks."""
    key = f"{layout}_{arch}"
    original = load_file(str(model_dirs[arch] / "model.safetensors"))
    exported = job[f"{key}/exported"]
    tied = "lm_head.weight" not in exported
    assert set(exported) == set(original) - ({"lm_head.weight"} if tied else set())
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    ref, batch = _reference(model_dirs[arch])
    expected = ref.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(job[f"{key}/logprobs"], expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(job[f"{key}/entropy"], expected.entropy, atol=1e-5, rtol=0)
    assert job[f"{key}/tp_ranks_equal"]


@pytest.mark.parametrize(
    ("layout", "arch"), [("tp2", "qwen2"), ("tp2", "llama"), ("pp2", "qwen2"), ("pp2", "llama")]
)
def test_train_step_matches_reference(
    job: dict[str, Any],
    model_dirs: dict[str, Path],
    layout: str,
    arch: str,
    assert_same_update: Any,
) -> None:
    """TP=2 / PP=2 (1F1B over two stages; tied embeddings synchronised between them): one step
    gives HFPolicy's loss, grad norm (no double counting of replicated or shared parameters)
    and parameter update."""
    ref, batch = _reference(model_dirs[arch])
    before = {n: t.clone() for n, t in ref.named_weights()}
    m_ref = ref.train_step(batch, sft_loss)
    m = job[f"{layout}_{arch}/metrics"]
    assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-5)
    assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-5)
    assert_same_update(job[f"{layout}_{arch}/weights"], dict(ref.named_weights()), before)


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_rl_loss_step_matches_reference(
    job: dict[str, Any], model_dirs: dict[str, Path], layout: str, assert_same_update: Any
) -> None:
    """PPO clip-higher + entropy bonus + KL loss from rl-core at TP=2 / PP=2: the loss, its
    metrics, the grad norm and the update equal HFPolicy's (entropy gradients flow through the
    vocabulary-parallel reductions)."""
    from rl_core.algorithms import PolicyLoss

    ref = HFPolicy(HFPolicy.Config(model_path=str(model_dirs["qwen2"]), lr=LR))
    batch = job[f"{layout}_rl/batch"]
    loss_fn = PolicyLoss(
        PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1)
    )
    before = {n: t.clone() for n, t in ref.named_weights()}
    m_ref = ref.train_step(batch, loss_fn)
    m = job[f"{layout}_rl/metrics"]
    assert set(m) == set(m_ref)
    for name, value in m_ref.items():
        assert m[name] == pytest.approx(value, rel=1e-4, abs=1e-6), name
    assert_same_update(job[f"{layout}_rl/weights"], dict(ref.named_weights()), before)


def test_distributed_optimizer_resume_is_exact(job: dict[str, Any]) -> None:
    """Save (weights + optimizer state), step, load, step again: the same weights as the
    uninterrupted run, with the distributed optimizer at DP=2 and TP=2, and at PP=2."""
    assert job["dp2_distopt1/reload_version"] == 1
    assert job["dp2_distopt1/resume_max_diff"] == 0.0
    assert job["tp2_distopt/resume_max_diff"] == 0.0
    assert job["pp2/resume_max_diff"] == 0.0


def test_checkpoint_loads_across_layouts(job: dict[str, Any]) -> None:
    """A DP=2 checkpoint is a Hugging Face directory: HFPolicy loads it, and a TP=2 policy loads
    it with its optimizer state (a Megatron distributed checkpoint, see test_checkpoint.py) and
    without, with the same log-probs."""
    ckpt = job["_out"] / "ckpt_dp2"
    assert not job["relayout/optimizer_refused"]
    assert job["relayout/version"] == 1
    ref = HFPolicy(HFPolicy.Config(model_path=str(ckpt)))
    batch = random_batch(
        ref.model_shape.vocab_size, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6)
    )
    torch.testing.assert_close(
        job["relayout/logprobs"], ref.compute_logprobs(batch).logprobs, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_critic_matches_reference_critic(
    job: dict[str, Any], model_dirs: dict[str, Path], layout: str
) -> None:
    """MegatronCritic at TP=2 / PP=2: two clipped value-loss steps give HFCritic's losses, grad
    norms and values (within 2e-5); both ranks return the same values."""
    import dataclasses

    from rl_core.algorithms import ValueLoss
    from rl_hf import HFCritic

    ref = HFCritic(HFCritic.Config(model_path=str(model_dirs["qwen2"]), lr=1e-2))
    batch = random_batch(
        ref.model_shape.vocab_size, LENGTHS, seed=11, micro_batch_bounds=(0, 2, 3, 6)
    )
    returns_T = torch.where(batch.seq_index() % 2 == 0, 1.0, -1.0) * batch.loss_mask
    loss_fn = ValueLoss(ValueLoss.Config(clip=0.5))
    for m in job[f"critic_{layout}/metrics"]:
        targets = dataclasses.replace(
            batch, returns=returns_T, old_values=ref.compute_values(batch)
        )
        m_ref = ref.train_step(targets, loss_fn)
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-4)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
    expected = ref.compute_values(batch)
    assert torch.count_nonzero(expected) > 0
    torch.testing.assert_close(job[f"critic_{layout}/values"], expected, atol=2e-5, rtol=0)
    assert job[f"critic_{layout}/ranks_equal"]
