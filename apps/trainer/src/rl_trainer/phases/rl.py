"""The RL phase: build the policy, generator, reference, critic and weight transport from the
RL start checkpoint (all at version 0), evaluate at step 0, then run the RL steps
(:mod:`rl_trainer.stages`), evaluating and checkpointing on schedule.

Synchronous (default): the round of step k runs right before step k trains. With
``rl.async_generation`` the rounds run ahead in a producer task (:mod:`rl_trainer.pipeline`)
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
from rl_trainer import lora, routing, samples, stages, truncation
from rl_trainer.assembly import (
    build_critic,
    build_generator,
    build_policy,
    build_transports,
    thread_split,
)
from rl_trainer.offload import Handover
from rl_trainer.phases import eval as evaluation
from rl_trainer.pipeline import RolloutPipeline, Weights
from rl_trainer.state import load_resumed_models
from rl_trainer.teacher import build_teacher

if TYPE_CHECKING:
    from rl_trainer.loop import Trainer

__all__ = ["rl_step", "run", "start"]


async def run(trainer: Trainer) -> bool:
    """Run the RL phase to its last step, then write the final model and a checkpoint;
    ``True`` when a signal stopped the run."""
    cfg = trainer.config
    if await start(trainer):
        return True
    if cfg.rl.async_generation:
        _start_pipeline(trainer)
    elif trainer.ready_rounds:
        raise ConfigError(
            "rl.async_generation: the checkpoint holds rollout rounds produced ahead by "
            "an async run; resume it with rl.async_generation=true."
        )
    while trainer.state["rl_step"] < cfg.rl.steps:
        rec = await rl_step(trainer)
        step = trainer.state["rl_step"]
        eval_due = evaluation.due(trainer, step)
        if trainer.pipeline is not None and (eval_due or trainer.checkpoint_due()):
            # Quiesce: the rounds before this version are done, the generator is idle.
            await trainer.pipeline.drain(trainer.policy.version)
            if eval_due:
                rec["perf/sync_time"] = await stages.sync_weights(trainer)
        if eval_due:
            rec.update(await trainer.evaluate(step))
        trainer.emit(rec)
        saved = trainer.checkpoint_due()
        if saved:
            trainer.save()
        if trainer.stop_requested and step < cfg.rl.steps:
            await trainer.stop(saved=saved)
            return True
        if trainer.pipeline is not None:
            await trainer.pipeline.release(trainer.policy.version, _weights_copy(trainer))
    if trainer.pipeline is not None:  # continuous mode: the producer pauses after its round
        await trainer.pipeline.drain(trainer.policy.version)
        if trainer.generator.weight_version != trainer.policy.version:
            # Async rounds are served the version they were scheduled with: without an eval at
            # the last step, the generator (and its engines) would end one version behind.
            await stages.sync_weights(trainer)
    trainer.handover.onload_models()  # the phase ends with the models on the device
    # The final model first: if writing it fails, the weights are already on disk
    # (HFPolicy.save writes a plain safetensors file before converting).
    lora.save_final(trainer.policy, trainer.run_dir / "final_model")
    trainer.save()
    return False


async def start(trainer: Trainer) -> bool:
    """Build the RL phase's models from the start checkpoint (policy, generator and reference
    share version 0), load a resumed checkpoint, bring the generator to the policy's weights
    and evaluate at step 0 (once per run); ``True`` when a signal stopped the run."""
    cfg, runtime = trainer.config, trainer.runtime
    start_path = trainer.rl_start_path()
    # The policies score tokens under the distribution the rollout samples from: its
    # temperature and, when it truncates, its top-p / top-k set (rl_trainer.truncation).
    sampling = {
        "temperature": cfg.rollout.sampling.temperature or 1.0,
        **truncation.policy_overrides(cfg, cfg.policy),
    }
    truncation.check_generator(cfg)
    trainer.policy = build_policy(cfg, runtime, start_path, **sampling)
    trainer.generator = await build_generator(cfg, runtime, start_path)
    routing.check_support(cfg.rollout.routing_replay, trainer.policy, trainer.generator)
    if cfg.algorithm.use_reference and trainer.policy.lora is not None:
        trainer.reference = lora.BaseReference(trainer.policy)  # adapters off: no second model
    elif cfg.algorithm.use_reference:
        trainer.reference = build_policy(cfg, runtime, start_path, role="reference", **sampling)
    trainer.adapter_sync = lora.use_adapter_sync(
        cfg.rl.lora_sync, trainer.policy, trainer.generator, ray=runtime is not None
    )
    lora.check_multi(cfg.rollout.adapter_key, trainer.policy, trainer.adapter_sync)
    trainer.teacher = build_teacher(cfg, runtime, temperature=sampling["temperature"])
    if cfg.critic is not None:
        trainer.critic = build_critic(cfg, runtime, start_path)
    trainer.transport, trainer.receiver = build_transports(cfg, runtime, start_path)
    load_resumed_models(trainer)
    trainer.first_version = (
        trainer.policy.version - trainer.state["rl_step"] * cfg.rl.updates_per_step
    )
    if trainer.generator.weight_version != trainer.policy.version:
        await stages.sync_weights(trainer)
    saved = False
    if not trainer.state["eval_at_0"]:
        rec = {"step": 0, "phase": "rl", **await trainer.evaluate(0)}
        trainer.state["eval_at_0"] = True
        trainer.emit(rec)
        saved = cfg.sft.steps > 0 and trainer.checkpoint_due()  # the warm-up's last step was due
        if saved:
            trainer.save()
    trainer.handover = Handover(trainer)
    if trainer.state["rl_step"] < cfg.rl.steps:
        await trainer.handover.start()
    if trainer.stop_requested and trainer.state["rl_step"] < cfg.rl.steps:
        await trainer.stop(saved=saved)
        return True
    return False


async def rl_step(trainer: Trainer) -> dict[str, Any]:
    """One RL step through the stages; the rollouts come from this step's round (produced now,
    or ahead of time by the pipeline)."""
    cfg = trainer.config
    t_step, c_step = time.perf_counter(), time.process_time()
    step = trainer.state["rl_step"] + 1
    if trainer.policy.version != trainer.train_version(step):
        raise RLError(
            f"rl step {step}: policy version {trainer.policy.version}, expected "
            f"{trainer.train_version(step)} ({cfg.rl.updates_per_step} optimizer step(s) per "
            "RL step: rl.ppo_epochs x rl.mini_batches_per_step; was the checkpoint written "
            "with other values?)."
        )
    t0 = time.perf_counter()
    if trainer.pipeline is None:
        round_metrics = await stages.produce_round(trainer, step)
    else:
        round_metrics = await trainer.pipeline.next_round(step)
    continuous = trainer.pipeline is not None and trainer.pipeline.continuous
    rounds, dropped = 1, 0
    while True:
        groups, staleness = stages.take_groups(
            trainer.parts.buffer,
            n=cfg.rollout.prompts_per_step,
            version=trainer.policy.version,
            max_staleness=cfg.rl.max_staleness,
            versions_per_step=cfg.rl.updates_per_step,
            wait_for_more=continuous,
        )
        if groups:
            break
        # Continuous mode: too few fresh groups (stale ones were dropped); take the next round.
        assert trainer.pipeline is not None
        dropped += staleness["rollout/stale_dropped_at_take"]
        round_metrics = await trainer.pipeline.next_round(step)  # the newer round's metrics
        rounds += 1
    if continuous:
        staleness["rollout/stale_dropped_at_take"] += dropped
        staleness["rollout/rounds_taken"] = rounds
    wait = time.perf_counter() - t0
    samples.after_take(trainer, step, groups, round_metrics, staleness)  # dumps, traces
    record: dict[str, Any] = {"step": step, "phase": "rl", **round_metrics, **staleness}
    if trainer.pipeline is None and trainer.handover.enabled:  # colocated hand-over
        await trainer.handover.before_train(record)
        record.update(stages.train(trainer, groups))
        record["perf/sync_time"] = await trainer.handover.publish(record)
    elif trainer.pipeline is None:
        record.update(stages.train(trainer, groups))
        record["perf/sync_time"] = await stages.sync_weights(trainer)
    else:
        loop = asyncio.get_running_loop()
        record.update(
            await loop.run_in_executor(trainer.train_thread, stages.train, trainer, groups)
        )
        record["perf/rollout_wait"] = wait
    trainer.state["rl_step"] = step
    record["perf/step_time"] = time.perf_counter() - t_step
    # CPU seconds of this process (all its threads; not an external engine's) over the step.
    record["perf/step_cpu_s"] = time.process_time() - c_step
    return record


def _start_pipeline(trainer: Trainer) -> None:
    """Start generating rounds ahead of training (``rl.async_generation``); the policy
    trains in its own thread so the event loop keeps driving generation."""
    cfg = trainer.config
    continuous = cfg.rl.async_mode == "continuous"
    saved = bool(trainer.resume_state.get("pipeline", {}).get("continuous", False))
    if trainer.ready_rounds and saved != continuous:
        raise ConfigError(
            f"rl.async_mode: the checkpoint holds rollout rounds produced ahead in "
            f"{'continuous' if saved else 'lockstep'} mode; resume it with rl.async_mode="
            f"{'continuous' if saved else 'lockstep'}."
        )
    trainer.train_thread = concurrent.futures.ThreadPoolExecutor(
        max_workers=1,
        thread_name_prefix="rl-train",
        initializer=torch.set_num_threads,
        initargs=(thread_split(cfg)[0],),
    )

    async def produce(step: int) -> dict[str, Any]:
        return await stages.produce_round(trainer, step)

    async def serve(version: int, weights: Weights | None) -> None:
        await stages.serve(trainer, version, weights)

    trainer.pipeline = RolloutPipeline(
        continuous=continuous,
        produce=produce,
        serve=serve,
        max_staleness=cfg.rl.max_staleness,
        first_version=trainer.first_version,
        versions_per_step=cfg.rl.updates_per_step,
        last_step=cfg.rl.steps,
        next_step=trainer.state["rl_step"] + 1,
        released=trainer.policy.version,
        ready=trainer.ready_rounds,
    )
    trainer.ready_rounds = {}
    trainer.pipeline.start()


def _weights_copy(trainer: Trainer) -> Weights | None:
    """A CPU copy of the policy's weights for a later round, or ``None`` when none is needed
    (staleness 0: the next round starts while the trainer waits for it; or the generator
    already serves this version)."""
    if trainer.config.rl.max_staleness == 0:
        return None
    if trainer.generator.weight_version >= trainer.policy.version:
        return None
    if trainer.runtime is not None:  # ray: the policy ranks keep the copy
        return trainer.policy.keep_copy()
    return lora.weights_copy(trainer)  # the adapter alone under adapter sync
