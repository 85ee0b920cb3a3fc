"""Sample traces and the per-step observation hook (dumps, traces).

:func:`after_take` runs in every RL step right after the step takes its groups from the buffer
(before training): with ``rollout.dump_dir`` it writes the step's dump
(:mod:`rl_trainer.ops.dumps`), and every ``logging.samples_every`` steps it writes a trace of the
first ``logging.samples_groups`` groups to ``<run_dir>/samples.jsonl`` and the metrics sinks
(TensorBoard text, a W&B table).

One trace line is one group::

    {"step": 3, "policy_version": 2, "prompt_uid": "...", "prompt": "abc=", "label": "cba",
     "rollouts": [{"sample_id": "...", "response": "cba", "reward": 1.0,
                   "reward_info": {"reward": 1.0, "exact": 1.0}, "advantage": 0.71,
                   "tokens": ["c", "b", "a"], "rollout_logprobs": [...],
                   "trainer_logprobs": [...], "mismatch": [...], "mismatch_max": 0.0}]}

``trainer_logprobs`` are the log-probs of the policy about to train the step (one extra forward
over the traced rollouts only); ``mismatch`` is ``trainer - rollout`` per response token
(``null`` for tokens the loss masks out, and everywhere when there is no policy, as in
``rl-train rollout``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rl_core.batching import gather_response, pack_rollouts
from rl_core.config import to_dict
from rl_core.errors import DataError
from rl_core.types import Group
from rl_trainer.ops import dumps
from rl_trainer.step.stages import advantages as step_advantages

if TYPE_CHECKING:
    from rl_trainer.run_state import RunState

__all__ = ["after_take", "group_advantages", "read_samples", "trace_groups"]


def group_advantages(
    advantage_fn: Any, groups: Sequence[Group], *, critic: bool = False
) -> list[list[list[float] | None]]:
    """Per-rollout advantages ``[R]`` of ``groups`` from the run's estimator ``advantage_fn``
    (the values the step trains on: estimators are per group or per batch, not per order);
    ``None`` for each rollout when the run has a ``critic`` (GAE needs its values)."""
    if critic:
        return [[None for _ in g.rollouts] for g in groups]

    rollouts = [r for g in groups for r in g.rollouts]
    index = [gi for gi, g in enumerate(groups) for _ in g.rollouts]
    adv, _ = step_advantages(advantage_fn, rollouts, index, None)
    out: list[list[list[float] | None]] = []
    k = 0
    for g in groups:
        out.append([adv[k + j].tolist() for j in range(len(g.rollouts))])
        k += len(g.rollouts)
    return out


def _trainer_logprobs(policy: Any, groups: Sequence[Group]) -> list[torch.Tensor] | None:
    """The policy's log-probs ``[R]`` of every rollout of ``groups`` (``None`` without one)."""
    if policy is None or not hasattr(policy, "compute_logprobs"):
        return None
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return []
    logp_T = policy.compute_logprobs(pack_rollouts(rollouts)).logprobs
    return [x.float().cpu() for x in gather_response(rollouts, logp_T.cpu())]


def trace_groups(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[Sequence[float] | None]],
    *,
    step: int,
    policy_version: int,
    tokenizer: Any,
    policy: Any = None,
) -> list[dict[str, Any]]:
    """The trace lines (one per group, see the module docstring) of ``groups``."""
    logps = _trainer_logprobs(policy, groups)
    lines, k = [], 0
    for g, advs in zip(groups, advantages):
        p = g.prompt
        text = p.input if isinstance(p.input, str) else tokenizer.decode(list(p.token_ids))
        rows = []
        for r, adv in zip(g.rollouts, advs):
            ids = list(r.response_ids)
            rollout_lp = [float(x) for x in r.rollout_logprobs]
            trainer_lp = logps[k].tolist() if logps is not None else None
            k += 1
            mismatch = (
                [(t - o) if m else None for t, o, m in zip(trainer_lp, rollout_lp, r.loss_mask)]
                if trainer_lp is not None
                else None
            )
            live = [abs(x) for x in mismatch or [] if x is not None]
            rows.append(
                {
                    "sample_id": r.sample_id,
                    "response": tokenizer.decode(ids, skip_special_tokens=True),
                    "status": str(r.status),
                    "reward": r.reward,
                    "reward_info": dict(r.reward_info),
                    "advantage": (sum(adv) / len(adv)) if adv else None,
                    "versions": list(r.versions),
                    "tokens": [tokenizer.decode([t]) for t in ids],
                    "loss_mask": list(r.loss_mask),
                    "rollout_logprobs": rollout_lp,
                    "trainer_logprobs": trainer_lp,
                    "mismatch": mismatch,
                    "mismatch_max": max(live) if live else None,
                }
            )
        lines.append(
            {
                "step": step,
                "policy_version": policy_version,
                "prompt_uid": p.uid,
                "prompt": text,
                "label": p.label,
                "rollouts": rows,
            }
        )
    return lines


def after_take(
    run: RunState,
    step: int,
    groups: Sequence[Group],
    round_metrics: dict[str, Any],
    staleness: dict[str, Any],
) -> None:
    """Dump step ``step``'s ``groups`` (``rollout.dump_dir``) and, when due
    (``logging.samples_every``), trace the first ``logging.samples_groups`` of them."""
    cfg = run.config
    dump_dir = cfg.rollout.dump_dir
    every = cfg.logging.samples_every
    traced = bool(every) and step % every == 0
    if dump_dir is None and not traced:
        return
    advantages = group_advantages(run.parts.advantage_fn, groups, critic=cfg.critic is not None)
    policy_version = run.models.policy.version if run.models.policy is not None else 0
    if dump_dir is not None:
        if not (Path(dump_dir) / "dump.json").is_file():
            dumps.write_manifest(dump_dir, to_dict(cfg))
        dumps.write_step(
            dump_dir,
            step,
            groups,
            advantages=advantages,
            header={
                "policy_version": policy_version,
                "round": {k: v for k, v in round_metrics.items() if _scalar(v)},
                "staleness": staleness,
            },
        )
    if traced:
        n = cfg.logging.samples_groups
        lines = trace_groups(
            groups[:n],
            advantages[:n],
            step=step,
            policy_version=policy_version,
            tokenizer=run.tokenizer,
            policy=run.models.policy,
        )
        run.log_samples(step, lines)


def _scalar(v: Any) -> bool:
    return isinstance(v, int | float | str | bool) or v is None


def read_samples(run_dir: str | Path, step: int | None = None) -> list[dict[str, Any]]:
    """The trace lines of ``<run_dir>/samples.jsonl`` (of step ``step`` only, when given)."""
    path = Path(run_dir) / "samples.jsonl"
    if not path.is_file():
        raise DataError(
            f"{path}: not found; sample traces are written when logging.samples_every > 0 "
            "(e.g. --set logging.samples_every=10)."
        )
    out = []
    for lineno, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg}).") from e
        if step is None or line.get("step") == step:
            out.append(line)
    return out
