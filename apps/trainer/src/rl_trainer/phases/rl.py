"""The RL phase: build the policy, generator, reference, critic and weight transport from the
RL start checkpoint (all at version 0), evaluate at step 0, then run the RL steps
(:mod:`rl_trainer.step.stages`), evaluating and checkpointing on schedule.

Synchronous (default): the round of step k runs right before step k trains. With
``rl.async_generation`` the rounds run ahead in a producer task (:mod:`rl_trainer.step.pipeline`)
while the policy trains in its own thread; the generator serves exactly the version
``max_staleness`` behind, so ``max_staleness = 0`` is the synchronous run (``rl.async_mode:
continuous``: each round on the newest weights, the bound enforced per token at the take).
Both modes share the
round, the take and the train stage; only who runs the round and when the generator receives
weights differ.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

import torch

from rl_core.errors import ConfigError, RLError
from rl_trainer.assembly import (
    build_critic,
    build_generator_beside,
    build_policy,
    build_transports,
)
from rl_trainer.defaults import thread_split
from rl_trainer.lifecycle import state as checkpoints
from rl_trainer.lifecycle.state import load_resumed_models
from rl_trainer.ops import samples
from rl_trainer.phases import eval as evaluation
from rl_trainer.step import lora, routing, stages, truncation
from rl_trainer.step.offload import Handover
from rl_trainer.step.pipeline import RolloutPipeline, Weights
from rl_trainer.step.teacher import build_teacher

if TYPE_CHECKING:
    from rl_trainer.run_state import RunState

__all__ = ["rl_step", "run", "start"]


async def run(run_state: RunState) -> bool:
    """Run the RL phase to its last step, then write the final model and a checkpoint;
    ``True`` when a signal stopped the run."""
    cfg = run_state.config
    if await start(run_state):
        return True
    if cfg.rl.async_generation:
        _start_pipeline(run_state)
    elif run_state.resume.ready_rounds:
        raise ConfigError(
            "rl.async_generation: the checkpoint holds rollout rounds produced ahead by "
            "an async run; resume it with rl.async_generation=true."
        )
    while run_state.counters.rl_step < cfg.rl.steps:
        rec = await rl_step(run_state)
        step = run_state.counters.rl_step
        eval_due = evaluation.due(run_state, step)
        if run_state.pipeline is not None and (eval_due or run_state.checkpoint_due()):
            # Quiesce: the rounds before this version are done, the generator is idle.
            await run_state.pipeline.drain(run_state.models.policy.version)
            if eval_due:
                rec["perf/sync_time"] = await stages.sync_weights(run_state)
        if eval_due:
            rec.update(await evaluation.evaluate(run_state, step))
        run_state.emit(rec)
        saved = run_state.checkpoint_due()
        if saved:
            checkpoints.save(run_state)
        if run_state.stop_requested and step < cfg.rl.steps:
            await checkpoints.stop(run_state, saved=saved)
            return True
        if run_state.pipeline is not None:
            await run_state.pipeline.release(
                run_state.models.policy.version, _weights_copy(run_state)
            )
    if run_state.pipeline is not None:  # continuous mode: the producer pauses after its round
        await run_state.pipeline.drain(run_state.models.policy.version)
        if run_state.models.generator.weight_version != run_state.models.policy.version:
            # Async rounds are served the version they were scheduled with: without an eval at
            # the last step, the generator (and its engines) would end one version behind.
            await stages.sync_weights(run_state)
    run_state.handover.onload_models()  # the phase ends with the models on the device
    # The final model first: if writing it fails, the weights are already on disk
    # (HFPolicy.save writes a plain safetensors file before converting).
    lora.save_final(run_state.models.policy, run_state.run_dir / "final_model")
    checkpoints.save(run_state)
    return False


async def start(run_state: RunState) -> bool:
    """Build the RL phase's models from the start checkpoint (policy, generator and reference
    share version 0), load a resumed checkpoint, bring the generator to the policy's weights
    and evaluate at step 0 (once per run); ``True`` when a signal stopped the run."""
    cfg, runtime = run_state.config, run_state.runtime
    start_path = run_state.rl_start_path()
    # The policies score tokens under the distribution the rollout samples from: its
    # temperature and, when it truncates, its top-p / top-k set (rl_trainer.step.truncation).
    sampling = {
        "temperature": cfg.rollout.sampling.temperature or 1.0,
        **truncation.policy_overrides(cfg, cfg.policy),
    }
    truncation.check_generator(cfg)
    models, sync = run_state.models, run_state.sync
    # a generator process boots while this process builds (and compiles) the policy
    policy, generator = await build_generator_beside(
        cfg, runtime, start_path, lambda: build_policy(cfg, runtime, start_path, **sampling)
    )
    models.policy, models.generator = policy, generator
    routing.check_support(cfg.rollout.routing_replay, policy, generator)
    if cfg.algorithm.use_reference and policy.lora is not None:
        models.reference = lora.BaseReference(policy)  # adapters off: no second model
    elif cfg.algorithm.use_reference:
        models.reference = build_policy(cfg, runtime, start_path, role="reference", **sampling)
    sync.adapter_sync = lora.use_adapter_sync(
        cfg.rl.lora_sync, policy, generator, ray=runtime is not None
    )
    sync.base_path = start_path
    lora.check_multi(cfg.rollout.adapter_key, policy, sync.adapter_sync)
    models.teacher = build_teacher(cfg, runtime, temperature=sampling["temperature"])
    if cfg.critic is not None:
        models.critic = build_critic(cfg, runtime, start_path)
    sync.transport, sync.receiver = build_transports(cfg, runtime, start_path)
    load_resumed_models(run_state.resume, models)
    run_state.frozen.freeze()  # what this phase built lives to its end (runtime.freeze_gc)
    counters = run_state.counters
    counters.first_version = policy.version - counters.rl_step * cfg.rl.updates_per_step
    if generator.weight_version != policy.version:
        await stages.sync_weights(run_state)
    saved = False
    if not run_state.counters.eval_at_0:
        rec = {"step": 0, "phase": "rl", **await evaluation.evaluate(run_state, 0)}
        run_state.counters.eval_at_0 = True
        run_state.emit(rec)
        saved = cfg.sft.steps > 0 and run_state.checkpoint_due()  # the warm-up's last step was due
        if saved:
            checkpoints.save(run_state)
    run_state.handover = handover = Handover(
        run_state.models, run_state.runtime, enabled=bool(cfg.runtime.offload_policy)
    )
    if run_state.counters.rl_step < cfg.rl.steps:
        await handover.start()
    if run_state.stop_requested and run_state.counters.rl_step < cfg.rl.steps:
        await checkpoints.stop(run_state, saved=saved)
        return True
    return False


async def rl_step(run_state: RunState) -> dict[str, Any]:
    """One RL step through the stages; the rollouts come from this step's round (produced now,
    or ahead of time by the pipeline)."""
    cfg = run_state.config
    t_step, c_step = time.perf_counter(), time.process_time()
    step = run_state.counters.rl_step + 1
    if run_state.models.policy.version != run_state.train_version(step):
        raise RLError(
            f"rl step {step}: policy version {run_state.models.policy.version}, expected "
            f"{run_state.train_version(step)} ({cfg.rl.updates_per_step} optimizer step(s) per "
            "RL step: rl.ppo_epochs x rl.mini_batches_per_step; was the checkpoint written "
            "with other values?)."
        )
    t0 = time.perf_counter()
    if run_state.pipeline is None:
        round_metrics = await stages.produce_round(run_state, step)
    else:
        round_metrics = await run_state.pipeline.next_round(step)
    continuous = run_state.pipeline is not None and run_state.pipeline.continuous
    rounds, dropped = 1, 0
    while True:
        groups, staleness = stages.take_groups(
            run_state.parts.buffer,
            n=cfg.rollout.prompts_per_step,
            version=run_state.models.policy.version,
            max_staleness=cfg.rl.max_staleness,
            versions_per_step=cfg.rl.updates_per_step,
            wait_for_more=continuous,
        )
        if groups:
            break
        # Continuous mode: too few fresh groups (stale ones were dropped); take the next round.
        assert run_state.pipeline is not None
        dropped += staleness["rollout/stale_dropped_at_take"]
        round_metrics = await run_state.pipeline.next_round(step)  # the newer round's metrics
        rounds += 1
    if continuous:
        staleness["rollout/stale_dropped_at_take"] += dropped
        staleness["rollout/rounds_taken"] = rounds
    wait = time.perf_counter() - t0
    samples.after_take(run_state, step, groups, round_metrics, staleness)  # dumps, traces
    record: dict[str, Any] = {"step": step, "phase": "rl", **round_metrics, **staleness}
    handover = run_state.handover
    assert handover is not None
    if run_state.pipeline is None and handover.enabled:  # colocated hand-over
        await handover.before_train(record)
        record.update(stages.train(run_state, groups))
        version = run_state.models.policy.version
        record["perf/sync_time"] = await handover.publish(
            record,
            lambda: stages.publish_only(
                run_state,
                version,
                lora.policy_weights(run_state.models.policy, run_state.sync.adapter_sync),
            ),
            lambda update: stages.load_update(run_state, version, update),
        )
    elif run_state.pipeline is None:
        record.update(stages.train(run_state, groups))
        record["perf/sync_time"] = await stages.sync_weights(run_state)
    else:
        loop = asyncio.get_running_loop()
        record.update(
            await loop.run_in_executor(run_state.train_thread, stages.train, run_state, groups)
        )
        record["perf/rollout_wait"] = wait
    if cfg.runtime.trim_host_memory:  # after training and the weight sync: any backend's
        run_state.host_trim()  # freed temporaries (and an in-process generator's) go back
    run_state.counters.rl_step = step
    record["perf/step_time"] = time.perf_counter() - t_step
    # CPU seconds of this process (all its threads; not an external engine's) over the step.
    record["perf/step_cpu_s"] = time.process_time() - c_step
    return record


def _start_pipeline(run_state: RunState) -> None:
    """Start generating rounds ahead of training (``rl.async_generation``); the policy
    trains in its own thread so the event loop keeps driving generation."""
    cfg = run_state.config
    continuous = cfg.rl.async_mode == "continuous"
    saved = bool(run_state.resume.state.get("pipeline", {}).get("continuous", False))
    if run_state.resume.ready_rounds and saved != continuous:
        raise ConfigError(
            f"rl.async_mode: the checkpoint holds rollout rounds produced ahead in "
            f"{'continuous' if saved else 'lockstep'} mode; resume it with rl.async_mode="
            f"{'continuous' if saved else 'lockstep'}."
        )
    run_state.train_thread = concurrent.futures.ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="rl-train",
        initializer=torch.set_num_threads,
        initargs=(thread_split(cfg)[0],),
    )

    async def produce(step: int) -> dict[str, Any]:
        return await stages.produce_round(run_state, step)

    async def serve(version: int, weights: Weights | None) -> None:
        await stages.serve(run_state, version, weights)

    run_state.pipeline = RolloutPipeline(
        continuous=continuous,
        produce=produce,
        serve=serve,
        max_staleness=cfg.rl.max_staleness,
        first_version=run_state.counters.first_version,
        versions_per_step=cfg.rl.updates_per_step,
        last_step=cfg.rl.steps,
        next_step=run_state.counters.rl_step + 1,
        released=run_state.models.policy.version,
        ready=run_state.resume.ready_rounds,
    )
    run_state.resume.ready_rounds = {}
    run_state.pipeline.start()


def _weights_copy(run_state: RunState) -> Weights | None:
    """A CPU copy of the policy's weights for a later round, or ``None`` when none is needed
    (staleness 0: the next round starts while the run_state waits for it; or the generator
    already serves this version)."""
    if run_state.config.rl.max_staleness == 0:
        return None
    if run_state.models.generator.weight_version >= run_state.models.policy.version:
        return None
    if run_state.runtime is not None:  # ray: the policy ranks keep the copy
        return run_state.models.policy.keep_copy()
    return lora.weights_copy(
        run_state.models.policy, run_state.sync.adapter_sync
    )  # the adapter alone under adapter sync
