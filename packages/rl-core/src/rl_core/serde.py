"""Prompts, rollouts and groups as plain data (lists, dicts, str, numbers).

The result loads with ``torch.load(weights_only=True)`` and is JSON-serialisable when labels and
metadata are and no rollout carries ``routed_experts`` (a tensor, kept as one: its compact
integer dtype is the point of it). Used by buffer and sampler checkpoints, and by anything that ships groups
between processes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_core.types import Group, Prompt, Rollout, RolloutStatus

__all__ = [
    "group_from_dict",
    "group_to_dict",
    "prompt_from_dict",
    "prompt_to_dict",
    "rollout_from_dict",
    "rollout_to_dict",
]


def prompt_to_dict(p: Prompt) -> dict[str, Any]:
    """A prompt as plain data."""
    return {
        "uid": p.uid,
        "input": p.input,
        "token_ids": list(p.token_ids),
        "label": p.label,
        "metadata": p.metadata,
    }


def prompt_from_dict(d: Mapping[str, Any]) -> Prompt:
    """Inverse of :func:`prompt_to_dict`."""
    return Prompt(
        uid=d["uid"],
        input=d["input"],
        token_ids=tuple(int(t) for t in d["token_ids"]),
        label=d["label"],
        metadata=dict(d["metadata"]),
    )


def rollout_to_dict(r: Rollout) -> dict[str, Any]:
    """A rollout as plain data."""
    return {
        "prompt_uid": r.prompt_uid,
        "rollout_id": r.rollout_id,
        "sample_id": r.sample_id,
        "tokens": list(r.tokens),
        "response_start": r.response_start,
        "loss_mask": list(r.loss_mask),
        "rollout_logprobs": list(r.rollout_logprobs),
        "versions": list(r.versions),
        "status": str(r.status),
        "reward": r.reward,
        "reward_info": dict(r.reward_info),
        "metadata": r.metadata,
        "routed_experts": r.routed_experts,
    }


def rollout_from_dict(d: Mapping[str, Any]) -> Rollout:
    """Inverse of :func:`rollout_to_dict`."""
    return Rollout(
        prompt_uid=d["prompt_uid"],
        rollout_id=d["rollout_id"],
        sample_id=d["sample_id"],
        tokens=tuple(int(t) for t in d["tokens"]),
        response_start=int(d["response_start"]),
        loss_mask=tuple(int(m) for m in d["loss_mask"]),
        rollout_logprobs=tuple(float(x) for x in d["rollout_logprobs"]),
        versions=tuple(int(v) for v in d["versions"]),
        status=RolloutStatus(d["status"]),
        reward=d["reward"],
        reward_info=dict(d["reward_info"]),
        metadata=dict(d["metadata"]),
        routed_experts=d.get("routed_experts"),
    )


def group_to_dict(g: Group) -> dict[str, Any]:
    """A group as plain data."""
    return {
        "prompt": prompt_to_dict(g.prompt),
        "rollouts": [rollout_to_dict(r) for r in g.rollouts],
    }


def group_from_dict(d: Mapping[str, Any]) -> Group:
    """Inverse of :func:`group_to_dict`."""
    return Group(
        prompt=prompt_from_dict(d["prompt"]),
        rollouts=[rollout_from_dict(r) for r in d["rollouts"]],
    )
