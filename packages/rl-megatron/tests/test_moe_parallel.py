"""Qwen3-MoE MegatronPolicy with expert parallelism on four CPU processes (gloo, all-to-all).

One job (``_moe_worker.py``, launched at most once per module) runs three layouts: EP=2 over
four data-parallel replicas with the distributed optimizer, EP=2 x TP=2 (expert tensor parallel
2, sequence parallel), EP=2 x PP=2, and a resume at EP=2 x TP=2 from the EP=2 x DP=4 layout's
distributed checkpoint. The tests replay the whole batch in this process with plain
transformers (per-sequence, fp32) and with :class:`~rl_hf.HFPolicy`, both with the routers
forced to the replayed experts where the policy replayed them (``_moe_reference``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rl_core.testing.modules import load_module
from rl_core.testing.policy import sft_loss
from rl_hf import HFPolicy

HERE = Path(__file__).parent
WORKER = HERE / "_moe_worker.py"


W = load_module("_rl_megatron_tests_moe_worker", WORKER)
R = load_module("_rl_megatron_tests_moe_reference", HERE / "_moe_reference.py")
KEYS = list(W.SCENARIOS)


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE of the job."""
    return R.build_qwen3_moe_model(tmp_path_factory.mktemp("moe") / "qwen3_moe")


@pytest.fixture(scope="module")
def job(moe_model: Path, tmp_path_factory: pytest.TempPathFactory, launch_ranks: Any) -> Any:
    """The 4-rank job's results (``_out``, ``_wall_s`` added)."""
    out = tmp_path_factory.mktemp("moe_job")
    t0 = time.monotonic()
    launch_ranks(
        [sys.executable, str(WORKER), str(out), str(moe_model)],
        W.WORLD_SIZE,
        timeout=900,
        log_dir=out,
    )
    res = torch.load(out / "results.pt", weights_only=False)
    res["_out"], res["_wall_s"] = out, time.monotonic() - t0
    return res


def _whole(parts: list[dict[str, Any]], name: str) -> torch.Tensor:
    """Per-rank shards joined in data-parallel order; ranks of one replica must agree."""
    by_dp: dict[int, torch.Tensor] = {}
    for p in parts:
        seen = by_dp.setdefault(p["dp_rank"], p[name])
        assert torch.equal(seen, p[name]), f"{name}: ranks of replica {p['dp_rank']} disagree"
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def _unfused(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from rl_megatron._moe import unfuse_hf_experts

    return {n: t.detach().clone() for n, t in unfuse_hf_experts(dict(weights)).items()}


@pytest.fixture(scope="module")
def reference(job: Any, moe_model: Path) -> dict[str, Any]:
    """Plain-transformers log-probs and HFPolicy's SFT step (free routing) then RL step
    (routers forced to the replayed experts) on the whole batch; the same for every layout
    (same model, batch and forced routing; checked by the tests)."""
    from transformers import AutoModelForCausalLM

    key = KEYS[0]
    batch, forced = job[f"{key}/batch"], job[f"{key}/forced"]
    hf = AutoModelForCausalLM.from_pretrained(str(moe_model), dtype=torch.float32)
    r: dict[str, Any] = {}
    r["logp"], r["own"] = R.hf_logprobs(hf, batch)
    r["logp_replay"], r["own_replay"] = R.hf_logprobs(hf, batch, forced)
    ref = HFPolicy(HFPolicy.Config(model_path=str(moe_model), lr=W.LR))
    r["entropy"] = ref.compute_logprobs(batch, with_entropy=True).entropy
    r["before_sft"] = _unfused(dict(ref.named_weights()))
    r["sft_metrics"] = ref.train_step(batch, sft_loss)
    r["sft_weights"] = _unfused(dict(ref.named_weights()))
    rl = job[f"{key}/rl_batch"]
    with R.forced_routing(ref.model, rl.routed_experts) as own:
        r["rl_metrics"] = ref.train_step(rl, W.rl_loss())
    assert sum(c.shape[0] for c in own[0]) == batch.num_tokens  # one forward per token
    r["rl_weights"] = _unfused(dict(ref.named_weights()))
    return r


def _assert_same_metrics(mine_all: list[dict[str, float]], expected: dict[str, float]) -> None:
    assert all(m == mine_all[0] for m in mine_all), mine_all
    mine = mine_all[0]
    for name in ("loss", "grad_norm"):
        assert mine[name] == pytest.approx(expected[name], rel=1e-5), name


@pytest.mark.parametrize("key", KEYS)
def test_logprobs_and_routing_match_transformers(
    job: Any, reference: dict[str, Any], key: str
) -> None:
    """Log-probs and entropy joined over the shards equal a per-sequence transformers forward
    within 1e-5, and ``routed_experts`` is the transformers router's own top-k (uint8)."""
    assert torch.equal(job[f"{key}/batch"].tokens, job[f"{KEYS[0]}/batch"].tokens)
    parts = job[f"{key}/logprob_parts"]
    torch.testing.assert_close(_whole(parts, "logprobs"), reference["logp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(_whole(parts, "entropy"), reference["entropy"], atol=1e-5, rtol=0)
    routed = _whole(parts, "routed")
    assert routed.dtype == torch.uint8
    assert torch.equal(routed.long(), reference["own"])


@pytest.mark.parametrize("key", KEYS)
def test_replay_uses_the_given_experts(job: Any, reference: dict[str, Any], key: str) -> None:
    """Replaying random experts gives the log-probs of a transformers forward whose routers are
    forced to them (within 1e-5; they differ from the free forward), and still reports the
    router's own choice under that replay."""
    assert torch.equal(job[f"{key}/forced"], job[f"{KEYS[0]}/forced"])
    parts = job[f"{key}/replay_parts"]
    logp = _whole(parts, "logprobs")
    torch.testing.assert_close(logp, reference["logp_replay"], atol=1e-5, rtol=0)
    assert float((reference["logp_replay"] - reference["logp"]).abs().max()) > 1e-3
    assert torch.equal(_whole(parts, "routed").long(), reference["own_replay"])


@pytest.mark.parametrize("key", KEYS)
def test_sft_then_replayed_rl_step_match_reference(
    job: Any, reference: dict[str, Any], key: str, assert_same_update: Any
) -> None:
    """An SFT step, then a PPO + entropy + KL step replaying the forced routing, give
    HFPolicy's loss, grad norm and weights (its routers forced likewise), identical on every
    rank; the log-probs after the steps agree between layouts."""
    ref = reference
    _assert_same_metrics(job[f"{key}/sft_metrics"], ref["sft_metrics"])
    assert_same_update(
        job[f"{key}/sft_weights"][0], ref["sft_weights"], ref["before_sft"], max_abs=1e-4
    )
    _assert_same_metrics(job[f"{key}/rl_metrics"], ref["rl_metrics"])
    assert_same_update(
        job[f"{key}/rl_weights"][0], ref["rl_weights"], ref["sft_weights"], max_abs=1e-4
    )
    for weights in job[f"{key}/rl_weights"][1:]:
        assert all(torch.equal(weights[n], job[f"{key}/rl_weights"][0][n]) for n in weights)
    torch.testing.assert_close(
        _whole(job[f"{key}/after_parts"], "logprobs"),
        _whole(job[f"{KEYS[0]}/after_parts"], "logprobs"),
        atol=1e-5,
        rtol=0,
    )


@pytest.mark.parametrize("key", KEYS)
def test_checkpoint_is_a_transformers_model(job: Any, key: str, moe_model: Path) -> None:
    """``save()`` at an expert-parallel layout writes every expert under its per-expert
    Hugging Face name (the exported weights bit for bit), and transformers loads it."""
    from transformers import AutoModelForCausalLM

    ckpt = job["_out"] / f"ckpt_{key}"
    saved = load_file(str(ckpt / "model.safetensors"))
    exported = job[f"{key}/rl_weights"][0]
    assert set(saved) == set(exported)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in saved
    assert all(torch.equal(saved[n], t) for n, t in exported.items())
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
    assert _unfused(dict(hf.state_dict())).keys() == saved.keys()


def test_resume_across_layouts(job: Any, assert_same_update: Any) -> None:
    """A policy at EP=2 x TP=2 that loads the distributed checkpoint (weights and distributed
    optimizer state) saved at EP=2 x DP=4 after the SFT step takes EP=2 x DP=4's RL step: the
    same loss and grad norm, the same weights within the dense tolerances."""
    assert job["ep2_tp2/resumed_version"] == 1
    _assert_same_metrics(job["ep2_tp2/resumed_rl_metrics"], job["ep2_dp4/rl_metrics"][0])
    assert_same_update(
        job["ep2_tp2/resumed_rl_weights"][0],
        job["ep2_dp4/rl_weights"][0],
        job["ep2_dp4/sft_weights"][0],
        max_abs=1e-5,
    )
