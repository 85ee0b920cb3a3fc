"""One system of the end-to-end benchmark, in its own process (driven by ``benchmarks/e2e.py``).

Modes (the JSON settings file is written by ``e2e.py``):

- ``sft SETTINGS OUT``: our trainer's SFT warm-up (demo recipe), then one held-out eval; the
  warm-up's weights in ``<work>/sft/sft_model`` are the start of every system.
- ``ours SETTINGS OUT``: our local loop (sync, or async with ``settings["async"]``; on the ``ray``
  runtime with ``settings["ray"]``) from that checkpoint.
- ``trl SETTINGS OUT``: TRL's ``GRPOTrainer`` from that checkpoint (run with the TRL venv's python;
  our pure-Python packages are installed there without dependencies).

Every mode writes ``OUT`` (JSON): the eval curve ``[{step, reward, exact, train_s}]`` where
``train_s`` is wall time since the RL phase started minus the time spent in evaluation, the
number of samples and response tokens trained on, and the RL phase's wall and eval seconds.
Evaluation is the same code in every mode: greedy decoding of the held-out prompts with
``rl_hf.HFGenerator`` and the task's reward, averaged as ``Trainer.evaluate`` does.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any


def _recipe(settings: dict[str, Any], run_dir: Path, **extra: Any) -> dict[str, Any]:
    """The demo recipe with the benchmark's settings (shared by the SFT and ``ours`` modes)."""
    from rl_core.config import load_config_file
    from rl_trainer.cli import recipe_path

    rec = load_config_file(recipe_path("demo"))
    rec["run_dir"] = str(run_dir)
    rec["seed"] = settings["seed"]
    rec["threads"] = 1
    rec["rollout"]["prompts_per_step"] = settings["prompts_per_step"]
    rec["rollout"]["n_samples"] = settings["n_samples"]
    rec["rollout"]["sampling"] = {
        "temperature": settings["temperature"],
        "max_new_tokens": settings["max_new_tokens"],
    }
    rec["policy"]["lr"] = settings["lr"]
    rec["algorithm"]["loss"].update(
        eps_clip_low=settings["eps_low"], eps_clip_high=settings["eps_high"], kl_coef=0.0
    )
    rec["algorithm"]["use_reference"] = False  # KL off on every side (TRL: beta=0)
    rec["eval"] = {"every": settings["eval_every"]}
    rec["checkpoint"] = {"every": 0, "keep": 1}
    rec["logging"] = {"tensorboard": False, "progress": False}
    for key, value in extra.items():
        node = rec
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return rec


class _Clock:
    """Wall and process-CPU time of the RL phase with evaluation excluded, and the eval curve."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.cpu_start = 0.0
        self.eval_s = 0.0
        self.eval_cpu_s = 0.0
        self.curve: list[dict[str, float]] = []

    def begin(self) -> tuple[float, float]:
        """Mark the start of an eval; pass the result to :meth:`record`."""
        return time.perf_counter(), time.process_time()

    def record(self, step: int, begun: tuple[float, float], metrics: dict[str, float]) -> None:
        """Book an eval that started at ``begun`` and just ended."""
        t_begin, c_begin = begun
        now, cpu = time.perf_counter(), time.process_time()
        if self.start is None:  # the eval at step 0: the RL phase starts when it ends
            self.start, self.cpu_start = now, cpu
            train_s = train_cpu_s = 0.0
        else:
            train_s = t_begin - self.start - self.eval_s
            train_cpu_s = c_begin - self.cpu_start - self.eval_cpu_s
            self.eval_s += now - t_begin
            self.eval_cpu_s += cpu - c_begin
        self.curve.append(
            {
                "step": step,
                "reward": metrics["eval/reward_mean"],
                "exact": metrics.get("eval/exact_mean", float("nan")),
                "train_s": train_s,
                "train_cpu_s": train_cpu_s,
            }
        )


def _write(out: str, payload: dict[str, Any]) -> None:
    payload["peak_rss_mb_self"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out).write_text(json.dumps(payload, indent=2) + "\n")


# --------------------------------------------------------------------------------- our loop


def run_ours(settings: dict[str, Any], out: str, *, sft_only: bool = False) -> None:
    """Our trainer: the SFT warm-up (``sft_only``) or the RL phase from the SFT checkpoint."""
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer

    work = Path(settings["work_dir"])
    if sft_only:
        rec = _recipe(settings, work / "sft", **{"sft.steps": settings["sft_steps"], "rl.steps": 0})
    else:
        name = settings.get("run_name") or ("ours_async" if settings["async"] else "ours_sync")
        if (work / name).exists():
            import shutil

            shutil.rmtree(work / name)
        rec = _recipe(
            settings,
            work / name,
            **{
                "model.path": str(work / "sft" / "sft_model"),
                "model.init": None,
                "sft.steps": 0,
                "rl.steps": settings["steps"],
                "rl.async_generation": bool(settings["async"]),
                "rl.max_staleness": 1,
            },
        )
        if settings.get("ray"):  # optional row: the same async loop with Ray actors
            rec["runtime"] = {"type": "ray", "num_cpus": 2, "layout": "disaggregated"}
            rec["weight_transport"] = {"type": "disk_full"}
    clock = _Clock()

    class TimedTrainer(Trainer):
        """The trainer with its evaluations timed and recorded."""

        async def evaluate(self, step: int) -> dict[str, float]:
            """Time ``Trainer.evaluate`` and book it on the clock."""
            begun = clock.begin()
            m = await super().evaluate(step)
            clock.record(step, begun, m)
            return m

    t_wall = time.perf_counter()
    trainer = TimedTrainer(load_trainer_config(rec))
    records = trainer.run()
    rl = [r for r in records if r.get("phase") == "rl" and r.get("step", 0) > 0]
    samples = sum(int(r["rollout/groups_kept"]) * settings["n_samples"] for r in rl)
    tokens = sum(
        r["rollout/response_len_mean"] * int(r["rollout/groups_kept"]) * settings["n_samples"]
        for r in rl
    )
    perf_keys = ("perf/gen_time", "perf/train_time", "perf/sync_time", "perf/rollout_wait")
    perf = {k: sum(float(r.get(k) or 0.0) for r in rl) for k in perf_keys}
    _write(
        out,
        {
            "system": "sft" if sft_only else settings.get("run_name", "ours"),
            "curve": clock.curve,
            "steps": len(rl),
            "samples": samples,
            "response_tokens": round(tokens),
            "train_s": clock.curve[-1]["train_s"] if clock.curve else 0.0,
            "train_cpu_s": clock.curve[-1]["train_cpu_s"] if clock.curve else 0.0,
            "eval_s": clock.eval_s,
            "process_wall_s": time.perf_counter() - t_wall,
            "perf_sums_s": perf,
            "train_reward_mean": [r.get("rollout/reward_mean") for r in rl],
        },
    )


# --------------------------------------------------------------------------------- TRL


class HeldOutEval:
    """Greedy held-out eval exactly as ``Trainer.evaluate`` does it, on a copy of the weights."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from rl_buffer.sources import JsonlSource
        from rl_hf.generator import HFGenerator
        from rl_trainer.rollout import Scorer
        from rl_trainer.tasks import ReverseTask

        work = Path(settings["work_dir"])
        sft = work / "sft" / "sft_model"
        self.generator = HFGenerator(HFGenerator.Config(model_path=str(sft), max_batch_size=256))
        self.tokenizer = self.generator.tokenizer
        src = JsonlSource(
            JsonlSource.Config(path=str(work / "sft" / "data" / "eval.jsonl"), shuffle=False),
            self.tokenizer,
        )
        self.prompts = src.next_prompts(len(src))
        self.scorer = Scorer(ReverseTask(ReverseTask.Config()), self.tokenizer)
        self.seed = settings["seed"]

    def __call__(self, named_weights: Any, step: int) -> dict[str, float]:
        """Load ``named_weights`` and score greedy answers to every held-out prompt."""
        from rl_trainer.config import EvalConfig
        from rl_trainer.rollout import RolloutStats, generate_groups

        self.generator.load_weights(named_weights, version=step)

        async def go() -> list[Any]:
            groups = await generate_groups(
                self.prompts,
                generator=self.generator,
                tokenizer=self.tokenizer,
                sampling=EvalConfig().sampling.to_params(),  # as Trainer.evaluate: greedy
                n_samples=1,
                seed_parts=(self.seed, "eval", step),
                policy_version=step,
            )
            await self.scorer.score(groups, RolloutStats())
            return [r for g in groups for r in g.rollouts]

        rs = asyncio.run(go())
        reward = [float(r.reward) if r.reward is not None else 0.0 for r in rs]
        exact = [r.reward_info.get("exact", 0.0) for r in rs]
        return {
            "eval/reward_mean": sum(reward) / len(reward),
            "eval/exact_mean": sum(exact) / len(exact),
        }


def run_trl(settings: dict[str, Any], out: str) -> None:
    """TRL's GRPOTrainer on the same checkpoint, prompts (in the same order), reward and eval."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_buffer.sources import JsonlSource
    from rl_trainer.tasks import ReverseTask

    torch.set_num_threads(settings.get("trl_threads", 1))
    work = Path(settings["work_dir"])
    sft = work / "sft" / "sft_model"
    evaluator = HeldOutEval(settings)
    tok = evaluator.tokenizer
    steps, P, G = settings["steps"], settings["prompts_per_step"], settings["n_samples"]

    # Our trainer draws P prompts per step from this source (seeded shuffle): give TRL the same
    # sequence, unshuffled, one prompt per draw.
    src = JsonlSource(
        JsonlSource.Config(
            path=str(work / "sft" / "data" / "train.jsonl"), shuffle=True, seed=settings["seed"]
        ),
        tok,
    )
    drawn = src.next_prompts(steps * P)
    for p in drawn[:64]:
        ids = tok(p.input, add_special_tokens=False)["input_ids"]
        if tuple(ids) != tuple(p.token_ids):
            raise SystemExit(
                f"prompt {p.input!r}: TRL would tokenize it as {ids}, ours {p.token_ids}"
            )
    dataset = Dataset.from_list([{"prompt": p.input, "label": p.label} for p in drawn])
    task = ReverseTask(ReverseTask.Config())
    counts = {"samples": 0, "response_tokens": 0}
    eos = tok.eos_token_id

    def reward_fn(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        counts["samples"] += len(completions)
        # Response tokens as our trainer counts them: up to and including the stop token.
        counts["response_tokens"] += sum(
            (ids.index(eos) + 1) if eos in ids else len(ids) for ids in completion_ids
        )
        return [task.score(c.strip(), lab)["reward"] for c, lab in zip(completions, kw["label"])]

    reward_fn.__name__ = "position_match"
    clock = _Clock()
    every = settings["eval_every"]

    class EvalCallback(TrainerCallback):
        """The held-out eval at step 0, every ``eval_every`` steps and at the end."""

        def _eval(self, model: Any, step: int) -> None:
            begun = clock.begin()
            weights = [(n, t.detach()) for n, t in model.state_dict().items()]
            clock.record(step, begun, evaluator(weights, step))

        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            self._eval(model, 0)

        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any):
            s = state.global_step
            if s % every == 0 or s == steps:
                self._eval(model, s)

    config = GRPOConfig(
        output_dir=str(work / settings.get("run_name", "trl")),
        use_cpu=True,
        bf16=False,
        seed=settings["seed"],
        per_device_train_batch_size=P * G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=settings["max_new_tokens"],
        temperature=settings["temperature"],
        top_p=1.0,
        learning_rate=settings["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=0.0,
        epsilon=settings["eps_low"],
        epsilon_high=settings["eps_high"],
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        shuffle_dataset=False,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    phase = {"rollout_s": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its rollout phase (generate, decode, reward, advantages) timed."""

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            phase["rollout_s"] += time.perf_counter() - t0
            return out

    model = AutoModelForCausalLM.from_pretrained(str(sft))
    trainer = TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward_fn],
        args=config,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[EvalCallback()],
    )
    t_wall = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    _write(
        out,
        {
            "system": "trl",
            "curve": clock.curve,
            "steps": trainer.state.global_step,
            "samples": counts["samples"],
            "response_tokens": counts["response_tokens"],
            "train_s": clock.curve[-1]["train_s"] if clock.curve else 0.0,
            "train_cpu_s": clock.curve[-1]["train_cpu_s"] if clock.curve else 0.0,
            "eval_s": clock.eval_s,
            "process_wall_s": time.perf_counter() - t_wall,
            "perf_sums_s": {"rollout (generate+score)": phase["rollout_s"]},
            "train_reward_mean": [h.get("reward") for h in logs],
        },
    )


def main() -> None:
    """``_e2e_worker.py MODE SETTINGS_JSON OUT_JSON``."""
    mode, settings_path, out = sys.argv[1:4]
    settings = json.loads(Path(settings_path).read_text())
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if mode == "sft":
        run_ours(settings, out, sft_only=True)
    elif mode == "ours":
        run_ours(settings, out)
    elif mode == "trl":
        run_trl(settings, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}: use sft, ours or trl")


if __name__ == "__main__":
    main()
