"""MegatronPolicy with two and three parallel dimensions at once, on four and eight CPU processes.

Two jobs (``_combined_worker.py``, launched like ``torchrun`` on 127.0.0.1 with a free port, gloo,
one thread per process), each run at most once per module and only when a test needs one of its
layouts (see ``_combined_worker.LAUNCHES``):

* 4 ranks: TP=2 x DP=2 (distributed optimizer), TP=2 x PP=2 and PP=2 x DP=2 (distributed
  optimizer);
* 8 ranks: TP=2 x PP=2 x DP=2 (distributed optimizer), plus a resume at that layout from a
  distributed checkpoint with the optimizer state (1-2 min on two loaded cores).

Each data-parallel replica works on its shard of the step batch (``TrainBatch.shard``); the tests
replay the whole batch with :class:`~rl_hf.HFPolicy` in this process on the same
weights and compare log-probs, an SFT step and an RL step, the exported weights, and a
checkpoint reloaded at world 1.
"""

from __future__ import annotations

import json
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

WORKER = Path(__file__).with_name("_combined_worker.py")
TIMEOUT_S_PER_RANK = 225.0
"""A launch is killed after this many seconds per rank (900 s at 4 ranks, 1800 s at 8)."""


W = load_module("_rl_megatron_tests_combined_worker", WORKER)
"""``_combined_worker``: the layouts, batches and losses the ranks use."""
WORLD_OF = {key: world for world, layouts in W.LAUNCHES.items() for key in layouts}
"""Scenario name -> world size of the launch that runs it."""
SCENARIO = {key: s for layouts in W.LAUNCHES.values() for key, s in layouts.items()}
"""Scenario name -> :class:`_combined_worker.Scenario`."""


RESUME_XFAIL: dict[str, str] = {}
"""Scenario name -> why its resume is a known failure (strict: a fix makes the case XPASS,
which fails, so the entry gets removed)."""


def _case(key: str, *, resume: bool = False) -> Any:
    """``key`` as a parameter, with the marks of its launch (and of a known resume failure)."""
    marks: list[Any] = []
    if resume and key in RESUME_XFAIL:
        marks.append(
            pytest.mark.xfail(strict=True, raises=AssertionError, reason=RESUME_XFAIL[key])
        )
    return pytest.param(key, id=key, marks=marks)


ALL_CASES = [_case(key) for key in SCENARIO]
RESUME_CASES = [_case(key, resume=True) for key, s in SCENARIO.items() if s.resume]


class _Launches:
    """Each world size's job, launched the first time a test asks for one of its layouts and
    kept (results or failure) for the rest of the module."""

    def __init__(self, root: Path, model_dirs: dict[str, Path], launch_ranks: Any) -> None:
        self._root = root
        self._models = model_dirs
        self._launch = launch_ranks
        self._done: dict[int, dict[str, Any] | str] = {}

    def __call__(self, world_size: int) -> dict[str, Any]:
        """The results of the ``world_size`` launch keyed ``"<scenario>/<what>"``, plus
        ``_out`` (its output directory) and ``_wall_s``; fails the test if the job failed."""
        if world_size not in self._done:
            out = self._root / f"world{world_size}"
            out.mkdir()
            models = json.dumps({k: str(v) for k, v in self._models.items()})
            t0 = time.monotonic()
            ranks = self._launch(
                [sys.executable, str(WORKER), str(out), models],
                world_size,
                timeout=TIMEOUT_S_PER_RANK * world_size,
                check=False,
                log_dir=out,
            )
            wall_s = time.monotonic() - t0
            if any(code for code, _ in ranks):
                self._done[world_size] = f"{world_size}-rank combined-parallel job failed:\n" + (
                    "\n----\n".join(f"rank {r}:\n{log[-3000:]}" for r, (_, log) in enumerate(ranks))
                )
            else:
                res = torch.load(out / "results.pt", weights_only=False)
                res["_out"] = out
                res["_wall_s"] = wall_s
                self._done[world_size] = res
        done = self._done[world_size]
        if isinstance(done, str):
            pytest.fail(done)
        return done


@pytest.fixture(scope="module")
def launches(
    model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, launch_ranks: Any
) -> _Launches:
    """The module's jobs, launched lazily (``-k "not tp2_pp2_dp2"`` never starts 8 ranks)."""
    return _Launches(tmp_path_factory.mktemp("combined"), model_dirs, launch_ranks)


@pytest.fixture
def job(launches: _Launches, key: str) -> dict[str, Any]:
    """The results of the launch that ran scenario ``key``."""
    return launches(WORLD_OF[key])


def _whole(parts: list[dict[str, Any]], name: str) -> torch.Tensor:
    """Per-rank ``[T]`` shards joined in data-parallel order, after checking that the ranks of
    one replica (its TP and PP ranks) returned identical values."""
    by_dp: dict[int, torch.Tensor] = {}
    for p in parts:
        seen = by_dp.setdefault(p["dp_rank"], p[name])
        assert torch.equal(seen, p[name]), f"{name}: ranks of replica {p['dp_rank']} disagree"
    return torch.cat([by_dp[d] for d in sorted(by_dp)])


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _assert_same_metrics(all_ranks: list[dict[str, float]], expected: dict[str, float]) -> None:
    """Every rank reports the same metrics; loss and grad norm within 1e-5 relative of the
    reference, the loss function's metrics within 1e-4 (tiny clip fractions, KL terms)."""
    assert all(m == all_ranks[0] for m in all_ranks), all_ranks
    mine = all_ranks[0]
    assert set(mine) == set(expected)
    for name, value in expected.items():
        tol = {"rel": 1e-5} if name in ("loss", "grad_norm") else {"rel": 1e-4, "abs": 1e-6}
        assert mine[name] == pytest.approx(value, **tol), name


def _replay(model_path: Path, job: dict[str, Any], key: str) -> dict[str, Any]:
    """HFPolicy replaying scenario ``key`` on the whole batch: log-probs and entropy, then the
    SFT step and the RL step (metrics and weights before/after each), then log-probs again."""
    ref = HFPolicy(HFPolicy.Config(model_path=str(model_path), lr=W.LR))
    batch = job[f"{key}/batch"]
    r: dict[str, Any] = {"initial": ref.compute_logprobs(batch, with_entropy=True)}
    r["before_sft"] = {n: t.clone() for n, t in ref.named_weights()}
    r["sft_metrics"] = ref.train_step(batch, sft_loss)
    r["sft_weights"] = {n: t.clone() for n, t in ref.named_weights()}
    r["rl_metrics"] = ref.train_step(job[f"{key}/rl_batch"], W.rl_loss())
    r["rl_weights"] = {n: t.clone() for n, t in ref.named_weights()}
    r["after"] = ref.compute_logprobs(batch).logprobs
    return r


@pytest.fixture(scope="module")
def _replays() -> dict[str, dict[str, Any]]:
    """Module-wide cache of :func:`_replay` by scenario name."""
    return {}


@pytest.fixture
def reference(
    _replays: dict[str, dict[str, Any]], job: dict[str, Any], model_dirs: dict[str, Path], key: str
) -> dict[str, Any]:
    """:func:`_replay` of scenario ``key`` (computed once per module)."""
    if key not in _replays:
        _replays[key] = _replay(model_dirs[SCENARIO[key].model], job, key)
    return _replays[key]


@pytest.mark.parametrize("key", ALL_CASES)
def test_layout_and_sharded_logprobs_match_reference(
    job: dict[str, Any], model_dirs: dict[str, Path], reference: dict[str, Any], key: str
) -> None:
    """Each replica's shard, joined in data-parallel order, gives HFPolicy's whole-batch
    log-probs and entropy within 1e-5; the TP/PP ranks of a replica agree exactly."""
    scenario = SCENARIO[key]
    assert job[f"{key}/model_path"] == str(model_dirs[scenario.model])
    assert job[f"{key}/sizes"] == scenario.sizes(WORLD_OF[key])
    assert job[f"{key}/batch"].num_shards == scenario.sizes(WORLD_OF[key])[2]
    parts = job[f"{key}/logprob_parts"]
    assert len(parts) == WORLD_OF[key]
    expected = reference["initial"]
    torch.testing.assert_close(_whole(parts, "logprobs"), expected.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(_whole(parts, "entropy"), expected.entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", ALL_CASES)
def test_sft_then_rl_step_match_reference(
    job: dict[str, Any], reference: dict[str, Any], key: str, assert_same_update: Any
) -> None:
    """An SFT step and then a PPO + entropy + KL step over the shards give HFPolicy's
    whole-batch loss, metrics, grad norm and updated weights (gradients summed across replicas,
    shared and replicated parameters counted once), reported identically on every rank."""
    ref = reference
    _assert_same_metrics(job[f"{key}/sft_metrics"], ref["sft_metrics"])
    assert job[f"{key}/sft_metrics"][0]["tokens"] == float(job[f"{key}/batch"].loss_mask.sum())
    assert_same_update(
        job[f"{key}/sft_weights"][0], ref["sft_weights"], ref["before_sft"], max_abs=1e-4
    )
    _assert_same_metrics(job[f"{key}/rl_metrics"], ref["rl_metrics"])
    assert_same_update(
        job[f"{key}/rl_weights"][0], ref["rl_weights"], ref["sft_weights"], max_abs=1e-4
    )
    after = _whole(job[f"{key}/after_parts"], "logprobs")
    torch.testing.assert_close(after, ref["after"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("key", ALL_CASES)
def test_named_weights_identical_on_all_ranks(job: dict[str, Any], key: str) -> None:
    """``named_weights()`` yields the same full HF tensors (names, order, values) on every
    rank, whatever shard or stage each rank holds."""
    for step in ("sft", "rl"):
        exports = job[f"{key}/{step}_weights"]
        assert len(exports) == WORLD_OF[key]
        for rank, weights in enumerate(exports[1:], start=1):
            assert list(weights) == list(exports[0]), (step, rank)
            for name, tensor in weights.items():
                assert torch.equal(tensor, exports[0][name]), (step, rank, name)


@pytest.mark.parametrize("key", ALL_CASES)
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
    path = model_dirs[SCENARIO[key].model]
    policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(path), lr=W.LR))
    assert policy.layout.rank == 0 and policy.layout.dp_size == 1
    policy.load(ckpt, with_optimizer=False)
    assert policy.version == job[f"{key}/version"] == 2
    logp_T = policy.compute_logprobs(job[f"{key}/batch"]).logprobs
    torch.testing.assert_close(
        logp_T, _whole(job[f"{key}/after_parts"], "logprobs"), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("key", RESUME_CASES)
def test_resume_with_distributed_optimizer_state(job: dict[str, Any], key: str) -> None:
    """A fresh policy at the same combined layout that loads the checkpoint saved with the
    (distributed) optimizer state after the SFT step holds the saved weights on every rank
    (version 1) and takes the uninterrupted run's RL step bitwise: the same metrics on every
    rank, the same weights. Control: the same RL step from the same weights with fresh Adam
    state (HFPolicy on the checkpoint's HF weights) lands measurably elsewhere, so the Adam
    moments really were restored."""
    assert job[f"{key}/resumed_version"] == 1
    saved = job[f"{key}/sft_weights"][0]
    for rank, loaded in enumerate(job[f"{key}/loaded_weights"]):
        differ = sorted(n for n in saved if not torch.equal(loaded[n], saved[n]))
        assert not differ, f"rank {rank} loaded other values for {differ}"
    resumed = job[f"{key}/resumed_rl_metrics"]
    assert all(m == job[f"{key}/rl_metrics"][0] for m in resumed), resumed
    for weights in job[f"{key}/resumed_rl_weights"]:
        assert _max_diff(weights, job[f"{key}/rl_weights"][0]) == 0.0

    fresh = HFPolicy(HFPolicy.Config(model_path=str(job["_out"] / f"ckpt_{key}_step1"), lr=W.LR))
    assert _max_diff(dict(fresh.named_weights()), saved) == 0.0
    fresh.train_step(job[f"{key}/rl_batch"], W.rl_loss())
    fresh_adam = {n: t.clone() for n, t in fresh.named_weights()}
    assert _max_diff(fresh_adam, job[f"{key}/rl_weights"][0]) > 1e-4
