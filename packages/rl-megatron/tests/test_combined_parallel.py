"""MegatronPolicy with two parallel dimensions at once, on four CPU processes (gloo).

One four-rank job (``_combined_worker.py``, launched like ``torchrun`` on 127.0.0.1 with a free
port and one thread per process) runs TP=2 x DP=2 (distributed optimizer), TP=2 x PP=2 and
PP=2 x DP=2 (distributed optimizer) once per module. Each data-parallel replica works on its
shard of the step batch (``TrainBatch.shard``); the tests replay the whole batch with
:class:`~rl_core.reference.HFPolicy` in this process on the same weights and compare log-probs,
an SFT step and an RL step, the exported weights, and a checkpoint reloaded at world 1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rl_core.algorithms import PolicyLoss
from rl_core.reference import HFPolicy
from rl_core.testing.policy import sft_loss

WORKER = Path(__file__).with_name("_combined_worker.py")
WORLD_SIZE = 4
TIMEOUT_S = 900.0
LR = 1e-3  # _combined_worker.LR
SCENARIOS = {  # name -> (model of conftest.model_dirs, (tp, pp, dp)); as _combined_worker.SCENARIOS
    "tp2_dp2": ("qwen3", (2, 1, 2)),
    "tp2_pp2": ("qwen2", (2, 2, 1)),
    "pp2_dp2": ("llama", (1, 2, 2)),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rl_loss() -> PolicyLoss:
    """The worker's RL loss: PPO clip-higher with an entropy bonus and a KL loss."""
    return PolicyLoss(
        PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28, entropy_coef=0.01, kl_coef=0.1)
    )


def _run_ranks(out: Path, models: dict[str, Path]) -> float:
    """Launch the four ranks and wait for them; the wall time in seconds.

    If a rank fails, the others (blocked in a collective) are killed at once; on timeout all
    are killed. Only the processes started here are ever killed.
    """
    port = _free_port()
    arg = json.dumps({k: str(v) for k, v in models.items()})
    procs: list[subprocess.Popen[bytes]] = []
    logs = [out / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    t0 = time.monotonic()
    for rank in range(WORLD_SIZE):
        env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD_SIZE),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONWARNINGS": "ignore",
        }
        with logs[rank].open("wb") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(out), arg],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    failure = ""
    try:
        while any(p.poll() is None for p in procs):
            if any(p.returncode for p in procs):
                failure = "a rank failed"
                break
            if time.monotonic() - t0 > TIMEOUT_S:
                failure = f"timed out after {TIMEOUT_S:.0f} s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if failure or any(p.returncode for p in procs):
        tails = [f"rank {r}:\n{log.read_text()[-3000:]}" for r, log in enumerate(logs)]
        pytest.fail(
            f"combined-parallel job: {failure or 'a rank failed'}\n" + "\n----\n".join(tails)
        )
    return time.monotonic() - t0


@pytest.fixture(scope="module")
def job(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the four-rank job once; its results keyed ``"<scenario>/<what>"``, plus
    ``_out`` (the output directory) and ``_wall_s``."""
    out = tmp_path_factory.mktemp("combined")
    wall_s = _run_ranks(out, model_dirs)
    res = torch.load(out / "results.pt", weights_only=False)
    res["_out"] = out
    res["_wall_s"] = wall_s
    return res


def _whole(parts: list[dict[str, Any]], name: str) -> torch.Tensor:
    """Per-rank ``[T]`` shards joined in data-parallel order, after checking that the ranks of
    one replica (its TP and PP ranks) returned identical values."""
    by_dp: dict[int, torch.Tensor] = {}
    for p in parts:
        seen = by_dp.setdefault(p["dp_rank"], p[name])
        assert torch.equal(seen, p[name]), f"{name}: ranks of replica {p['dp_rank']} disagree"
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def _assert_same_metrics(all_ranks: list[dict[str, float]], expected: dict[str, float]) -> None:
    """Every rank reports the same metrics; loss and grad norm within 1e-5 relative of the
    reference, the loss function's metrics within 1e-4 (tiny clip fractions, KL terms)."""
    assert all(m == all_ranks[0] for m in all_ranks), all_ranks
    mine = all_ranks[0]
    assert set(mine) == set(expected)
    for name, value in expected.items():
        tol = {"rel": 1e-5} if name in ("loss", "grad_norm") else {"rel": 1e-4, "abs": 1e-6}
        assert mine[name] == pytest.approx(value, **tol), name


def _assert_same_update(
    mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], before: dict[str, torch.Tensor]
) -> None:
    """Same weights as the reference after a step: the step moved them, the mean difference is
    below 0.1 % of the mean update, at most 0.1 % of the entries differ by more than 1e-5 (Adam's
    first steps amplify rounding where a gradient is ~eps)."""
    assert sorted(mine) == sorted(theirs)
    update = torch.cat([(theirs[n] - before[n]).abs().flatten() for n in theirs])
    diff = torch.cat([(mine[n] - theirs[n]).abs().flatten() for n in theirs])
    assert update.mean() > 1e-4, "the reference step did not move the weights"
    assert diff.mean() <= 1e-3 * update.mean(), (float(diff.mean()), float(update.mean()))
    assert float((diff > 1e-5).float().mean()) <= 1e-3
    assert float(diff.max()) <= 1e-4


@pytest.fixture(scope="module")
def reference(job: dict[str, Any], model_dirs: dict[str, Path]) -> dict[str, dict[str, Any]]:
    """HFPolicy replaying each scenario on the whole batch: log-probs and entropy, then the SFT
    step and the RL step (metrics and weights before/after each), then log-probs again."""
    out: dict[str, dict[str, Any]] = {}
    for key, (arch, _) in SCENARIOS.items():
        ref = HFPolicy(HFPolicy.Config(model_path=str(model_dirs[arch]), lr=LR))
        batch = job[f"{key}/batch"]
        r: dict[str, Any] = {"initial": ref.compute_logprobs(batch, with_entropy=True)}
        r["before_sft"] = {n: t.clone() for n, t in ref.named_weights()}
        r["sft_metrics"] = ref.train_step(batch, sft_loss)
        r["sft_weights"] = {n: t.clone() for n, t in ref.named_weights()}
        r["rl_metrics"] = ref.train_step(job[f"{key}/rl_batch"], _rl_loss())
        r["rl_weights"] = {n: t.clone() for n, t in ref.named_weights()}
        r["after"] = ref.compute_logprobs(batch).logprobs
        out[key] = r
    return out


SCENARIO_IDS = list(SCENARIOS)


@pytest.mark.parametrize("key", SCENARIO_IDS)
def test_layout_and_sharded_logprobs_match_reference(
    job: dict[str, Any], model_dirs: dict[str, Path], reference: dict[str, dict[str, Any]], key: str
) -> None:
    """Each replica's shard, joined in data-parallel order, gives HFPolicy's whole-batch
    log-probs and entropy within 1e-5; the TP/PP ranks of a replica agree exactly."""
    assert job[f"{key}/model_path"] == str(model_dirs[SCENARIOS[key][0]])
    assert job[f"{key}/sizes"] == SCENARIOS[key][1]
    assert job[f"{key}/batch"].num_shards == SCENARIOS[key][1][2]
    parts = job[f"{key}/logprob_parts"]
    expected = reference[key]["initial"]
    torch.testing.assert_close(_whole(parts, "logprobs"), expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(_whole(parts, "entropy"), expected.entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", SCENARIO_IDS)
def test_sft_then_rl_step_match_reference(
    job: dict[str, Any], reference: dict[str, dict[str, Any]], key: str
) -> None:
    """An SFT step and then a PPO + entropy + KL step over the shards give HFPolicy's
    whole-batch loss, metrics, grad norm and updated weights (gradients summed across replicas,
    shared and replicated parameters counted once), reported identically on every rank."""
    ref = reference[key]
    _assert_same_metrics(job[f"{key}/sft_metrics"], ref["sft_metrics"])
    assert job[f"{key}/sft_metrics"][0]["tokens"] == float(job[f"{key}/batch"].loss_mask.sum())
    _assert_same_update(job[f"{key}/sft_weights"][0], ref["sft_weights"], ref["before_sft"])
    _assert_same_metrics(job[f"{key}/rl_metrics"], ref["rl_metrics"])
    _assert_same_update(job[f"{key}/rl_weights"][0], ref["rl_weights"], ref["sft_weights"])
    after = _whole(job[f"{key}/after_parts"], "logprobs")
    torch.testing.assert_close(after, ref["after"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", SCENARIO_IDS)
def test_named_weights_identical_on_all_ranks(job: dict[str, Any], key: str) -> None:
    """``named_weights()`` yields the same full HF tensors (names, order, values) on all four
    ranks, whatever shard or stage each rank holds."""
    for step in ("sft", "rl"):
        exports = job[f"{key}/{step}_weights"]
        assert len(exports) == WORLD_SIZE
        for rank, weights in enumerate(exports[1:], start=1):
            assert list(weights) == list(exports[0]), (step, rank)
            for name, tensor in weights.items():
                assert torch.equal(tensor, exports[0][name]), (step, rank, name)


@pytest.mark.parametrize("key", SCENARIO_IDS)
def test_checkpoint_loads_at_world_one(
    job: dict[str, Any], model_dirs: dict[str, Path], key: str
) -> None:
    """``save()`` at the combined layout writes the exported weights bit for bit; a world-1
    MegatronPolicy loads it (``with_optimizer=False``) with version 2 and the combined layout's
    log-probs (within 1e-5)."""
    from rl_megatron.policy import MegatronPolicy

    ckpt = job["_out"] / f"ckpt_{key}"
    saved = load_file(str(ckpt / "model.safetensors"))
    exported = job[f"{key}/rl_weights"][0]
    assert set(saved) == set(exported)
    for name, tensor in exported.items():
        assert torch.equal(saved[name], tensor), name
    arch = SCENARIOS[key][0]
    policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(model_dirs[arch]), lr=LR))
    assert policy.layout.rank == 0 and policy.layout.dp_size == 1
    policy.load(ckpt, with_optimizer=False)
    assert policy.version == job[f"{key}/version"] == 2
    logp_T = policy.compute_logprobs(job[f"{key}/batch"]).logprobs
    torch.testing.assert_close(
        logp_T, _whole(job[f"{key}/after_parts"], "logprobs"), atol=1e-5, rtol=0
    )
