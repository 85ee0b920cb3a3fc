"""The trainer's state in checkpoints: what a checkpoint captures besides the models, how it is
written on schedule, and how ``--resume`` restores it.

A checkpoint (:mod:`rl_trainer.lifecycle.checkpoint` writes and verifies it) holds the models with their
optimizers and ``trainer_state.pt``: the step counters, the policy version, the data, buffer,
sampler and pipeline states, the RNG states, how many metric lines were written, and the
config. :func:`save` writes one on schedule and :func:`stop` when a signal stops the run.
Restoring reads the trainer state at start-up (:func:`restore`); the models are loaded
when their phase builds them (:func:`load_resumed_models`), so a run resumed in the SFT phase
and one resumed in RL take the same path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_core.config import to_dict
from rl_core.errors import CheckpointError, RLError
from rl_trainer.lifecycle.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_trainer_state,
    restore_rng,
    resume_checkpoint,
    write_checkpoint,
)
from rl_trainer.lifecycle.resume_check import check_resume
from rl_trainer.lifecycle.rundir import config_text
from rl_trainer.run_state import Counters, PhaseModels, ResumePoint, RunState
from rl_trainer.step.offload import onloaded

__all__ = ["capture", "load_model", "load_resumed_models", "restore", "save", "stop"]


def capture(run: RunState, metrics_lines: int) -> dict[str, Any]:
    """The trainer state of ``run`` now (``trainer_state.pt``); ``metrics_lines``: how many
    lines ``metrics.jsonl`` holds, so a resumed run continues it exactly."""
    parts = run.parts
    return {
        "state": run.counters.as_checkpoint(),
        "policy_version": run.models.policy.version,
        "train_data": parts.train_data.state_dict(),
        "buffer": parts.buffer.state_dict(),
        "sampler": parts.sampler.state_dict(),
        "pipeline": run.pipeline.state_dict() if run.pipeline is not None else {"ready": {}},
        "rng": capture_rng(),
        "metrics_lines": metrics_lines,
        "config": to_dict(run.config),
        "data_digest": dict(run.data_digest),
    }


def save(run: RunState) -> None:
    """Write a checkpoint of ``run`` at its current step (models with optimizers, trainer
    state), keeping the newest ``checkpoint.keep``; the models are on the device while it is
    written (:func:`rl_trainer.step.offload.onloaded`). Call it from a phase, inside
    :meth:`Trainer.run() <rl_trainer.loop.Trainer.run>`."""
    if run.metrics is None:
        raise RLError("state.save: call it from a phase, inside Trainer.run().")
    offload_after = run.counters.rl_step < run.config.rl.steps
    with onloaded(run.handover, offload_after=offload_after):
        _write(run, run.metrics.lines)


async def stop(run: RunState, *, saved: bool) -> None:
    """Stop early on a signal: quiesce the rollout pipeline (async mode) and write a
    checkpoint of the step just finished unless ``saved`` (the schedule already wrote it);
    records the signal and the checkpoint in ``run.stopped_by`` and ``run.stop_checkpoint``."""
    if run.pipeline is not None:
        await run.pipeline.drain(run.models.policy.version)
    if not saved:
        save(run)
    if run.stop_signals is None:
        raise RLError("state.stop: call it from a phase, inside Trainer.run().")
    run.stopped_by = run.stop_signals.signum
    run.stop_checkpoint = latest_checkpoint(run.run_dir)


def _write(run: RunState, metrics_lines: int) -> None:
    """Write the checkpoint (:func:`save`)."""
    savers = {"policy": lambda d: run.models.policy.save(d, with_optimizer=True)}
    if run.models.critic is not None:
        savers["critic"] = lambda d: run.models.critic.save(d, with_optimizer=True)
    write_checkpoint(
        run.run_dir,
        run.counters.global_step,
        save_models=savers,
        trainer_state=capture(run, metrics_lines),
        keep=run.config.checkpoint.keep,
        files={"config.yaml": config_text(to_dict(run.config))},
    )


def restore(run: RunState) -> None:
    """Read the newest intact checkpoint's trainer state into ``run`` (every file is verified
    against the checkpoint's manifest first; ``checkpoint.on_damaged`` says what a damaged one
    does; the recipe and the data must match the checkpoint's, :func:`check_resume`); the models are loaded when their phase starts (:func:`load_resumed_models`)."""
    ckpt = resume_checkpoint(run.run_dir, on_damaged=run.config.checkpoint.on_damaged)
    if ckpt is None:
        return  # nothing to resume: start fresh (the run was killed before its first checkpoint)
    st = load_trainer_state(ckpt)
    check_resume(
        ckpt,
        st.get("config"),
        to_dict(run.config),
        saved_digest=st.get("data_digest"),
        current_digest=run.data_digest,
        allow=run.allow_changed,
    )
    parts = run.parts
    run.counters = Counters.from_checkpoint(st["state"])
    parts.train_data.load_state_dict(st["train_data"])
    parts.buffer.load_state_dict(st["buffer"])
    parts.sampler.load_state_dict(st["sampler"])
    run.resume = ResumePoint(
        checkpoint=ckpt,
        state=st,
        metrics_lines=st["metrics_lines"],
        ready_rounds=dict(st.get("pipeline", {}).get("ready", {})),
    )


def load_resumed_models(resume: ResumePoint, models: PhaseModels) -> None:
    """Load the checkpointed policy (and critic) of ``resume`` into the freshly built
    ``models`` of the current phase, check the policy version and restore the RNG states; a
    no-op when nothing is pending (then nothing is, until the next ``--resume``)."""
    if resume.checkpoint is None:
        return
    ckpt, st = resume.checkpoint, resume.state
    assert models.policy is not None
    load_model(models.policy, ckpt / "policy")
    if models.critic is not None:
        load_model(models.critic, ckpt / "critic")
    if models.policy.version != st["policy_version"]:
        raise CheckpointError(
            f"{ckpt}: policy version {models.policy.version} != recorded "
            f"{st['policy_version']}; resume with the recipe that wrote this checkpoint."
        )
    restore_rng(st["rng"])
    resume.checkpoint = None


def load_model(model: Any, path: Path) -> None:
    """``model.load(path)`` with its optimizer; a failure is a CheckpointError naming
    ``path`` (a verified checkpoint fails only for a recipe whose model differs from the
    saved one; an unverified one, written before manifests, may also be damaged)."""
    try:
        model.load(path, with_optimizer=True)
    except RLError:
        raise
    except Exception as e:  # the backends' loaders raise many types; one meaning here
        raise CheckpointError(
            f"{path}: cannot be loaded ({type(e).__name__}: {e}). Resume with the recipe "
            f"that wrote this checkpoint, or delete {path.parent} to resume from the one "
            "before it."
        ) from e
