"""``rl-train show RUN --step N``: a run's sample traces (:mod:`rl_trainer.ops.samples`) or a
rollout dump (:mod:`rl_trainer.ops.dumps`: ``rl-train show DUMP_DIR``, the directory holding
``dump.json``) in a terminal, with rich: per group its prompt and label, then one row per
rollout (response, reward, advantage, largest per-token log-prob mismatch); with ``--tokens``
each response token with the engine's and the trainer's log-probs, mismatches above
:data:`MISMATCH_WARN` in red; with ``--turns`` (or ``--session ID``: that agent session only)
each rollout turn by turn: its loss-mask regions in order (:func:`mask_regions`), a model turn
(mask 1, trained) or the tool results and template text between turns (mask 0, not trained),
with their token spans, policy versions and text, under the session's counts (turns, tool
calls, ill-formed calls, template mismatches, tool errors).

A dump's text is decoded with the tokenizer of the run that wrote it (from ``dump.json``'s
config); when it cannot be loaded (the model moved), token ids are shown instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rl_core.errors import DataError, RLError
from rl_trainer.ops.samples import read_samples

__all__ = ["MISMATCH_WARN", "SESSION_COUNTS", "mask_regions", "show_samples"]

MISMATCH_WARN = 0.1
"""A per-token ``|trainer - engine|`` log-prob difference above this is highlighted."""

SESSION_COUNTS = ("session_turns", "tool_calls", "ill_formed", "template_mismatch", "tool_errors")
"""Agent counts of a rollout's metadata shown above its turns."""


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def mask_regions(loss_mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """The runs of equal loss mask of a response, in order: ``(start, end, mask)`` with
    ``end`` exclusive (mask 1: a model turn; 0: tool results and template text between turns)."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(loss_mask):
        if out and out[-1][2] == int(m):
            out[-1] = (out[-1][0], i + 1, int(m))
        else:
            out.append((i, i + 1, int(m)))
    return out


def _traces(run_dir: Path, step: int | None) -> tuple[int, list[dict[str, Any]]]:
    """The step shown and its trace lines, from ``samples.jsonl`` or a dump directory."""
    if (run_dir / "dump.json").is_file():
        return _dump_traces(run_dir, step)
    lines = read_samples(run_dir)
    steps = sorted({int(line["step"]) for line in lines})
    if not steps:
        raise DataError(f"{run_dir / 'samples.jsonl'}: holds no traces yet.")
    step = steps[-1] if step is None else step
    chosen = [line for line in lines if line["step"] == step]
    if not chosen:
        raise DataError(
            f"{run_dir / 'samples.jsonl'}: no trace of step {step}; traced steps: "
            f"{', '.join(map(str, steps))}. Pass one of them to --step."
        )
    return step, chosen


def _dump_tokenizer(dump_dir: Path) -> Any:
    """The tokenizer of the run that wrote the dump, or ``None`` when it cannot be loaded."""
    from rl_trainer.build import load_tokenizer
    from rl_trainer.config import load_trainer_config
    from rl_trainer.ops import dumps

    try:
        config = dumps.read_manifest(dump_dir)["config"]
        # Only what names the tokenizer: the rest (code the run loaded) need not load here.
        # (the placeholder task only satisfies the config's check; it reads no data)
        config = {k: config[k] for k in ("run_dir", "seed", "model") if k in config}
        config["task"] = {"type": "reverse"}
        return load_tokenizer(load_trainer_config(config))
    except (RLError, OSError, KeyError, TypeError, ValueError):
        return None


def _dump_traces(dump_dir: Path, step: int | None) -> tuple[int, list[dict[str, Any]]]:
    """A dumped step as trace lines (the format of :mod:`rl_trainer.ops.samples`, plus each
    rollout's ``metadata``, ``rollout_id`` and decoded loss-mask ``regions``)."""
    from rl_trainer.ops import dumps

    dumps.read_manifest(dump_dir)  # a dump of this format and version
    steps = dumps.dumped_steps(dump_dir)
    if not steps:
        raise DataError(f"{dump_dir}: a dump without steps yet.")
    step = steps[-1] if step is None else step
    if step not in steps:
        raise DataError(
            f"{dump_dir}: no step {step} dumped; dumped steps: {', '.join(map(str, steps))}. "
            "Pass one of them to --step."
        )
    data = dumps.load_step(dump_dir, step)
    tok = _dump_tokenizer(dump_dir)

    def text(ids: Sequence[int], skip: bool = False) -> str:
        if tok is None:
            return " ".join(map(str, ids))
        return tok.decode(list(ids), skip_special_tokens=skip)

    lines = []
    for g, advs in zip(data.groups, data.advantages, strict=True):
        rollouts = []
        for r, adv in zip(g.rollouts, advs, strict=True):
            resp = r.tokens[r.response_start :]
            trained = [a for a, m in zip(adv or [], r.loss_mask) if m]
            rollouts.append(
                {
                    "sample_id": r.sample_id,
                    "rollout_id": r.rollout_id,
                    "response": text(resp, skip=True),
                    "status": str(getattr(r.status, "value", r.status)),
                    "reward": r.reward,
                    "advantage": sum(trained) / len(trained) if trained else None,
                    "tokens": [text([t]) for t in resp],
                    "loss_mask": list(r.loss_mask),
                    "versions": list(r.versions),
                    "rollout_logprobs": list(r.rollout_logprobs),
                    "metadata": dict(r.metadata),
                    "regions": [
                        (a, b, m, text(resp[a:b])) for a, b, m in mask_regions(r.loss_mask)
                    ],
                }
            )
        lines.append(
            {
                "step": step,
                "policy_version": data.header.get("policy_version", "?"),
                "prompt_uid": g.prompt.uid,
                "prompt": text(g.prompt.token_ids),
                "label": g.prompt.label,
                "rollouts": rollouts,
            }
        )
    return step, lines


def _of_session(r: dict[str, Any], session: str) -> bool:
    meta = r.get("metadata") or {}
    return session in (meta.get("session"), r.get("rollout_id"), r.get("sample_id"))


def show_samples(
    run_dir: str | Path,
    *,
    step: int | None = None,
    tokens: bool = False,
    console: Any = None,
    turns: bool = False,
    session: str | None = None,
) -> int:
    """Print the traces of RL step ``step`` of ``run_dir`` (a run directory's
    ``samples.jsonl``, or a dump directory; default: the last step there); ``turns``: each
    rollout turn by turn; ``session``: only that agent session's rollouts, turn by turn.
    Returns the step shown."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    step, chosen = _traces(Path(run_dir), step)
    if session is not None:
        turns = True
        chosen = [
            {**g, "rollouts": [r for r in g["rollouts"] if _of_session(r, session)]} for g in chosen
        ]
        chosen = [g for g in chosen if g["rollouts"]]
        if not chosen:
            raise DataError(
                f"{run_dir}: no rollout of session {session!r} in step {step}; pass a session id "
                "(metadata 'session', a rollout_id or a sample_id) of that step."
            )
    for g in chosen:
        glob = f" (global step {g['global_step']})" if "global_step" in g else ""
        console.rule(
            f"RL step {g['step']}{glob}  policy v{g['policy_version']}  "
            f"prompt {escape(g['prompt_uid'])}"
        )
        console.print(f"[bold]prompt[/]  {escape(str(g['prompt']))}")
        console.print(f"[bold]label[/]   {escape(str(g['label']))}")
        table = Table(show_header=True, header_style="bold")
        for col in ("#", "response", "status", "reward", "advantage", "max |mismatch|"):
            table.add_column(col, justify="left" if col in ("response", "status") else "right")
        for j, r in enumerate(g["rollouts"]):
            worst = r.get("mismatch_max")
            style = "red" if worst is not None and worst > MISMATCH_WARN else None
            table.add_row(
                str(j),
                escape(repr(r["response"])),
                r["status"],
                _num(r["reward"]),
                _num(r["advantage"], "+.3f"),
                _num(worst, ".2e"),
                style=style,
            )
        console.print(table)
        if turns:
            for j, r in enumerate(g["rollouts"]):
                console.print(_turn_table(j, r, Table, escape))
        if tokens:
            for j, r in enumerate(g["rollouts"]):
                console.print(_token_table(j, r, Table, escape))
    return step


def _turn_table(j: int, r: dict[str, Any], table_cls: Any, escape: Callable[[str], str]) -> Any:
    """Rollout ``r`` turn by turn: its loss-mask regions with token span, versions and text."""
    meta = r.get("metadata") or {}
    counts = ", ".join(f"{k} {meta[k]}" for k in SESSION_COUNTS if k in meta)
    who = meta.get("session") or r.get("rollout_id") or r.get("sample_id")
    title = f"rollout {j}: session {who}" + (f" ({counts})" if counts else "")
    table = table_cls(title=escape(title), show_header=True, header_style="bold")
    for col in ("turn", "tokens", "loss", "version", "text"):
        table.add_column(col, justify="left" if col in ("turn", "text") else "right")
    regions = r.get("regions")
    if regions is None:  # a samples.jsonl trace: join the decoded tokens
        regions = [(a, b, m, "".join(r["tokens"][a:b])) for a, b, m in mask_regions(r["loss_mask"])]
    model_turn = 0
    for a, b, m, text in regions:
        label = f"model {model_turn}" if m else "tool / template"
        model_turn += m
        versions = sorted(set(r["versions"][a:b]))
        shown = "v" + "-".join(map(str, versions[:: max(len(versions) - 1, 1)]))
        table.add_row(
            label, f"{a}..{b - 1}", str(m), shown, escape(text), style=None if m else "dim"
        )
    return table


def _token_table(j: int, r: dict[str, Any], table_cls: Any, escape: Any) -> Any:
    table = table_cls(title=f"rollout {j}: tokens", show_header=True, header_style="bold")
    for col in ("token", "mask", "version", "engine logp", "trainer logp", "mismatch"):
        table.add_column(col, justify="left" if col == "token" else "right")
    trainer = r.get("trainer_logprobs") or [None] * len(r["tokens"])
    mismatch = r.get("mismatch") or [None] * len(r["tokens"])
    for tok, m, v, lp, tlp, d in zip(
        r["tokens"], r["loss_mask"], r["versions"], r["rollout_logprobs"], trainer, mismatch
    ):
        style = "red" if d is not None and abs(d) > MISMATCH_WARN else None
        table.add_row(
            escape(repr(tok)), str(m), str(v), _num(lp), _num(tlp), _num(d, "+.2e"), style=style
        )
    return table
