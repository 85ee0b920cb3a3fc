"""The SFT phase: the warm-up (train the policy on the training labels, with its own learning
rate and optimizer, then save its weights for the RL phase to start from) or, with
``mode: sft``, a whole run on chat conversations (:mod:`rl_trainer.phases.chat_sft`: loss on
assistant turns, ``eval/loss``, the final model) on the same loop, checkpoints and resume."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rl_core.algorithms import SFTLoss
from rl_core.errors import RLError
from rl_core.types import Prompt, Rollout
from rl_trainer.assembly import build_policy
from rl_trainer.lifecycle import state as checkpoints
from rl_trainer.lifecycle.state import load_resumed_models
from rl_trainer.phases import chat_sft
from rl_trainer.step import lora
from rl_trainer.step.packing import plan_and_pack

if TYPE_CHECKING:
    from rl_trainer.run_state import RunState

__all__ = ["run", "sft_rollouts", "sft_step"]


async def run(run_state: RunState) -> bool:
    """Run the remaining SFT steps (the warm-up, or with ``mode: sft`` the whole run on chat
    data, :mod:`rl_trainer.phases.chat_sft`); ``True`` when a signal stopped the run."""
    cfg = run_state.config
    chat = cfg.mode == "sft"
    if run_state.counters.sft_step >= cfg.sft.steps:
        return False
    overrides: dict[str, Any] = {"lr": cfg.sft.lr} if cfg.sft.lr is not None else {}
    if not cfg.sft.lora and cfg.policy.options.get("lora") is not None:
        overrides["lora"] = None  # a full fine-tuning warm-up
    run_state.models.policy = build_policy(
        cfg,
        run_state.runtime,
        run_state.parts.init_model_path,
        phase="sft",  # the warm-up stays eager unless the recipe compiles (rl_trainer.defaults)
        temperature=1.0,
        **overrides,
    )
    load_resumed_models(run_state.resume, run_state.models)
    if chat:  # a chat-SFT run's steps are this phase's (the RL phase freezes otherwise)
        run_state.frozen.freeze()  # what it built lives to its end (runtime.freeze_gc)
    counters, cap = run_state.counters, cfg.rl.max_tokens_per_micro_batch
    held_out = chat_sft.eval_rollouts(cfg, run_state.tokenizer) if chat else []
    if chat and counters.sft_step == 0 and chat_sft.eval_due(cfg, 0):  # step 0
        loss = chat_sft.eval_loss(run_state.models.policy, held_out, cap)
        run_state.emit({"step": 0, "phase": "sft", **loss})
    saved = False
    while run_state.counters.sft_step < cfg.sft.steps:
        rec = sft_step(run_state, chat_sft.chat_rollouts if chat else sft_rollouts)
        if chat and chat_sft.eval_due(cfg, counters.sft_step):
            rec.update(chat_sft.eval_loss(run_state.models.policy, held_out, cap))
        run_state.emit(rec)
        # A checkpoint after the warm-up's last step is taken at the start of RL (the RL
        # phase): resuming there needs the RL phase's policy and optimizer.
        if run_state.counters.sft_step == cfg.sft.steps and not chat:
            break
        saved = run_state.checkpoint_due()
        if saved:
            checkpoints.save(run_state)
        if run_state.stop_requested and run_state.counters.sft_step < cfg.sft.steps:
            await checkpoints.stop(run_state, saved=saved)
            return True
    if chat:  # the run ends here: the final model, then the last checkpoint
        lora.save_final(run_state.models.policy, run_state.run_dir / "final_model")
        if not saved:
            checkpoints.save(run_state)
        return False
    tmp = run_state.run_dir / ".tmp-sft_model"
    # The RL phase starts from a Hugging Face model: a LoRA warm-up's adapter is merged in.
    if run_state.models.policy.lora is not None:
        run_state.models.policy.save_merged(tmp)
    else:
        run_state.models.policy.save(tmp, with_optimizer=False)
    if run_state.sft_model_path.exists():
        shutil.rmtree(run_state.sft_model_path)
    tmp.rename(run_state.sft_model_path)
    run_state.models.policy = None
    return False


def sft_rollouts(prompts: Sequence[Prompt], tokenizer: Any, version: int) -> list[Rollout]:
    """Each labelled prompt as a rollout whose response is its label (and EOS), all trained."""
    eos = tokenizer.eos_token_id
    out = []
    for p in prompts:
        if p.label is None:
            raise RLError(f"sft: prompt {p.uid} has no label; SFT warm-up needs labelled data.")
        resp = list(tokenizer.encode(str(p.label), add_special_tokens=False)) + (
            [eos] if eos is not None else []
        )
        n = len(resp)
        out.append(
            Rollout(
                prompt_uid=p.uid,
                rollout_id=p.uid,
                sample_id=p.uid,
                tokens=tuple(p.token_ids) + tuple(resp),
                response_start=len(p.token_ids),
                loss_mask=(1,) * n,
                rollout_logprobs=(0.0,) * n,
                versions=(version,) * n,
            )
        )
    return out


def sft_step(
    run_state: RunState,
    rollouts_of: Callable[[Sequence[Prompt], Any, int], list[Rollout]] = sft_rollouts,
) -> dict[str, Any]:
    """One step on ``sft.batch_size`` prompts made into rollouts by ``rollouts_of`` (the
    warm-up's labelled prompts, or :func:`rl_trainer.phases.chat_sft.chat_rollouts` for chat
    conversations); returns its metrics."""
    cfg = run_state.config
    t0 = time.perf_counter()
    prompts = run_state.parts.train_data.next_prompts(cfg.sft.batch_size)
    rollouts = rollouts_of(prompts, run_state.tokenizer, run_state.models.policy.version)
    batch, _ = plan_and_pack(rollouts, run_state.models.policy, cfg.rl.max_tokens_per_micro_batch)
    m = run_state.models.policy.train_step(batch, SFTLoss())
    dt = time.perf_counter() - t0
    run_state.counters.sft_step += 1
    return {
        "step": run_state.counters.sft_step,
        "phase": "sft",
        "train/loss": m["loss"],
        "train/grad_norm": m["grad_norm"],
        "train/entropy": m.get("entropy"),
        "train/lr": m.get("lr"),
        "train/loss_tokens": float(batch.loss_mask.sum()),
        "perf/step_time": dt,
        "perf/train_tokens_per_s": batch.num_tokens / dt,
    }
