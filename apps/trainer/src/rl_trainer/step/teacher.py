"""On-policy distillation (OPD): a frozen teacher scores the student's sampled tokens.

Per response token ``t`` the sampled reverse KL to the teacher is
``rkl_t = logp_student_t - logp_teacher_t`` (a one-sample estimate of
``KL(student || teacher)`` at that position), and the advantage the policy loss trains on is::

    A_t = reward_weight * A_task_t - coef * rkl_t

(:func:`rl_core.algorithms.distillation_advantages`), as slime's OPD and Tinker's on-policy
distillation do: tokens the teacher finds likelier than the student are pushed up, the others
down. With ``reward_weight: 0`` it is pure distillation; the task reward is still scored and
logged (``rollout/reward_mean``), so a run shows the student closing the gap to the teacher.

The teacher (``teacher`` in the recipe, :class:`~rl_trainer.config.TeacherConfig`) is one of:

- a policy backend by registry name (``hf``, ``megatron``) loaded frozen from ``teacher.path``:
  only ``compute_logprobs`` is called, so no optimizer state is ever allocated. On the ``ray``
  runtime it lives in the policy ranks as role ``teacher``, as the reference model does;
- ``sglang``: an SGLang server at ``teacher.url`` that scores given token ids through its
  log-prob API (:class:`rl_sglang.teacher.SGLangTeacher`), called from the driver.

Either way it scores the student's tokens, so it must share the student's tokenizer (checked
at start-up when ``teacher.path`` is given). Metrics: ``distill/reverse_kl`` (mean ``rkl_t``
over response tokens), ``distill/teacher_logp_mean``, ``distill/student_logp_mean``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from rl_core import registry
from rl_core.algorithms import distillation_advantages
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError
from rl_core.types import TrainBatch
from rl_trainer.build import with_defaults
from rl_trainer.config import TeacherConfig, TrainerConfig
from rl_trainer.step import routing

__all__ = ["build_teacher", "check_teacher_tokenizer", "distill"]


def check_teacher_tokenizer(teacher: TeacherConfig, student_tokenizer: Any) -> None:
    """Refuse a teacher whose tokenizer maps tokens differently from the student's: the
    teacher scores the student's token ids, so the vocabularies must be the same."""
    if teacher.path is None:
        return
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(teacher.path))
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"teacher.path: {str(teacher.path)!r} has no loadable tokenizer ({e}); the teacher "
            "directory must hold the student's tokenizer files."
        ) from None
    if tok.get_vocab() != student_tokenizer.get_vocab():
        raise ConfigError(
            f"teacher.path: the tokenizer in {str(teacher.path)!r} differs from the student's "
            f"({len(tok)} vs {len(student_tokenizer)} tokens, or the same size mapped "
            "differently); the teacher scores the student's token ids, so use a teacher with "
            "the student's tokenizer."
        )


def build_teacher(cfg: TrainerConfig, runtime: Any, *, temperature: float) -> Any:
    """The frozen teacher of ``cfg.teacher`` (``None`` without one): an object with
    ``compute_logprobs(batch) -> LogProbOutput``. Policy backends get the rollout
    ``temperature`` (log-probs of the same tempered distribution as the student's)."""
    t = cfg.teacher
    if t is None:
        return None
    if t.type == "sglang":
        try:
            from rl_sglang.teacher import SGLangTeacher
        except ImportError as e:  # pragma: no cover - rl-sglang is a workspace package
            raise ConfigError(
                f"teacher.type: 'sglang' needs the rl-sglang package ({e}); install it or use "
                "teacher.type: hf."
            ) from None
        return SGLangTeacher(_sglang_config(SGLangTeacher, t))
    path = str(Path(str(t.path)))
    spec = with_defaults(
        "policy", ComponentSpec(type=t.type, options=dict(t.options)), seed=cfg.seed
    )
    options = {"temperature": temperature, **spec.options, "model_path": path}
    spec = ComponentSpec(type=spec.type, options=options)
    if runtime is not None:  # ray: the teacher lives in the policy ranks (role "teacher")
        return runtime.build_policy(spec, role="teacher")
    return registry.build("policy", spec, field="teacher")


def _sglang_config(cls: Any, t: TeacherConfig) -> Any:
    from rl_core.config import from_dict

    return from_dict(cls.Config, {**t.options, "url": t.url}, path="teacher.options")


def distill(cfg: TrainerConfig, teacher: Any, policy: Any, batch: TrainBatch) -> dict[str, float]:
    """Score ``batch`` with ``teacher`` (``cfg.teacher``'s model) and shape ``batch.advantages`` in place to
    ``reward_weight * A - coef * (logp_student - logp_teacher)`` on response tokens; with
    ``student_logprobs: policy`` the student log-probs computed here also become
    ``batch.old_logprobs`` (they are the pre-step ``policy``'s). Returns the ``distill/*``
    metrics."""
    t = cfg.teacher
    assert t is not None and teacher is not None
    mode = cfg.rollout.routing_replay
    # The engine's routing belongs to the student's experts, never to the teacher's.
    plain = dataclasses.replace(batch, routed_experts=None)
    teacher_T = teacher.compute_logprobs(plain).logprobs.to(torch.float32)
    if t.student_logprobs == "rollout":
        if batch.rollout_logprobs is None:
            raise ConfigError(
                "teacher.student_logprobs: 'rollout' needs the engine's log-probs on the batch; "
                "use a generator that returns them or set teacher.student_logprobs: policy."
            )
        student_T = batch.rollout_logprobs.to(torch.float32)
    else:
        if batch.old_logprobs is None:
            batch.old_logprobs = policy.compute_logprobs(routing.for_policy(batch, mode)).logprobs
        student_T = batch.old_logprobs.to(torch.float32)
    mask_T = batch.loss_mask
    batch.advantages = distillation_advantages(
        t.reward_weight * batch.advantages.to(torch.float32),
        student_T,
        teacher_T,
        mask_T,
        coef=t.coef,
    )
    on_T = mask_T > 0
    n = max(int(on_T.sum()), 1)
    return {
        "distill/reverse_kl": float((student_T - teacher_T)[on_T].sum()) / n,
        "distill/teacher_logp_mean": float(teacher_T[on_T].sum()) / n,
        "distill/student_logp_mean": float(student_T[on_T].sum()) / n,
    }
