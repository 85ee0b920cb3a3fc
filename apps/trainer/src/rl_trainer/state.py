"""The trainer's state in checkpoints: what a checkpoint captures besides the models, how it is
written on schedule, and how ``--resume`` restores it.

A checkpoint (:mod:`rl_trainer.checkpoint` writes and verifies it) holds the models with their
optimizers and ``trainer_state.pt``: the step counters, the policy version, the data, buffer,
sampler and pipeline states, the RNG states, how many metric lines were written, and the
config. Restoring reads the trainer state at start-up (:func:`restore`); the models are loaded
when their phase builds them (:func:`load_resumed_models`), so a run resumed in the SFT phase
and one resumed in RL take the same path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from rl_core.config import to_dict
from rl_core.errors import CheckpointError, RLError
from rl_trainer.checkpoint import (
    capture_rng,
    load_trainer_state,
    restore_rng,
    resume_checkpoint,
    write_checkpoint,
)
from rl_trainer.resume_check import check_resume
from rl_trainer.rundir import config_text

if TYPE_CHECKING:
    from rl_trainer.loop import Trainer

__all__ = ["capture", "load_model", "load_resumed_models", "restore", "save"]


def capture(run: Trainer, metrics_lines: int) -> dict[str, Any]:
    """The trainer state of ``run`` now (``trainer_state.pt``); ``metrics_lines``: how many
    lines ``metrics.jsonl`` holds, so a resumed run continues it exactly."""
    parts = run.parts
    return {
        "state": dict(run.state),
        "policy_version": run.policy.version,
        "train_data": parts.train_data.state_dict(),
        "buffer": parts.buffer.state_dict(),
        "sampler": parts.sampler.state_dict(),
        "pipeline": run.pipeline.state_dict() if run.pipeline is not None else {"ready": {}},
        "rng": capture_rng(),
        "metrics_lines": metrics_lines,
        "config": to_dict(run.config),
        "data_digest": dict(run.data_digest),
    }


def save(run: Trainer, metrics_lines: int) -> None:
    """Write a checkpoint of ``run`` at its current step (models with optimizers, trainer
    state), keeping the newest ``checkpoint.keep``."""
    savers = {"policy": lambda d: run.policy.save(d, with_optimizer=True)}
    if run.critic is not None:
        savers["critic"] = lambda d: run.critic.save(d, with_optimizer=True)
    write_checkpoint(
        run.run_dir,
        run.state["sft_step"] + run.state["rl_step"],
        save_models=savers,
        trainer_state=capture(run, metrics_lines),
        keep=run.config.checkpoint.keep,
        files={"config.yaml": config_text(to_dict(run.config))},
    )


def restore(run: Trainer) -> None:
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
    run.state = dict(st["state"])
    parts.train_data.load_state_dict(st["train_data"])
    parts.buffer.load_state_dict(st["buffer"])
    parts.sampler.load_state_dict(st["sampler"])
    run.ready_rounds = dict(st.get("pipeline", {}).get("ready", {}))
    run.resume_lines = st["metrics_lines"]
    run._resume_from = ckpt
    run.resume_state = st


def load_resumed_models(run: Trainer) -> None:
    """Load the checkpointed policy (and critic) into the freshly built ones of the current
    phase, check the policy version and restore the RNG states; a no-op when nothing is
    pending."""
    if run._resume_from is None:
        return
    ckpt, st = run._resume_from, run.resume_state
    load_model(run.policy, ckpt / "policy")
    if run.critic is not None:
        load_model(run.critic, ckpt / "critic")
    if run.policy.version != st["policy_version"]:
        raise CheckpointError(
            f"{ckpt}: policy version {run.policy.version} != recorded "
            f"{st['policy_version']}; resume with the recipe that wrote this checkpoint."
        )
    restore_rng(st["rng"])
    run._resume_from = None


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
