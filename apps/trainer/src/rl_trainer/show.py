"""``rl-train show RUN --step N``: a run's sample traces (:mod:`rl_trainer.samples`) in a
terminal, with rich: per group its prompt and label, then one row per rollout (response,
reward, advantage, largest per-token log-prob mismatch); with ``--tokens`` each response token
with the engine's and the trainer's log-probs, mismatches above :data:`MISMATCH_WARN` in red.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rl_core.errors import DataError
from rl_trainer.ops.samples import read_samples

__all__ = ["MISMATCH_WARN", "show_samples"]

MISMATCH_WARN = 0.1
"""A per-token ``|trainer - engine|`` log-prob difference above this is highlighted."""


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def show_samples(
    run_dir: str | Path, *, step: int | None = None, tokens: bool = False, console: Any = None
) -> int:
    """Print the traces of RL step ``step`` of ``run_dir`` (default: the last traced step);
    returns the step shown."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = console or Console()
    lines = read_samples(run_dir)
    steps = sorted({int(line["step"]) for line in lines})
    if not steps:
        raise DataError(f"{Path(run_dir) / 'samples.jsonl'}: holds no traces yet.")
    step = steps[-1] if step is None else step
    chosen = [line for line in lines if line["step"] == step]
    if not chosen:
        raise DataError(
            f"{Path(run_dir) / 'samples.jsonl'}: no trace of step {step}; traced steps: "
            f"{', '.join(map(str, steps))}. Pass one of them to --step."
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
        if tokens:
            for j, r in enumerate(g["rollouts"]):
                console.print(_token_table(j, r, Table, escape))
    return step


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
