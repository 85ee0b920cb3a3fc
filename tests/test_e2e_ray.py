"""The ``ray`` runtime end to end, on ONE local Ray cluster for the whole file.

Every run is a real trainer (driver in this process) with its policy rank and generator engines
as Ray actors of the session cluster, weights moving through a disk transport (``disk_full``;
``disk_delta`` in the colocated run):

- a disaggregated run (two engines) learns, and ``max_staleness = 0`` on Ray reproduces it
  exactly (records and final weights);
- asynchronous generation with staleness 1 learns and trains on data exactly one version old,
  also when a generator engine is killed mid-run (its requests are retried on the other engine,
  it restarts and re-syncs to the current weights, and the run finishes);
- a colocated run learns, also when its only generator engine hangs mid-run (the call times
  out, the engine is restarted on the current weights and serves the round);
- a policy rank killed mid-run stops the run with an error (no hang) and leaves a checkpoint;
  resuming it on Ray gives exactly the uninterrupted run;
- partial rollouts: requests aborted on every engine at a weight update resume on the new
  weights, and the run learns;
- two Megatron policy ranks (tensor parallel) learn;
- on-policy distillation: the teacher scores in the policy rank.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ray = pytest.importorskip("ray")

from rl_core.errors import ConfigError, RLError  # noqa: E402
from rl_trainer.config import load_trainer_config  # noqa: E402
from rl_trainer.loop import Trainer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from learning_checks import RAY_RECIPE as RECIPE  # noqa: E402
from learning_checks import assert_learns  # noqa: E402

STEPS = RECIPE["rl"]["steps"]


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for every test of this file; no Ray process outlives it."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    node = ray._private.worker._global_node
    pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
    yield
    ray.shutdown()
    deadline = time.time() + 30
    alive = pids
    while alive and time.time() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.2)
    assert not alive, f"Ray processes left after shutdown: {alive}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _config(run_dir: Path, *overrides: str):
    return load_trainer_config({**RECIPE, "run_dir": str(run_dir)}, list(overrides))


def _run(run_dir: Path, *overrides: str, resume: bool = False) -> Trainer:
    trainer = Trainer(_config(run_dir, *overrides), resume=resume)
    trainer.run()
    return trainer


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in _rows(run_dir)]


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "final_model" / "model.safetensors"))


def _same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _assert_learns(run_dir: Path, check: str = "ray_sync") -> None:
    """The run's training reward rose as ``check`` requires (tests/learning_checks.py: the
    threshold and its margin over seeds)."""
    assert_learns(check, _rows(run_dir))


def _when(predicate, action, timeout: float = 300.0) -> threading.Thread:
    """Run ``action`` in a thread as soon as ``predicate()`` holds."""

    def watch() -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                action()
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def _rl_step_reached(run_dir: Path, step: int):
    def check() -> bool:
        path = run_dir / "metrics.jsonl"
        if not path.exists():
            return False
        lines = path.read_text().splitlines()
        return any((r := json.loads(line))["phase"] == "rl" and r["step"] >= step for line in lines)

    return check


@pytest.fixture(scope="module")
def sync_run(ray_cluster, tmp_path_factory):
    """The disaggregated synchronous reference run (two generator engines)."""
    run_dir = tmp_path_factory.mktemp("ray") / "sync"
    _run(run_dir, "checkpoint.every=25")
    return run_dir


def test_disaggregated_learns_and_staleness_zero_matches_sync(sync_run, tmp_path):
    _assert_learns(sync_run)
    rl = [r for r in _rows(sync_run) if r["phase"] == "rl" and r["step"]]
    assert all(r["rollout/staleness_max"] == 0 for r in rl)
    run0 = tmp_path / "async0"
    _run(run0, "checkpoint.every=25", "rl.async_generation=true", "rl.max_staleness=0")
    assert _records(run0) == _records(sync_run)
    assert _same_weights(_weights(run0), _weights(sync_run))


def test_async_staleness_one_learns_and_survives_a_killed_generator(ray_cluster, tmp_path):
    """Generation overlaps training in other processes; halfway through, generator engine 0
    is killed: its requests are retried on engine 1, it restarts on the current weights, and
    the run finishes on data never more than one version old."""
    run = tmp_path / "async1"
    trainer = Trainer(_config(run, "rl.async_generation=true", "rl.max_staleness=1"))
    killed: list[object] = []

    def kill() -> None:
        engine = trainer.generator.engines[0]
        killed.append(engine)
        ray.kill(engine, no_restart=True)

    watcher = _when(_rl_step_reached(run, 12), kill)
    trainer.run()
    watcher.join(timeout=5)
    assert killed, "the engine was never killed"
    pool = trainer.generator
    assert pool.restarts == 1 and pool.events[0].startswith("engine 0 died"), pool.events
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    assert all(r["rollout/groups_kept"] == 8 for r in rl)
    assert [r["rollout/staleness_max"] for r in rl] == [0] + [1] * (len(rl) - 1)
    assert all(r["rollout/stale_dropped"] == 0 for r in rl)
    _assert_learns(run, "ray_async1")


def test_partial_rollouts_resume_on_new_weights_across_engines(ray_cluster, tmp_path):
    """``rl.partial_rollouts`` on Ray: a weight update released while a round generates aborts
    the requests on both engines; they resume on the new version, so rollouts span versions
    (never beyond ``max_staleness``), and the run learns."""
    run = tmp_path / "partial"
    _run(
        run,
        "rl.async_generation=true",
        "rl.partial_rollouts=true",
        "generator.max_batch_size=1",  # one request at a time: a round outlasts a train step
        "algorithm.loss.correction=tis",
    )
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    assert sum(r["rollout/partial_interruptions"] for r in rl) >= 5
    assert any(r["rollout/multi_version_frac"] > 0 for r in rl)
    assert all(r["rollout/staleness_max"] <= 1 for r in rl)
    _assert_learns(run, "ray_partial")


def test_colocated_learns_and_survives_a_hung_generator(ray_cluster, tmp_path):
    """Policy and generator share one bundle; weights move as lossless deltas. The only engine
    stops serving (paused) at step 15: its call times out, the engine is killed and restarted
    from the host-local patched checkpoint (the current version), the round is served by the
    new engine, and the run goes on and learns."""
    run = tmp_path / "colocated"
    trainer = Trainer(
        _config(
            run,
            "runtime.layout=colocated",
            "runtime.generator.count=1",
            "runtime.generate_timeout_s=10",
            "weight_transport.type=disk_delta",
        )
    )
    assert trainer.runtime.colocated and trainer.runtime.generator_bundle(0) == 0
    watcher = _when(
        _rl_step_reached(run, 15), lambda: ray.get(trainer.generator.engines[0].pause.remote())
    )
    trainer.run()
    watcher.join(timeout=5)
    pool = trainer.generator
    assert pool.restarts == 1 and pool.events[0].startswith("engine 0 hung"), pool.events
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"]]
    assert [r["step"] for r in rl] == list(range(1, STEPS + 1))
    _assert_learns(run)


def test_policy_rank_failure_stops_and_resume_matches(sync_run, tmp_path):
    run = tmp_path / "policy_killed"
    trainer = Trainer(_config(run, "checkpoint.every=25"))
    marker = run / "checkpoints" / "step_000025" / "COMPLETE"

    def kill() -> None:
        ray.kill(trainer.runtime.ranks[0], no_restart=True)

    watcher = _when(marker.exists, kill)
    t0 = time.time()
    with pytest.raises(RLError, match="policy rank died"):
        trainer.run()
    assert time.time() - t0 < 240
    watcher.join(timeout=5)
    assert not (run / "final_model").exists()
    _run(run, "checkpoint.every=25", resume=True)
    assert _records(run) == _records(sync_run)
    assert _same_weights(_weights(run), _weights(sync_run))


def _assert_same_records(a_dir: Path, b_dir: Path) -> list[dict]:
    """The runs logged the same steps with the same metrics (floats within 1e-5)."""
    a, b = _records(a_dir), _records(b_dir)
    assert [(r["phase"], r["step"]) for r in a] == [(r["phase"], r["step"]) for r in b]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k, v in ra.items():
            if isinstance(v, float):
                assert v == pytest.approx(rb[k], rel=1e-5, abs=1e-7), k
            else:
                assert v == rb[k], k
    return a


SHORT = ("runtime.generator.count=1", "rl.steps=6", "eval.every=3", "checkpoint.every=0")


@pytest.fixture(scope="module")
def short_local_run(tmp_path_factory):
    """The short run of the critic and driver-generator tests on the local runtime."""
    run_dir = tmp_path_factory.mktemp("local") / "short"
    _run(run_dir, *SHORT, "critic.type=hf", "algorithm.advantage=gae", "runtime.type=local")
    return run_dir


def test_critic_on_the_policy_ranks_matches_the_local_run(short_local_run, tmp_path):
    """PPO with a critic on Ray: the critic lives in the policy rank actor (role ``critic``),
    values feed GAE in the driver, value steps and checkpoints run on the rank, and the run
    equals the same run on the local runtime."""
    on_ray = tmp_path / "critic_ray"
    trainer = _run(on_ray, *SHORT, "critic.type=hf", "algorithm.advantage=gae")
    assert type(trainer.critic).__name__ == "RayCritic"
    assert trainer.policy.shares_prefixes  # the ranks' HFPolicy: groups planned as locally
    a = _assert_same_records(on_ray, short_local_run)
    rl = [r for r in a if r["phase"] == "rl" and r["step"]]
    assert all(r["critic/grad_norm"] > 0 for r in rl)
    ckpt = max((on_ray / "checkpoints").iterdir())
    assert (ckpt / "critic").is_dir() and (ckpt / "policy").is_dir()


def test_generator_in_the_driver_matches_the_local_run(ray_cluster, short_local_run, tmp_path):
    """``runtime.generator.count=0``: no engine actors; the driver builds the generator (as
    for external SGLang servers, here the reference one) and loads each version the policy rank
    publishes on disk; the run equals the local one."""
    run = tmp_path / "driver_generator"
    trainer = _run(
        run, *SHORT, "critic.type=hf", "algorithm.advantage=gae", "runtime.generator.count=0"
    )
    assert trainer.runtime.pool is None and trainer.runtime.driver_generator is not None
    _assert_same_records(run, short_local_run)


@pytest.mark.slow
def test_megatron_tensor_parallel_ranks_learn(ray_cluster, tmp_path):
    """Two Megatron policy ranks (TP=2) form their own gloo world inside the actors."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "megatron_tp2"
    trainer = _run(
        run,
        "policy.type=megatron",
        "policy.tp_size=2",
        "model.init.num_kv_heads=2",
        "runtime.policy.count=2",
        "runtime.generator.count=1",
    )
    assert trainer.runtime.n_policy == 2
    assert (run / "final_model" / "model.safetensors").is_file()  # gathered from the TP shards
    _assert_learns(run, "ray_megatron")


@pytest.mark.slow
def test_megatron_data_parallel_replicas_split_the_batch_and_learn(ray_cluster, tmp_path):
    """Two Megatron policy ranks as data-parallel replicas: each trains on its FLOPs-balanced
    shard of every batch (gradients summed across replicas), so the first warm-up step equals
    the single-process reference policy's on the whole batch, and the run learns."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "megatron_dp2"
    trainer = _run(
        run,
        "policy.type=megatron",
        "runtime.policy.count=2",
        "runtime.generator.count=1",
    )
    assert trainer.policy.data_parallel_size == 2
    _assert_learns(run, "ray_megatron")
    ref = tmp_path / "reference_local"
    _run(ref, "runtime.type=local", "runtime.generator.count=1", "rl.steps=1")
    mine = next(r for r in _rows(run) if r["phase"] == "sft")
    theirs = next(r for r in _rows(ref) if r["phase"] == "sft")
    assert mine["train/loss"] == pytest.approx(theirs["train/loss"], rel=1e-4)
    assert mine["train/grad_norm"] == pytest.approx(theirs["train/grad_norm"], rel=1e-4)


@pytest.mark.slow
def test_megatron_expert_parallel_moe_replays_the_engines_routing(ray_cluster, tmp_path):
    """moe_demo's path: a tiny Qwen3-MoE trained by Megatron with EP=2 over two Ray ranks, the
    reference generator (router noise 0.3) recording routing, routing replay on. Routing and
    weights cross Ray (per-expert names into the generator's fused experts); with replay the
    trainer uses exactly the engine's experts, without it about a fifth of them differ."""
    pytest.importorskip("megatron.core")
    run = tmp_path / "megatron_ep2"
    _run(
        run,
        "policy.type=megatron",
        "policy.expert_model_parallel_size=2",
        "model.init.arch=qwen3_moe",
        "model.init.num_experts=8",
        "model.init.moe_top_k=2",
        "model.init.moe_intermediate_size=64",
        "model.init.router_init_std=0.2",
        "generator.router_logit_noise_std=0.3",
        "rollout.routing_replay=replay",
        "rollout.routing_no_replay_every=1",
        "runtime.policy.count=2",
        "runtime.generator.count=1",
        "sft.steps=2",
        "rl.steps=3",
        "eval.every=0",
        "checkpoint.every=0",
    )
    rl = [r for r in _rows(run) if r["phase"] == "rl" and r["step"]]
    assert len(rl) == 3
    for r in rl:
        assert r["routing/mismatch"] == 0.0
        assert r["routing/mismatch_no_replay"] > 0.05
        assert r["routing/logprob_mismatch"] < r["routing/logprob_mismatch_no_replay"]
        assert r["routing/bytes_per_token"] == 2.0  # 1 MoE layer x top-2 x uint8
    assert (run / "final_model" / "model.safetensors").is_file()


def test_on_policy_distillation_teacher_scores_in_the_policy_ranks(ray_cluster, tmp_path):
    """On-policy distillation on Ray: the teacher is built in the policy rank (role
    ``teacher``, frozen) and scores the student's tokens; the advantage is the per-token
    reverse KL, which falls over the steps (fixed seed)."""
    from rl_hf import TinyModelSpec, build_tiny_model

    teacher = build_tiny_model(
        tmp_path / "teacher", TinyModelSpec(**{**RECIPE["model"]["init"], "seed": 11})
    )
    run = tmp_path / "opd"
    _run(
        run,
        f"teacher.path={teacher}",
        "teacher.reward_weight=0",
        "runtime.generator.count=1",
        "sft.steps=2",
        "rl.steps=4",
        "eval.every=0",
        "checkpoint.every=0",
    )
    kl = [r["distill/reverse_kl"] for r in _rows(run) if r["phase"] == "rl" and r["step"]]
    assert len(kl) == 4 and all(k > 0 for k in kl)
    assert kl[-1] < kl[0], kl


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["weight_transport.type=inprocess"], "weight_transport.type: 'inprocess'"),
        (["runtime.policy.count=2"], "runtime.policy.count: 2 ranks"),
        (
            ["runtime.policy.count=3", "policy.type=megatron", "policy.tp_size=2"],
            "not a multiple of policy tp_size",
        ),
        (["runtime.layout=colocated"], "runtime.generator.count: 2 generators"),
        (
            ["runtime.generator.count=0", "weight_transport.type=sglang_collective"],
            "with runtime.generator.count=0",
        ),
        (
            [
                "runtime.policy.count=2",
                "policy.type=megatron",
                "critic.type=hf",
                "algorithm.advantage=gae",
            ],
            "critic.type: 'hf' trains in one process",
        ),
    ],
)
def test_unsupported_settings_fail_before_ray_starts(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        Trainer(_config(tmp_path / "bad", *overrides))
