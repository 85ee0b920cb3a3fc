"""Top-p / top-k-aware training log-probs, derived from ``rollout.sampling``.

When the rollout samples with ``top_p < 1`` or ``top_k > 0``, each token was drawn from the
temperature-scaled distribution renormalised over a candidate set, so that is the behaviour
policy. The policy (and the reference) are built with the same ``top_p``/``top_k`` as their
``temperature``, and renormalise their own log-probs over the set they rebuild from their own
logits (:func:`rl_core.logprobs.truncate_logits`); without it every importance ratio would carry
the kept mass ``S`` of its position (``log ratio = log S``; TRL #6789, slime PR #2102)::

    overrides = policy_overrides(cfg, cfg.policy)   # {} or {"top_p": 0.8, "top_k": 0}
    policy = build_policy(cfg, runtime, path, temperature=t, **overrides)
    check_generator(cfg)                             # engines returning untruncated log-probs

Engines: ``HFGenerator`` returns log-probs of the truncated distribution
(``Generator.truncated_logprobs``), so on-policy the ratio against the rollout log-probs is 1.
SGLang (0.5.x) returns the temperature-scaled log-probs *before* truncation (its
``SGLANG_RETURN_ORIGINAL_LOGPROB`` only switches to the pre-temperature ones; no option returns
the truncated ones), so its rollout log-probs sit ``log S`` below the trainer's: a mismatch
correction (``algorithm.loss.correction``) against them would be biased and is refused; the
``train/mismatch`` metric then includes that offset.
"""

from __future__ import annotations

import logging
from typing import Any

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError
from rl_core.logprobs import truncates
from rl_trainer.build import config_fields
from rl_trainer.config import TrainerConfig

__all__ = ["check_generator", "policy_overrides"]

log = logging.getLogger(__name__)


def policy_overrides(cfg: TrainerConfig, spec: ComponentSpec, *, kind: str = "policy") -> dict:
    """``{"top_p", "top_k"}`` of ``rollout.sampling`` for the policy ``spec`` when the sampling
    truncates, else ``{}`` (every policy keeps its full-distribution default).

    Raises:
        ConfigError: the sampling truncates but the policy's ``Config`` has no ``top_p`` /
            ``top_k`` options to renormalise with.
    """
    s = cfg.rollout.sampling
    if not truncates(s.top_p, s.top_k):
        return {}
    fields = config_fields(kind, spec)
    if not {"top_p", "top_k"} <= fields:
        raise ConfigError(
            f"rollout.sampling: top_p={s.top_p}, top_k={s.top_k} truncate sampling, but "
            f"{kind} {spec.type!r} has no top_p/top_k options, so its log-probs would be over "
            "the full vocabulary and every importance ratio biased by the kept mass. Use a "
            f"{kind} with them (hf, megatron) or sample with top_p: 1.0 and top_k: 0."
        )
    return {"top_p": s.top_p, "top_k": s.top_k}


def check_generator(cfg: TrainerConfig) -> None:
    """Refuse a mismatch correction against untruncated engine log-probs under truncation.

    Raises:
        ConfigError: the sampling truncates, the generator's log-probs are before truncation
            (``truncated_logprobs`` false) and ``algorithm.loss.correction`` is set.
    """
    s = cfg.rollout.sampling
    if not truncates(s.top_p, s.top_k):
        return
    cls: Any = registry.resolve(
        registry.GROUPS["generator"], cfg.generator.type, field="generator.type"
    )
    if getattr(cls, "truncated_logprobs", False):
        return
    correction = str(cfg.algorithm.loss.get("correction", "none"))
    if correction != "none":
        raise ConfigError(
            f"algorithm.loss.correction: {correction!r} weighs by trainer/rollout log-prob "
            f"ratios, but generator {cfg.generator.type!r} returns log-probs before the "
            f"top_p={s.top_p}/top_k={s.top_k} truncation while the trainer's are renormalised "
            "over the kept set, so every weight would carry the kept mass. Set "
            "algorithm.loss.correction: none, sample with top_p: 1.0 and top_k: 0, or use a "
            "generator with truncated_logprobs (hf)."
        )
    log.warning(
        "rollout.sampling truncates (top_p=%s, top_k=%s) but generator %r returns log-probs "
        "before truncation: train/mismatch includes the kept mass (log S per token).",
        s.top_p,
        s.top_k,
        cfg.generator.type,
    )
