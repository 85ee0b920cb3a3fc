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
``rl_hf.HFGenerator`` and the task's reward, averaged as ``rl_trainer.phases.eval.evaluate`` does.
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


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``--set KEY=VALUE`` options as a ``{dotted.key: value}`` dict (VALUE as JSON if it parses,
    else the string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE, e.g. policy.compile_model=true")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


def _recipe(settings: dict[str, Any], run_dir: Path, **extra: Any) -> dict[str, Any]:
    """The demo recipe with the benchmark's settings (shared by the SFT and ``ours`` modes), then
    ``settings["recipe_overrides"]`` (``e2e.py --set``) and ``extra`` (dotted keys)."""
    from rl_core.config import load_config_file
    from rl_trainer.cli import recipe_path

    rec = load_config_file(recipe_path("demo"))
    rec["run_dir"] = str(run_dir)
    rec["seed"] = settings["seed"]
    rec["threads"] = settings.get("ours_threads", 1)
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
    for key, value in {**settings.get("recipe_overrides", {}), **extra}.items():
        node = rec
        *path, last = key.split(".")
        for k in path:
            node = node.setdefault(k, {})
        node[last] = value
    return rec


def cpu_time() -> float:
    """CPU seconds of this process and of its live child processes (a generator process of
    ``runtime.generator_process``; Linux ``/proc``, elsewhere this process only)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return total
    for tid in tasks:
        try:
            children = Path(f"/proc/self/task/{tid}/children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # exited meanwhile
            total += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return total


class _Clock:
    """Wall and CPU time (this process and its child processes, :func:`cpu_time`) of the RL
    phase with evaluation excluded, and the eval curve."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.cpu_start = 0.0
        self.eval_s = 0.0
        self.eval_cpu_s = 0.0
        self.curve: list[dict[str, float]] = []

    def begin(self) -> tuple[float, float]:
        """Mark the start of an eval; pass the result to :meth:`record`."""
        return time.perf_counter(), cpu_time()

    def record(self, step: int, begun: tuple[float, float], metrics: dict[str, float]) -> None:
        """Book an eval that started at ``begun`` and just ended."""
        t_begin, c_begin = begun
        now, cpu = time.perf_counter(), cpu_time()
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
    import shutil

    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer

    work = Path(settings["work_dir"])
    name = (
        "sft"
        if sft_only
        else settings.get("run_name") or ("ours_async" if settings["async"] else "ours_sync")
    )
    # Every benchmark run starts afresh: the trainer refuses a run dir holding another run.
    if (work / name).exists():
        shutil.rmtree(work / name)
    if sft_only:
        rec = _recipe(settings, work / "sft", **{"sft.steps": settings["sft_steps"], "rl.steps": 0})
    else:
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
    # Time every evaluation: the RL phase calls ``rl_trainer.phases.eval.evaluate`` through its
    # module (``evaluation.evaluate``), so wrapping the module's function books each eval on the
    # clock (the trainer has no eval hook; ``Trainer.evaluate`` went with the phase split).
    from rl_trainer.phases import eval as evaluation

    inner = evaluation.evaluate

    async def timed_evaluate(run: Any, step: int, **kw: Any) -> dict[str, float]:
        begun = clock.begin()
        m = await inner(run, step, **kw)
        clock.record(step, begun, m)
        return m

    t_wall = time.perf_counter()
    cfg = load_trainer_config(rec)
    from rl_trainer.defaults import auto_choices

    # What the trainer chose where the recipe left it open (generator process, compile, cache).
    chosen = {c.field: c.value for c in auto_choices(cfg, dict(os.environ))}
    # Only for this run: the module's own function is back afterwards (a test imports this
    # worker into a process that runs other trainers next).
    evaluation.evaluate = timed_evaluate
    try:
        records = Trainer(cfg).run()
    finally:
        evaluation.evaluate = inner
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
            "auto_choices": chosen,
        },
    )


# --------------------------------------------------------------------------------- TRL


class HeldOutEval:
    """Greedy held-out eval exactly as ``rl_trainer.phases.eval.evaluate`` does it, on a copy of the weights."""

    def __init__(self, settings: dict[str, Any]) -> None:
        from rl_buffer.scoring import Scorer
        from rl_buffer.sources import JsonlSource
        from rl_hf.generator import HFGenerator
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
        # As the trainer's eval: greedy, other fields from the run's rollout sampling.
        from rl_trainer.config import EvalConfig, SamplingConfig

        train = SamplingConfig(
            temperature=settings["temperature"], max_new_tokens=settings["max_new_tokens"]
        )
        self.sampling = EvalConfig().sampling.resolve(train).to_params()

    def __call__(self, named_weights: Any, step: int) -> dict[str, float]:
        """Load ``named_weights`` and score greedy answers to every held-out prompt."""
        from rl_buffer.failures import RolloutStats
        from rl_buffer.rollout import generate_groups

        self.generator.load_weights(named_weights, version=step)

        async def go() -> list[Any]:
            groups = await generate_groups(
                self.prompts,
                generator=self.generator,
                tokenizer=self.tokenizer,
                sampling=self.sampling,
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


def counting_reward(score: Any, eos: int, counts: dict[str, Any]) -> Any:
    """A TRL reward function around ``score(completion_text, label) -> float`` that also counts
    the samples and response tokens (as our trainer counts them: up to and including the stop
    token) into ``counts``, and appends each call's mean reward to ``counts["reward_per_call"]``
    (one call per step when a step generates once)."""

    def reward_fn(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **kw: Any
    ) -> list[float]:
        counts["samples"] = counts.get("samples", 0) + len(completions)
        counts["response_tokens"] = counts.get("response_tokens", 0) + sum(
            (ids.index(eos) + 1) if eos in ids else len(ids) for ids in completion_ids
        )
        rewards = [float(score(c, lab)) for c, lab in zip(completions, kw["label"])]
        counts.setdefault("reward_per_call", []).append(sum(rewards) / max(len(rewards), 1))
        return rewards

    return reward_fn


def grpo_config(
    config_cls: Any,
    output_dir: str,
    *,
    seed: int,
    prompts_per_step: int,
    n_samples: int,
    max_new_tokens: int,
    temperature: float,
    lr: float,
    steps: int,
    eps_low: float,
    eps_high: float,
    beta: float = 0.0,
    adam_beta1: float = 0.9,
    adam_beta2: float = 0.999,
    adam_eps: float = 1e-8,
    weight_decay: float = 0.0,
    grad_clip: float = 1.0,
    loss_type: str = "dapo",
    optim: str | None = None,
    gradient_checkpointing: bool | None = None,
) -> Any:
    """TRL's ``GRPOConfig`` (``config_cls``) matching one RL step of our trainer: ``P * G``
    completions per optimizer step in one generation round, constant-lr AdamW, one update per
    rollout batch, CPU, fp32, the data in the order given (no shuffling), no saving or reports.
    ``loss_type="dapo"``: the token-mean loss over the step (ours: ``aggregation: token``).
    ``optim``: the transformers optimizer name (``None``: its default, fused AdamW;
    ``"adamw_torch"`` is ``torch.optim.AdamW`` as our policies use it).
    ``gradient_checkpointing``: ``None`` keeps TRL's default (on)."""
    extra: dict[str, Any] = {"optim": optim} if optim is not None else {}
    if gradient_checkpointing is not None:
        extra["gradient_checkpointing"] = gradient_checkpointing
    return config_cls(
        **extra,
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        seed=seed,
        per_device_train_batch_size=prompts_per_step * n_samples,
        gradient_accumulation_steps=1,
        num_generations=n_samples,
        max_completion_length=max_new_tokens,
        temperature=temperature,
        top_p=1.0,
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=adam_beta1,
        adam_beta2=adam_beta2,
        adam_epsilon=adam_eps,
        weight_decay=weight_decay,
        max_grad_norm=grad_clip,
        beta=beta,
        epsilon=eps_low,
        epsilon_high=eps_high,
        loss_type=loss_type,
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


def timed_grpo_trainer(
    model: Any,
    reward_fn: Any,
    config: Any,
    dataset: Any,
    tokenizer: Any,
    callback: Any,
    phase: dict[str, float],
) -> Any:
    """TRL's ``GRPOTrainer`` on ``model`` with one reward function and one callback, its rollout
    phase (generate, decode, reward, advantages) timed into ``phase["rollout_s"]``."""
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer with its rollout phase timed."""

        def _generate_and_score_completions(self, *a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(*a, **kw)
            phase["rollout_s"] = phase.get("rollout_s", 0.0) + time.perf_counter() - t0
            return out

    return TimedGRPOTrainer(
        model=model,
        reward_funcs=[reward_fn],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[callback],
    )


def run_trl(settings: dict[str, Any], out: str) -> None:
    """TRL's GRPOTrainer on the same checkpoint, prompts (in the same order), reward and eval."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig

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
    check_prompt_tokens(tok, drawn)
    dataset = Dataset.from_list([{"prompt": p.input, "label": p.label} for p in drawn])
    task = ReverseTask(ReverseTask.Config())
    counts = {"samples": 0, "response_tokens": 0}
    reward_fn = counting_reward(
        lambda c, lab: task.score(c.strip(), lab)["reward"], tok.eos_token_id, counts
    )
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

    config = grpo_config(
        GRPOConfig,
        str(work / settings.get("run_name", "trl")),
        seed=settings["seed"],
        prompts_per_step=P,
        n_samples=G,
        max_new_tokens=settings["max_new_tokens"],
        temperature=settings["temperature"],
        lr=settings["lr"],
        steps=steps,
        eps_low=settings["eps_low"],
        eps_high=settings["eps_high"],
    )
    phase = {"rollout_s": 0.0}
    model = AutoModelForCausalLM.from_pretrained(str(sft))
    trainer = timed_grpo_trainer(model, reward_fn, config, dataset, tok, EvalCallback(), phase)
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


def check_prompt_tokens(tok: Any, drawn: list[Any], n: int = 64) -> None:
    """Exit unless TRL's tokenization of the prompt text (``add_special_tokens=False``) gives
    exactly the token ids our data source produced, for the first ``n`` prompts."""
    for p in drawn[:n]:
        ids = tok(p.input, add_special_tokens=False)["input_ids"]
        if tuple(ids) != tuple(p.token_ids):
            raise SystemExit(
                f"prompt {p.input!r}: TRL would tokenize it as {ids}, ours {p.token_ids}"
            )


TRL_LOSS_TYPES = {"token": "dapo", "sequence": "grpo", "constant": "dr_grpo"}
"""Our ``algorithm.aggregation`` -> TRL's ``loss_type`` with the same averaging."""


def run_trl_recipe(settings: dict[str, Any], out: str) -> None:
    """TRL's GRPOTrainer with the settings of one of our recipes (``settings["recipe"]`` plus
    ``settings["overrides"]``, the ``--set`` list of our run): the same model, task prompts in
    the order our data source draws them, reward (the task's ``score``), group size, prompts
    per step, max new tokens, temperature and top-p, AdamW settings, clip ranges, KL coefficient
    (with ``use_reference``) and loss averaging; ``settings["steps"]`` optimizer steps. No
    held-out eval: per step it records the wall and process-CPU seconds and the mean reward."""
    import dataclasses

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    from rl_core import registry
    from rl_core.algorithms.losses import PolicyLoss
    from rl_core.config import OptimizerConfig
    from rl_trainer.build import build_task, data_specs
    from rl_trainer.cli import recipe_path
    from rl_trainer.config import load_trainer_config

    torch.set_num_threads(settings.get("trl_threads", 1))
    work = Path(settings["work_dir"])
    cfg = load_trainer_config(
        recipe_path(settings["recipe"]), [*settings["overrides"], f"run_dir={work / 'trl_run'}"]
    )
    steps, P, G = settings["steps"], cfg.rollout.prompts_per_step, cfg.rollout.n_samples
    tok = AutoTokenizer.from_pretrained(cfg.model.path)
    task = build_task(cfg)
    train_spec, _ = data_specs(cfg, task, data_dir=work / "trl_data")
    src = registry.build("data_source", train_spec, field="data.train", tokenizer=tok)
    drawn = src.next_prompts(steps * P)  # our trainer's draws, P per step, in order
    check_prompt_tokens(tok, drawn)
    dataset = Dataset.from_list([{"prompt": p.input, "label": p.label} for p in drawn])
    counts: dict[str, Any] = {}
    reward_fn = counting_reward(
        lambda c, lab: task.score(c.strip(), lab)["reward"], tok.eos_token_id, counts
    )
    reward_fn.__name__ = "task_reward"
    names = {f.name for f in dataclasses.fields(OptimizerConfig)}
    opt = OptimizerConfig(**{k: v for k, v in cfg.policy.options.items() if k in names})
    loss = PolicyLoss.Config(**cfg.algorithm.loss)
    if loss.variant != "ppo" or opt.warmup_steps or cfg.rollout.sampling.top_k:
        raise SystemExit("trl_recipe: needs loss.variant ppo, no warm-up and top_k 0")
    sampling = cfg.rollout.sampling
    config = grpo_config(
        GRPOConfig,
        str(work / "trl_out"),
        seed=cfg.seed,
        prompts_per_step=P,
        n_samples=G,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        lr=opt.lr,
        steps=steps,
        eps_low=loss.eps_clip_low,
        eps_high=loss.eps_clip_high if loss.eps_clip_high is not None else loss.eps_clip_low,
        beta=loss.kl_coef if cfg.algorithm.use_reference else 0.0,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        weight_decay=opt.weight_decay,
        grad_clip=opt.grad_clip,
        loss_type=TRL_LOSS_TYPES[cfg.algorithm.aggregation],
        optim="adamw_torch",
        gradient_checkpointing=bool(cfg.policy.options.get("activation_checkpointing", False)),
    )
    timing: dict[str, list[float]] = {"step_s": [], "step_cpu_s": []}

    class StepClock(TrainerCallback):
        """Wall and process-CPU seconds of every optimizer step (generation included)."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.begun = time.perf_counter(), time.process_time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            timing["step_s"].append(time.perf_counter() - self.begun[0])
            timing["step_cpu_s"].append(time.process_time() - self.begun[1])

    phase = {"rollout_s": 0.0}
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    trainer = timed_grpo_trainer(model, reward_fn, config, dataset, tok, StepClock(), phase)
    trainer.train()
    _write(
        out,
        {
            "system": "trl",
            "steps": trainer.state.global_step,
            "samples": counts.get("samples", 0),
            "response_tokens": counts.get("response_tokens", 0),
            "step_s": timing["step_s"],
            "step_cpu_s": timing["step_cpu_s"],
            "rollout_s": phase["rollout_s"],
            "reward_per_step": counts.get("reward_per_call", []),
            "logged_reward_per_step": [
                h.get("reward") for h in trainer.state.log_history if "reward" in h
            ],
            "trl_config": {
                k: getattr(config, k)
                for k in (
                    "per_device_train_batch_size",
                    "num_generations",
                    "max_completion_length",
                    "temperature",
                    "top_p",
                    "learning_rate",
                    "adam_beta1",
                    "adam_beta2",
                    "adam_epsilon",
                    "weight_decay",
                    "max_grad_norm",
                    "beta",
                    "epsilon",
                    "epsilon_high",
                    "loss_type",
                    "scale_rewards",
                    "optim",
                    "gradient_checkpointing",
                    "seed",
                )
            },
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
    elif mode == "trl_recipe":
        run_trl_recipe(settings, out)
    else:
        raise SystemExit(f"unknown mode {mode!r}: use sft, ours, trl or trl_recipe")


if __name__ == "__main__":
    main()
