"""Run four fixed-seed recipes and record their metrics (timings left out), or compare two
such records value for value: the check that a restructuring changed no behaviour.

Runs (each a short ``rl-train run`` in its own process, one thread):

- ``demo``: the embedded default recipe (HF policy, HF generator);
- ``megatron``: the same with ``policy.type=megatron`` (Megatron-core on gloo);
- ``lora``: the same with a LoRA policy (rank 4) and the KL reference on the base view;
- ``sglang``: the ``sglang_demo`` recipe (a real SGLang server on CPU), skipped with a line
  when SGLang's venv is missing.

Usage::

    python scripts/same_metrics.py record OUT_DIR [--only demo,lora] [--set KEY=VALUE ...]
    python scripts/same_metrics.py compare BEFORE_DIR AFTER_DIR

``record`` writes ``OUT_DIR/<name>.jsonl`` (one metric record per line, without ``perf/`` and
time keys). ``compare`` prints, per run, whether every record is equal and the first
difference; it exits 1 when a run present in both differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

COMMON = (
    "rl.steps=6",
    "sft.steps=4",
    "eval.every=3",
    "eval.max_prompts=16",
    "checkpoint.every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
)

RUNS: dict[str, tuple[str, tuple[str, ...]]] = {
    "demo": ("demo", ()),
    "megatron": ("demo", ("policy.type=megatron",)),
    "lora": ("demo", ("policy.lora.rank=4", "policy.lora.alpha=8", "policy.lr=0.003")),
    "sglang": ("sglang_demo", ()),
}

_TIME_WORDS = ("time", "_s", "seconds", "per_s", "elapsed", "wall")


def _timing(key: str) -> bool:
    """Whether a metric key is a timing (left out of the comparison)."""
    if key.startswith("perf/") or key in ("time", "wall_time", "timestamp"):
        return True
    last = key.rsplit("/", 1)[-1]
    return any(last.endswith(w) or last.startswith("time") for w in _TIME_WORDS)


def record(out_dir: Path, only: list[str], extra: list[str] = ()) -> None:
    """Run each selected recipe (with the ``extra`` ``KEY=VALUE`` overrides) and write its
    metrics without timings to ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in only:
        recipe, overrides = RUNS[name]
        with tempfile.TemporaryDirectory() as tmp:
            run_dir = Path(tmp) / name
            sets = [f"run_dir={run_dir}", *COMMON, *overrides, *extra]
            args = [a for s in sets for a in ("--set", s)]
            cmd = [sys.executable, "-m", "rl_trainer.cli", "run", recipe, "--no-report", *args]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                tail = (proc.stdout + proc.stderr)[-3000:]
                if name == "sglang" and "sglang" in tail.lower() and "venv" in tail.lower():
                    print(f"{name}: skipped (SGLang venv missing)")
                    continue
                print(f"{name}: FAILED rc={proc.returncode}\n{tail}")
                continue
            rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
            kept = [{k: v for k, v in r.items() if not _timing(k)} for r in rows]
            (out_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
            print(f"{name}: {len(kept)} records")


def compare(before: Path, after: Path) -> int:
    """Compare two record directories; returns the exit status (1 when a run differs)."""
    status = 0
    for name in RUNS:
        a, b = before / f"{name}.jsonl", after / f"{name}.jsonl"
        if not (a.exists() and b.exists()):
            print(f"{name}: not in both")
            continue
        ra = [json.loads(x) for x in a.read_text().splitlines()]
        rb = [json.loads(x) for x in b.read_text().splitlines()]
        if ra == rb:
            n = sum(len(r) for r in ra)
            print(f"{name}: identical ({len(ra)} records, {n} values)")
            continue
        status = 1
        for i, (x, y) in enumerate(zip(ra, rb, strict=False)):
            if x != y:
                keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                diff = {k: (x.get(k), y.get(k)) for k in keys[:6]}
                print(f"{name}: record {i} differs: {diff}")
                break
        else:
            print(f"{name}: {len(ra)} vs {len(rb)} records")
    return status


def main() -> None:
    """Command line: ``record OUT [--only a,b]`` or ``compare BEFORE AFTER``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("out", type=Path)
    r.add_argument("--only", default=",".join(RUNS))
    r.add_argument("--set", action="append", default=[], help="KEY=VALUE for every run")
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    a = p.parse_args()
    if a.cmd == "record":
        record(a.out, [x for x in a.only.split(",") if x], a.set)
    else:
        sys.exit(compare(a.before, a.after))


if __name__ == "__main__":
    main()
