"""Rollout dumps: every RL step's trained groups on disk, to inspect, regenerate or replay.

With ``rollout.dump_dir`` set, each RL step writes the groups it trains on, in the order it
trains on them, right after it takes them from the buffer. ``rl-train rollout`` writes the same
files without training, and ``rl-train replay DUMP_DIR`` trains on them instead of generating
(:mod:`rl_trainer.ops.replay`).

Format (``FORMAT_VERSION`` 1)::

    <dump_dir>/
      dump.json               {"format": "rl-trainer-dump", "version": 1, "config": {...}}
      step_000001.jsonl       line 1: the step header; then one line per group
      step_000001.safetensors routing tensors of step 1 (only when rollouts carry them)
      ...

Header line: ``{"kind": "step", "version": 1, "step": S, "policy_version": V, "groups": G,
"round": {rollout/* metrics of the round}, "staleness": {...}}``.

Group line: ``{"kind": "group", "index": i, "prompt": {uid, input, token_ids, label, metadata},
"rollouts": [...]}``; each rollout is :func:`rl_core.serde.rollout_to_dict` (tokens ``[P+R]``,
``response_start``, ``loss_mask [R]``, ``rollout_logprobs [R]``, ``versions [R]``, ``status``,
``reward``, ``reward_info`` (the reward's components), ``metadata``) plus ``advantages [R]``
(``null`` when the run has a critic: GAE needs its values) and ``routed_experts``: the
safetensors key of its ``[P+R, L, K]`` routing tensor (``"g<i>/r<j>"``), or ``null``.

Why JSONL + safetensors rather than Parquet: labels, metadata and reward components are
free-form per task, and JSON keeps them as they are without a schema per run; JSON floats
round-trip the engine's log-probs exactly (``repr`` of a double), so a replay trains on bitwise
the same numbers; ``head``/``jq`` read a dump with no tool of ours. The one large, typed payload,
routing (``uint8`` expert ids, :mod:`rl_core.routing`), goes to safetensors, which keeps its
compact dtype and loads without pickle. A step's JSONL is renamed into place last, so a step
file that exists is complete.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import DataError
from rl_core.serde import prompt_from_dict, prompt_to_dict, rollout_from_dict, rollout_to_dict
from rl_core.types import Group

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "DumpStep",
    "dumped_steps",
    "load_step",
    "read_manifest",
    "write_manifest",
    "write_step",
]

FORMAT = "rl-trainer-dump"
"""The ``format`` field of ``dump.json``."""
FORMAT_VERSION = 1
"""The version of the dump format this module writes and reads."""


class DumpStep:
    """One dumped step: its groups (rollouts with rewards and routing restored), their
    per-rollout advantages, and the header's metrics."""

    __slots__ = ("advantages", "groups", "header", "step")

    def __init__(
        self,
        *,
        step: int,
        groups: list[Group],
        advantages: list[list[list[float] | None]],
        header: dict[str, Any],
    ) -> None:
        self.step = step
        """The RL step (1-based)."""
        self.groups = groups
        """The groups, in the order the step trained on them."""
        self.advantages = advantages
        """``advantages[i][j]``: rollout ``j`` of group ``i``'s per-token advantages ``[R]``, or
        ``None`` when they were not computed (a critic run)."""
        self.header = header
        """The header line: ``policy_version``, ``round`` and ``staleness`` metrics."""

    @property
    def round_metrics(self) -> dict[str, Any]:
        """The ``rollout/*`` and ``perf/gen_time`` metrics of the step's round."""
        return dict(self.header.get("round", {}))

    @property
    def staleness(self) -> dict[str, Any]:
        """The staleness metrics of the take (``rollout/staleness_mean``, ...)."""
        return dict(self.header.get("staleness", {}))


def _step_name(step: int) -> str:
    return f"step_{step:06d}"


def _json_line(obj: Any, where: str) -> str:
    def refuse(x: Any) -> Any:
        raise DataError(
            f"rollout.dump_dir: {where} holds a {type(x).__name__}, which JSON cannot store; "
            "keep prompt labels, metadata and reward components to JSON types (str, numbers, "
            "lists, dicts) or turn dumps off (rollout.dump_dir: null)."
        )

    return json.dumps(obj, default=refuse) + "\n"


def write_manifest(dump_dir: str | Path, config: Mapping[str, Any]) -> Path:
    """Create ``dump_dir`` with its ``dump.json`` (format, version, the run's config)."""
    d = Path(dump_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / "dump.json"
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "config": dict(config)}
    path.write_text(json.dumps(manifest, indent=1) + "\n")
    return path


def read_manifest(dump_dir: str | Path) -> dict[str, Any]:
    """``dump.json`` of ``dump_dir``, checked for format and version."""
    path = Path(dump_dir) / "dump.json"
    if not path.is_file():
        raise DataError(
            f"{path}: not found; a dump directory is written by a run with rollout.dump_dir set "
            "or by `rl-train rollout RECIPE`. Pass that directory."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg}); rewrite the dump.") from e
    if manifest.get("format") != FORMAT or manifest.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('version')!r}; "
            f"this rl-train reads {FORMAT!r} version {FORMAT_VERSION}. Regenerate the dump with "
            "this version (rl-train rollout RECIPE)."
        )
    return manifest


def write_step(
    dump_dir: str | Path,
    step: int,
    groups: Sequence[Group],
    *,
    advantages: Sequence[Sequence[Sequence[float] | None]] | None = None,
    header: Mapping[str, Any] | None = None,
) -> Path:
    """Write step ``step``'s ``groups`` (with ``advantages[i][j]`` per rollout, when given) and
    ``header`` fields; returns the JSONL path. The routing tensors go first, the JSONL is
    renamed into place last."""
    from safetensors.torch import save_file

    d = Path(dump_dir)
    name = _step_name(step)
    tensors: dict[str, torch.Tensor] = {}
    lines = [
        _json_line(
            {"kind": "step", "version": FORMAT_VERSION, "step": step, "groups": len(groups)}
            | dict(header or {}),
            f"step {step} header",
        )
    ]
    for i, g in enumerate(groups):
        rollouts = []
        for j, r in enumerate(g.rollouts):
            rd = rollout_to_dict(r)
            if r.routed_experts is not None:
                key = f"g{i}/r{j}"
                tensors[key] = r.routed_experts.detach().cpu().contiguous()
                rd["routed_experts"] = key
            adv = advantages[i][j] if advantages is not None else None
            rd["advantages"] = [float(a) for a in adv] if adv is not None else None
            rollouts.append(rd)
        line = {"kind": "group", "index": i, "prompt": prompt_to_dict(g.prompt)}
        line["rollouts"] = rollouts
        lines.append(_json_line(line, f"step {step}, prompt {g.prompt.uid}"))
    if tensors:
        save_file(tensors, str(d / f"{name}.safetensors"), metadata={"step": str(step)})
    tmp = d / f".{name}.jsonl.tmp"
    tmp.write_text("".join(lines))
    os.replace(tmp, d / f"{name}.jsonl")
    return d / f"{name}.jsonl"


def dumped_steps(dump_dir: str | Path) -> list[int]:
    """The steps that ``dump_dir`` holds, in order."""
    out = []
    for p in Path(dump_dir).glob("step_*.jsonl"):
        try:
            out.append(int(p.stem.removeprefix("step_")))
        except ValueError:
            continue
    return sorted(out)


def load_step(dump_dir: str | Path, step: int) -> DumpStep:
    """Step ``step`` of ``dump_dir``: its groups (rollouts with rewards, components and routing
    tensors), advantages and header (:class:`DumpStep`)."""
    d = Path(dump_dir)
    path = d / f"{_step_name(step)}.jsonl"
    if not path.is_file():
        have = dumped_steps(d)
        span = f"steps {have[0]}..{have[-1]}" if have else "no steps"
        raise DataError(f"{path}: not found; {d} holds {span}. Pick a step it holds.")
    routing: dict[str, torch.Tensor] = {}
    st = d / f"{_step_name(step)}.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        routing = load_file(str(st))
    header: dict[str, Any] = {}
    groups: list[Group] = []
    advantages: list[list[list[float] | None]] = []
    for lineno, text in enumerate(path.read_text().splitlines(), 1):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(
                f"{path}:{lineno}: not valid JSON ({e.msg}); the dump is damaged."
            ) from e
        if obj.get("kind") == "step":
            if obj.get("version") != FORMAT_VERSION:
                raise DataError(
                    f"{path}:{lineno}: dump version {obj.get('version')!r}, this rl-train reads "
                    f"{FORMAT_VERSION}; regenerate the dump with this version."
                )
            header = obj
            continue
        rollouts, advs = [], []
        for rd in obj["rollouts"]:
            key = rd.get("routed_experts")
            if key is not None and key not in routing:
                raise DataError(f"{path}:{lineno}: routing {key!r} missing from {st}.")
            advs.append(rd.pop("advantages", None))
            rollouts.append(rollout_from_dict({**rd, "routed_experts": routing.get(key)}))
        groups.append(Group(prompt=prompt_from_dict(obj["prompt"]), rollouts=rollouts))
        advantages.append(advs)
    if header.get("groups") != len(groups):
        raise DataError(
            f"{path}: header says {header.get('groups')} groups, the file holds {len(groups)}; "
            "the dump is damaged."
        )
    return DumpStep(step=step, groups=groups, advantages=advantages, header=header)
