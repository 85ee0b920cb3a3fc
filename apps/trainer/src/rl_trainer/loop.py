"""The training loop (DESIGN §6), synchronous or asynchronous, on the ``local`` or ``ray``
runtime::

    for step in range(rl.steps):
        round: prompts  = train_data.next_prompts(P)       # DataSource
               groups   = generate n rollouts per prompt    # Generator / GenerateFn
               score    -> rewards, failures counted        # RewardFn
               filter   -> over-sample until P fresh groups # GroupFilter (stale surplus dropped)
               buffer.put(groups)                           # Buffer
        groups = buffer.take(P, min_version=policy.version - rl.max_staleness)
        advantages -> packed TrainBatch (+ ref log-probs)   # AdvantageFn, loss weights
                      (with a critic: values -> GAE)        # Critic
        policy.train_step(batch, loss)                      # Policy, LossFn
        critic.train_step(batch, value_loss)                # Critic, ValueLossFn (optional)
        update = transport.publish(version, named_weights)  # WeightTransport
        generator.update_weights(update, transport)
        evaluate / checkpoint on schedule

Synchronous (default): the round of step k runs right before step k trains. With
``rl.async_generation`` the rounds run ahead in a producer task (:mod:`rl_trainer.pipeline`)
while the policy trains in its own thread; the generator serves exactly the version
``max_staleness`` behind, so ``max_staleness = 0`` is the synchronous run. Both modes share the
round (:meth:`Trainer._produce`), the take and the train step; only who runs the round and
when the generator receives weights differ.

An optional SFT warm-up on the training labels runs first, with the same policy and packing.
On the ``ray`` runtime (:mod:`rl_trainer.runtime`) the policy and the generators are actors
behind proxies that implement the same interfaces, so this loop is unchanged.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import random
import shutil
import socket
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_buffer.balance import schedule_step
from rl_buffer.sampler import DynamicSampler
from rl_core import registry
from rl_core.algorithms import (
    ADVANTAGE_ESTIMATORS,
    PolicyLoss,
    SFTLoss,
    ValueLoss,
    compute_loss_weights,
)
from rl_core.batching import gather_response, pack_rollouts, scatter_response
from rl_core.config import ComponentSpec, from_dict, to_dict
from rl_core.errors import CheckpointError, ConfigError, RLError
from rl_core.interfaces import GenerateFn, GroupFilter, GroupRewardFn, RewardFn
from rl_core.types import AdvantageInputs, Group, Prompt, Rollout, SamplingParams, TrainBatch
from rl_trainer.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_trainer_state,
    restore_rng,
    resume_checkpoint,
    write_checkpoint,
)
from rl_trainer.config import TrainerConfig
from rl_trainer.evaluation import build_eval_sets
from rl_trainer.failures import FailureLog, exhausted_error
from rl_trainer.metrics import MetricsLogger
from rl_trainer.pipeline import RolloutPipeline, Weights
from rl_trainer.rollout import (
    GuardedFilter,
    PartialStats,
    RolloutStats,
    Scorer,
    filter_groups,
    generate_groups,
    generate_groups_resumable,
)
from rl_trainer.stopping import StopSignals

__all__ = ["Trainer"]

logger = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else float("nan")


def _component_name(field: str, spec: ComponentSpec | None) -> str:
    """How failure reports name a component: its config field and type."""
    return f"{field} (type {spec.type!r})" if spec is not None else field


class Trainer:
    """Builds every component from a :class:`TrainerConfig` and runs SFT warm-up then RL."""

    def __init__(self, config: TrainerConfig, *, resume: bool = False) -> None:
        self.config = config
        self.resume = resume
        self.run_dir = config.run_path
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.set_num_threads(config.threads)
        self._seed_everything(config.seed)
        self._build()

    # ----------------------------------------------------------------------------- setup
    @staticmethod
    def _seed_everything(seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _model_path(self) -> str:
        cfg = self.config
        if cfg.model.path:
            return cfg.model.path
        from rl_hf.tiny import TinyModelSpec, build_tiny_model

        path = self.run_dir / "init_model"
        if not (path / "config.json").exists():
            spec = from_dict(
                TinyModelSpec, {"seed": cfg.seed, **(cfg.model.init or {})}, path="model.init"
            )
            build_tiny_model(path, spec)
        return str(path)

    @staticmethod
    def _config_fields(kind: str, spec: ComponentSpec) -> set[str]:
        """Option names the ``Config`` of the component ``spec`` names (empty if it has none)."""
        cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
        return {f.name for f in dataclasses.fields(cls.Config)} if hasattr(cls, "Config") else set()

    @classmethod
    def _with(cls, kind: str, spec: ComponentSpec, **defaults: Any) -> ComponentSpec:
        """``spec`` with run-wide defaults (model path, seed) for the options its ``Config`` has."""
        known = cls._config_fields(kind, spec)
        return ComponentSpec(
            type=spec.type,
            options={**{k: v for k, v in defaults.items() if k in known}, **spec.options},
        )

    def _build(self) -> None:
        cfg = self.config
        self.init_model_path = self._model_path()
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.init_model_path)
        self.transport: Any = None
        self.receiver: Any = None
        self.buffer = registry.build("buffer", cfg.buffer, field="buffer")
        # Validate the backend specs now, before any work: a typo fails at start-up.
        for kind, spec in (
            ("policy", cfg.policy),
            ("generator", cfg.generator),
            ("weight_transport", self._transport_spec(self.init_model_path)),
        ):
            cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
            if hasattr(cls, "Config"):
                opts = self._with(kind, spec, model_path=self.init_model_path).options
                from_dict(cls.Config, opts, path=kind)
        self.runtime: Any = None  # RayRuntime on the ray runtime: policy/generators are actors
        if cfg.runtime.type == "ray":
            from rl_trainer.runtime import RayRuntime, check_ray_config

            check_ray_config(cfg, self._transport_spec(self.init_model_path))
        self.policy: Any = None
        self.generator: Any = None
        self.reference: Any = None
        self.critic: Any = None

        # Data and reward: a built-in task writes its splits and scores responses.
        task = None
        if cfg.task is not None:
            task = registry.build("task", cfg.task, field="task")
        train_spec, eval_spec = cfg.data.train, cfg.data.eval
        if task is not None:
            paths = task.write_splits(self.run_dir / "data")
            train_spec = train_spec or ComponentSpec(
                type="jsonl", options={"path": str(paths["train"]), "shuffle": True}
            )
            eval_spec = eval_spec or ComponentSpec(
                type="jsonl", options={"path": str(paths["eval"]), "shuffle": False}
            )
        self.train_data = registry.build(
            "data_source",
            self._with("data_source", train_spec, seed=cfg.seed),
            field="data.train",
            tokenizer=self.tokenizer,
        )
        eval_data = (
            registry.build("data_source", eval_spec, field="data.eval", tokenizer=self.tokenizer)
            if eval_spec is not None
            else None
        )
        if cfg.reward is not None:
            reward_fn = registry.build("reward", cfg.reward, field="reward")
            reward_field, reward_spec = "reward", cfg.reward
        elif task is not None:
            reward_fn = task
            reward_field, reward_spec = "task", cfg.task
        else:
            raise ConfigError(
                "reward: set a reward function (e.g. reward: {type: 'my_pkg.rewards:score'})."
            )
        # Signatures are checked now; a mismatch says how the trainer calls the component.
        registry.check_callable(reward_fn, RewardFn, field=reward_field, ref=reward_spec.type)
        reward_name = _component_name(reward_field, reward_spec)
        group_reward_fn = None
        if cfg.group_reward is not None:
            group_reward_fn = registry.build("reward", cfg.group_reward, field="group_reward")
            registry.check_callable(
                group_reward_fn, GroupRewardFn, field="group_reward", ref=cfg.group_reward.type
            )
        self.scorer = Scorer(
            reward_fn,
            self.tokenizer,
            group_reward_fn=group_reward_fn,
            reward_name=reward_name,
            group_reward_name=_component_name("group_reward", cfg.group_reward),
        )
        self.eval_sets = build_eval_sets(
            cfg.eval,
            default_source=eval_data,
            default_reward=reward_fn,
            default_reward_name=reward_name,
            train_sampling=cfg.rollout.sampling,
            tokenizer=self.tokenizer,
        )
        self.filters: list[GuardedFilter] = []
        for i, spec in enumerate(cfg.rollout.filters):
            where = f"rollout.filters[{i}]"
            fn = registry.build("filter", spec, field=where)
            registry.check_callable(fn, GroupFilter, field=where, ref=spec.type)
            self.filters.append(GuardedFilter(fn, _component_name(where, spec)))
        self._failure_log = FailureLog(logger)
        self.sampler = DynamicSampler(
            DynamicSampler.Config(
                batch_size=cfg.rollout.prompts_per_step,
                over_sampling_factor=cfg.rollout.over_sampling_factor,
                max_rounds=cfg.rollout.max_rounds,
            ),
            self.filters,
        )
        self.generate_fn = (
            registry.build("generate_fn", cfg.rollout.generate_fn, field="rollout.generate_fn")
            if cfg.rollout.generate_fn is not None
            else None
        )
        if self.generate_fn is not None:
            registry.check_callable(
                self.generate_fn,
                GenerateFn,
                field="rollout.generate_fn",
                ref=cfg.rollout.generate_fn.type,
            )
        if cfg.rl.partial_rollouts and not getattr(self.buffer, "supports_partial", False):
            raise ConfigError(
                f"rl.partial_rollouts: buffer type {cfg.buffer.type!r} has no partial store "
                "(put_partial/take_partial); use buffer.type: fifo or turn partial_rollouts off."
            )

        # Algorithm.
        alg = cfg.algorithm
        if alg.advantage in ADVANTAGE_ESTIMATORS:
            est_cls = ADVANTAGE_ESTIMATORS[alg.advantage]
            self.advantage_fn = est_cls(
                from_dict(est_cls.Config, alg.advantage_options, path="algorithm.advantage_options")
            )
        else:
            self.advantage_fn = registry.build(
                "advantage",
                ComponentSpec(type=alg.advantage, options=alg.advantage_options),
                field="algorithm.advantage",
            )
        self.value_loss_fn = (
            ValueLoss(from_dict(ValueLoss.Config, alg.value_loss, path="algorithm.value_loss"))
            if cfg.critic is not None
            else None
        )
        self.loss_config = from_dict(PolicyLoss.Config, alg.loss, path="algorithm.loss")
        self.loss_fn = PolicyLoss(self.loss_config)
        if self.loss_config.kl_coef > 0 and not alg.use_reference:
            raise ConfigError("algorithm.loss.kl_coef > 0 needs algorithm.use_reference: true.")

        self.state: dict[str, Any] = {"sft_step": 0, "rl_step": 0, "eval_at_0": False}
        self.pipeline: RolloutPipeline | None = None
        self._train_thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._first_version = 0
        self._ready_rounds: dict[int, dict[str, Any]] = {}
        self._resume_lines: int | None = None
        self._resume_from: Path | None = None
        if self.resume:
            self._restore()
        if cfg.runtime.type == "ray":
            self.runtime = RayRuntime(cfg)

    def _transport_spec(self, start_path: str) -> ComponentSpec:
        """The weight transport's spec with run-local defaults: sync directories under the run,
        the RL start checkpoint as the delta base and as the source of config/tokenizer files."""
        return self._with(
            "weight_transport",
            self.config.weight_transport,
            directory=str(self.run_dir / "weights"),
            local_dir=str(self.run_dir / "weights_local"),
            base_checkpoint=start_path,
            assets_dir=start_path,
            rank=0,
            world_size=2,
        )

    def _build_transports(self, start_path: str) -> tuple[Any, Any]:
        """The sender side and the generator's receiver side of the weight transport.

        File and in-process transports serve both sides with one object. A collective transport
        (its ``Config`` has ``rank``/``world_size``) gets a sender at rank 0 and, in the local
        runtime, a receiver at rank 1 in the generator's thread, on a free loopback port unless
        the recipe names one.
        """
        spec = self._transport_spec(start_path)
        fields = self._config_fields("weight_transport", spec)
        if self.runtime is not None:  # ray: sender on policy rank 0, receivers in the engines
            return None, self.runtime.receiver  # (or in this driver, for a driver generator)
        if not {"rank", "world_size"} <= fields:
            sender = registry.build("weight_transport", spec, field="weight_transport")
            return sender, sender
        opts = dict(spec.options)
        if "port" in fields and "port" not in opts:
            opts["port"] = _free_port()
        opts["world_size"] = 2
        sender = registry.build(
            "weight_transport",
            ComponentSpec(type=spec.type, options={**opts, "rank": 0}),
            field="weight_transport",
        )
        receiver = registry.build(
            "weight_transport",
            ComponentSpec(type=spec.type, options={**opts, "rank": 1}),
            field="weight_transport",
        )
        return sender, receiver

    def _build_policy(self, model_path: str, *, role: str = "policy", **overrides: Any) -> Any:
        spec = self._with(
            "policy", self.config.policy, model_path=model_path, seed=self.config.seed
        )
        spec = ComponentSpec(
            type=spec.type, options={**spec.options, "model_path": model_path, **overrides}
        )
        if self.runtime is not None:
            return self.runtime.build_policy(spec, role=role)
        return registry.build("policy", spec, field="policy")

    def _build_critic(self, model_path: str) -> Any:
        spec = self.config.critic
        spec = ComponentSpec(
            type=spec.type,
            options={"seed": self.config.seed, **spec.options, "model_path": model_path},
        )
        if self.runtime is not None:
            return self.runtime.build_critic(spec)
        return registry.build("critic", spec, field="critic")

    @property
    def sft_model_path(self) -> Path:
        """Where the warm-up's final weights go; the RL phase starts from them."""
        return self.run_dir / "sft_model"

    def _rl_start_path(self) -> str:
        return str(self.sft_model_path) if self.config.sft.steps > 0 else self.init_model_path

    # ----------------------------------------------------------------------------- checkpoints
    def _trainer_state(self, metrics_lines: int) -> dict[str, Any]:
        return {
            "state": dict(self.state),
            "policy_version": self.policy.version,
            "train_data": self.train_data.state_dict(),
            "buffer": self.buffer.state_dict(),
            "sampler": self.sampler.state_dict(),
            "pipeline": self.pipeline.state_dict() if self.pipeline is not None else {"ready": {}},
            "rng": capture_rng(),
            "metrics_lines": metrics_lines,
            "config": to_dict(self.config),
        }

    def _save(self, metrics: MetricsLogger) -> None:
        step_index = self.state["sft_step"] + self.state["rl_step"]
        write_checkpoint(
            self.run_dir,
            step_index,
            save_models=self._checkpoint_savers(),
            trainer_state=self._trainer_state(metrics.lines),
            keep=self.config.checkpoint.keep,
        )

    def _checkpoint_savers(self) -> dict[str, Any]:
        savers = {"policy": lambda d: self.policy.save(d, with_optimizer=True)}
        if self.critic is not None:
            savers["critic"] = lambda d: self.critic.save(d, with_optimizer=True)
        return savers

    def _restore(self) -> None:
        """Read the newest intact checkpoint's trainer state (every file is verified against the
        checkpoint's manifest first; ``checkpoint.on_damaged`` says what a damaged one does); the
        policy is loaded when its phase starts."""
        ckpt = resume_checkpoint(self.run_dir, on_damaged=self.config.checkpoint.on_damaged)
        if ckpt is None:
            return  # nothing to resume: start fresh (the run was killed before its first checkpoint)
        st = load_trainer_state(ckpt)
        self.state = dict(st["state"])
        self.train_data.load_state_dict(st["train_data"])
        self.buffer.load_state_dict(st["buffer"])
        self.sampler.load_state_dict(st["sampler"])
        self._ready_rounds = dict(st.get("pipeline", {}).get("ready", {}))
        self._resume_lines = st["metrics_lines"]
        self._resume_from = ckpt
        self._resume_state = st

    def _load_resumed_policy(self) -> None:
        """Load the checkpointed policy into the freshly built one of the current phase."""
        if self._resume_from is None:
            return
        ckpt, st = self._resume_from, self._resume_state
        self._load_model(self.policy, ckpt / "policy")
        if self.critic is not None:
            self._load_model(self.critic, ckpt / "critic")
        if self.policy.version != st["policy_version"]:
            raise CheckpointError(
                f"{ckpt}: policy version {self.policy.version} != recorded "
                f"{st['policy_version']}; resume with the recipe that wrote this checkpoint."
            )
        restore_rng(st["rng"])
        self._resume_from = None

    @staticmethod
    def _load_model(model: Any, path: Path) -> None:
        """``model.load(path)`` with its optimizer; a failure is a CheckpointError naming
        ``path`` (a verified checkpoint fails only for a recipe whose model differs from the
        saved one; an unverified one, written before manifests, may also be damaged)."""
        try:
            model.load(path, with_optimizer=True)
        except RLError:
            raise
        except Exception as e:  # the backends' loaders raise many types; one meaning here
            raise CheckpointError(
                f"{path}: cannot be loaded ({type(e).__name__}: {e}). Resume with the recipe "
                f"that wrote this checkpoint, or delete {path.parent} to resume from the one "
                "before it."
            ) from e

    # ----------------------------------------------------------------------------- pieces
    async def _publish(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Publish ``weights`` as ``version`` and have the generator load them (checked)."""
        if self.runtime is not None:  # ray: policy rank 0 publishes what it holds
            update = self.runtime.publish(version, weights)
        else:
            update = self.transport.publish(version, weights)
        await self.generator.update_weights(update, self.receiver)
        if self.generator.weight_version != version:
            raise RLError(
                f"generator serves version {self.generator.weight_version} after an update to "
                f"{version}; the weight transport did not apply it."
            )

    async def _sync_weights(self) -> float:
        """Bring the generator to the policy's current weights; returns the seconds it took."""
        t0 = time.perf_counter()
        await self._publish(self.policy.version, self.policy.named_weights())
        return time.perf_counter() - t0

    async def _serve(self, version: int, weights: Weights | None) -> None:
        """Bring the generator to ``version`` for a rollout round (async mode): publish the copy
        the trainer released, or the live policy when it holds exactly ``version``."""
        if self.generator.weight_version >= version:
            return
        if weights is None:
            if self.policy.version != version:
                raise RLError(
                    f"weights of version {version} were not kept (policy is at "
                    f"{self.policy.version}); this is a bug in the rollout pipeline."
                )
            weights = self.policy.named_weights()
        await self._publish(version, weights)

    def _plan(
        self, rollouts: Sequence[Rollout]
    ) -> tuple[list[int], tuple[int, ...], tuple[int, ...]]:
        """FLOPs-balanced plan (rl-buffer's scheduler) under the token cap: the order to pack the
        rollouts in, the micro-batch bounds and, with data-parallel policy ranks, the shard
        bounds (``()`` for one rank). Shards are packed one after the other in rank order."""
        dp = int(getattr(self.policy, "data_parallel_size", 1))
        plan = schedule_step(
            rollouts,
            dp_size=dp,
            max_tokens_per_micro_batch=self.config.rl.max_tokens_per_micro_batch,
            shape=self.policy.model_shape,
        )
        if dp == 1:
            return plan.rank_samples(0), plan.micro_batch_bounds(0), ()
        order: list[int] = []
        bounds: list[int] = [0]
        dp_bounds: list[int] = [0]
        for rank in range(dp):
            offset = len(order)
            order.extend(plan.rank_samples(rank))
            bounds.extend(offset + b for b in plan.micro_batch_bounds(rank)[1:])
            dp_bounds.append(len(order))
        return order, tuple(sorted(set(bounds))), tuple(dp_bounds)

    def _pack(
        self, rollouts: Sequence[Rollout], *, mask_versions_below: int | None = None
    ) -> tuple[TrainBatch, list[int]]:
        """Plan (:meth:`_plan`) and pack ``rollouts``: the batch, with its micro-batch and
        data-parallel shard bounds, and the order its sequences are in."""
        order, bounds, dp_bounds = self._plan(rollouts)
        batch = pack_rollouts(
            [rollouts[i] for i in order],
            micro_batch_bounds=bounds,
            mask_versions_below=mask_versions_below,
        )
        batch.dp_bounds = dp_bounds
        return batch, order

    def _sft_rollouts(self, prompts: Sequence[Prompt]) -> list[Rollout]:
        eos = self.tokenizer.eos_token_id
        out = []
        for p in prompts:
            if p.label is None:
                raise RLError(f"sft: prompt {p.uid} has no label; SFT warm-up needs labelled data.")
            resp = list(self.tokenizer.encode(str(p.label), add_special_tokens=False)) + (
                [eos] if eos is not None else []
            )
            n = len(resp)
            out.append(
                Rollout(
                    prompt_uid=p.uid,
                    rollout_id=p.uid,
                    sample_id=p.uid,
                    tokens=tuple(p.token_ids) + tuple(resp),
                    response_start=len(p.token_ids),
                    loss_mask=(1,) * n,
                    rollout_logprobs=(0.0,) * n,
                    versions=(self.policy.version,) * n,
                )
            )
        return out

    def _sft_step(self) -> dict[str, Any]:
        cfg = self.config
        t0 = time.perf_counter()
        prompts = self.train_data.next_prompts(cfg.sft.batch_size)
        rollouts = self._sft_rollouts(prompts)
        batch, _ = self._pack(rollouts)
        m = self.policy.train_step(batch, SFTLoss())
        dt = time.perf_counter() - t0
        self.state["sft_step"] += 1
        return {
            "step": self.state["sft_step"],
            "phase": "sft",
            "train/loss": m["loss"],
            "train/grad_norm": m["grad_norm"],
            "train/entropy": m.get("entropy"),
            "perf/step_time": dt,
            "perf/train_tokens_per_s": batch.num_tokens / dt,
        }

    def _train_version(self, step: int) -> int:
        """The policy version that trains RL step ``step`` (one optimizer step per RL step)."""
        return self._first_version + step - 1

    async def _produce(self, step: int) -> dict[str, Any]:
        """One rollout round: generate and score until the dynamic sampler holds
        ``prompts_per_step`` kept groups fresh enough for step ``step`` (surplus kept groups carry
        over to the next round), put them into the buffer, and return the round's metrics.

        User code that fails (reward, group reward, ``generate_fn``, filters) is counted in
        ``rollout/failed/<reason>`` and logged once per reason with its first cause; when every
        rollout of a round failed, the run stops at once with that report."""
        cfg = self.config.rollout
        stats = RolloutStats()
        scored: list[Rollout] = []
        stale = self.sampler.drop_older_than(
            self._train_version(step) - self.config.rl.max_staleness
        )
        gen_tokens, gen_time = 0, 0.0
        round_ = 0
        partial = PartialStats() if self.config.rl.partial_rollouts else None
        while not self.sampler.full:
            prompts = self.train_data.next_prompts(self.sampler.request_size())
            t0 = time.perf_counter()
            seed_parts = (self.config.seed, "rl", step, round_)
            round_stats = RolloutStats()
            if partial is not None and self.pipeline is not None:
                groups = await generate_groups_resumable(
                    prompts,
                    generator=self.generator,
                    buffer=self.buffer,
                    sampling=cfg.sampling.to_params(),
                    n_samples=cfg.n_samples,
                    seed_parts=seed_parts,
                    updates=self.pipeline,
                    stats=partial,
                )
                round_stats.rollouts += sum(len(g.rollouts) for g in groups)
            else:
                groups = await self._generate(
                    prompts, cfg.sampling.to_params(), cfg.n_samples, seed_parts, round_stats
                )
            gen_time += time.perf_counter() - t0
            gen_tokens += sum(r.response_length for g in groups for r in g.rollouts)
            await self.scorer.score(groups, round_stats)
            scored.extend(r for g in groups for r in g.rollouts)
            # Failed rollouts leave their group (groups may be uneven); the filters see the rest.
            for f in self.filters:
                f.stats = round_stats
            self.sampler.add(filter_groups(groups, (), round_stats))
            round_ += 1
            where = f"step {step}, round {round_}"
            round_stats.check(where)
            self._failure_log.log(
                where, round_stats.rollouts, round_stats.failed, round_stats.first
            )
            stats.merge(round_stats)
            if round_ >= cfg.max_rounds and not self.sampler.full:
                raise self._exhausted(round_, stats)
        self.buffer.put(self.sampler.pop_batch())
        record = self._round_metrics(scored, stats, stale, gen_tokens, gen_time)
        if partial is not None:
            record["rollout/partial_interruptions"] = partial.interruptions
            record["rollout/partial_resumed"] = partial.resumed
            record["rollout/partial_resumed_tokens"] = partial.resumed_tokens
        return record

    def _exhausted(self, rounds: int, stats: RolloutStats) -> RLError:
        """The error when ``rollout.max_rounds`` rounds did not fill the step (see
        :func:`rl_trainer.failures.exhausted_error`)."""
        return exhausted_error(
            rounds=rounds,
            kept=self.sampler.num_kept,
            wanted=self.config.rollout.prompts_per_step,
            n_samples=self.config.rollout.n_samples,
            step_counts=self.sampler.step_counts,
            rollouts=stats.rollouts,
            failed=stats.failed,
            first=stats.first,
            unusable=stats.dropped.get("no_valid_rollout", 0),
        )

    def _round_metrics(
        self,
        all_scored: Sequence[Rollout],
        stats: RolloutStats,
        stale: int,
        gen_tokens: int,
        gen_time: float,
    ) -> dict[str, Any]:
        scored = [r for r in all_scored if r.reward is not None]
        record: dict[str, Any] = {}
        rewards = [float(r.reward) for r in scored]
        record["rollout/reward_mean"] = _mean(rewards)
        record["rollout/reward_std"] = float(np.std(rewards)) if rewards else float("nan")
        for key in sorted({k for r in scored for k in r.reward_info} - {"reward"}):
            record[f"rollout/{key}_mean"] = _mean(
                [r.reward_info[key] for r in scored if key in r.reward_info]
            )
        record["rollout/response_len_mean"] = _mean([r.response_length for r in all_scored])
        record["rollout/truncated_frac"] = _mean(
            [float(r.status == "truncated") for r in all_scored]
        )
        record.update(self.sampler.last_step_metrics)
        for reason, n in stats.dropped.items():
            record[f"rollout/dropped/{reason}"] = n
        for reason, n in stats.failed.items():
            record[f"rollout/failed/{reason}"] = n
        record["rollout/stale_dropped"] = stale
        record["perf/rollout_tokens_per_s"] = (
            gen_tokens / gen_time if gen_time > 0 else float("nan")
        )
        record["perf/gen_time"] = gen_time
        return record

    def _take(self) -> tuple[list[Group], dict[str, float]]:
        """This step's groups from the buffer (never older than ``max_staleness`` versions) and
        their staleness metrics."""
        version = self.policy.version
        n = self.config.rollout.prompts_per_step
        held = len(self.buffer)
        groups = self.buffer.take(n, min_version=version - self.config.rl.max_staleness)
        if groups is None:
            raise RLError(
                f"buffer: {held} groups held but fewer than {n} within rl.max_staleness="
                f"{self.config.rl.max_staleness} of policy version {version}; rounds must put "
                "fresh groups (is another writer using the buffer?)."
            )
        ages = [version - v for g in groups for r in g.rollouts for v in r.versions]
        lag = [version - r.min_version for g in groups for r in g.rollouts if r.versions]
        spans = [len(set(r.versions)) > 1 for g in groups for r in g.rollouts]
        return groups, {
            "rollout/groups_kept": len(groups),
            "rollout/off_policy_frac": _mean([float(a > 0) for a in lag]),
            "rollout/multi_version_frac": _mean([float(x) for x in spans]),
            "rollout/staleness_mean": _mean(ages),
            "rollout/staleness_max": max(ages, default=0),
        }

    def _advantages(
        self,
        rollouts: Sequence[Rollout],
        group_index: Sequence[int],
        values: list[torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-rollout advantages ``[R_i]`` and, with a critic, GAE returns ``[R_i]``."""
        inputs = AdvantageInputs(
            rewards=torch.tensor([float(r.reward) for r in rollouts], dtype=torch.float32),
            group_index=torch.tensor(list(group_index), dtype=torch.int64),
            response_mask=[torch.tensor(r.loss_mask, dtype=torch.float32) for r in rollouts],
            values=values,
        )
        if values is not None:
            adv, returns = self.advantage_fn.advantages_and_returns(inputs)
            return list(adv), list(returns)
        return list(self.advantage_fn(inputs)), None

    def _rl_batch(self, groups: Sequence[Group]) -> TrainBatch:
        alg = self.config.algorithm
        rollouts = [r for g in groups for r in g.rollouts]
        group_index = [gi for gi, g in enumerate(groups) for _ in g.rollouts]
        keep = self.config.rl.mask_older_than
        batch, order = self._pack(
            rollouts, mask_versions_below=self.policy.version - keep if keep is not None else None
        )
        rollouts, group_index = [rollouts[i] for i in order], [group_index[i] for i in order]
        values = None
        if self.critic is not None:
            batch.old_values = self.critic.compute_values(batch)
            values = gather_response(rollouts, batch.old_values)
        adv, returns = self._advantages(rollouts, group_index, values)
        batch.advantages = scatter_response(rollouts, adv) * batch.loss_mask
        if returns is not None:
            batch.returns = scatter_response(rollouts, returns) * batch.loss_mask
        batch.loss_weights = compute_loss_weights(
            batch.loss_mask,
            batch.cu_seqlens,
            mode=alg.aggregation,
            rollout_ids=[r.rollout_id for r in rollouts],
            constant=alg.aggregation_constant,
        )
        if self.reference is not None:
            batch.ref_logprobs = self.reference.compute_logprobs(batch).logprobs
        # One optimizer step per batch: the policy before the step is the current one, so old
        # log-probs equal the live ones and the loss uses those (detached); no extra forward.
        # Tokens sampled by an older policy (stale rounds, surplus groups the dynamic sampler
        # carries over) differ from it as the behaviour policy: `train/mismatch` measures that
        # against the rollout log-probs and `algorithm.loss.correction: tis` corrects it.
        if alg.recompute_old_logprobs:
            batch.old_logprobs = self.policy.compute_logprobs(batch).logprobs
        return batch

    def _train_on(self, groups: Sequence[Group]) -> dict[str, Any]:
        """Pack ``groups`` and take one optimizer step (torch only: runs in the trainer thread in
        async mode)."""
        t0 = time.perf_counter()
        batch = self._rl_batch(groups)
        m = self.policy.train_step(batch, self.loss_fn)
        critic_record: dict[str, Any] = {}
        if self.critic is not None:
            cm = self.critic.train_step(batch, self.value_loss_fn)
            critic_record = {
                "critic/loss": cm["loss"],
                "critic/grad_norm": cm["grad_norm"],
                "critic/value_mean": cm["value_mean"],
                "critic/value_error": cm["value_error"],
                "critic/clipfrac": cm["value_clipfrac"],
            }
        train_time = time.perf_counter() - t0
        record: dict[str, Any] = {
            "train/loss": m["loss"],
            "train/grad_norm": m["grad_norm"],
            "train/kl": m.get("kl", m.get("ppo_kl")),
            "train/entropy": m.get("entropy"),
        }
        for k in ("pg_clipfrac", "ppo_kl", "mismatch", "tis_weight_mean", "tis_clipfrac", "lr"):
            if k in m:
                record[f"train/{k}"] = m[k]
        record.update(critic_record)
        record["perf/train_time"] = train_time
        record["perf/train_tokens_per_s"] = batch.num_tokens / train_time
        return record

    async def _rl_step(self) -> dict[str, Any]:
        """One RL step; the rollouts come from this step's round (produced now, or ahead of time
        by the pipeline)."""
        t_step = time.perf_counter()
        step = self.state["rl_step"] + 1
        if self.policy.version != self._train_version(step):
            raise RLError(
                f"rl step {step}: policy version {self.policy.version}, expected "
                f"{self._train_version(step)} (one optimizer step per RL step)."
            )
        t0 = time.perf_counter()
        if self.pipeline is None:
            round_metrics = await self._produce(step)
        else:
            round_metrics = await self.pipeline.next_round(step)
        wait = time.perf_counter() - t0
        groups, staleness = self._take()
        record: dict[str, Any] = {"step": step, "phase": "rl", **round_metrics, **staleness}
        if self.pipeline is None:
            record.update(self._train_on(groups))
            record["perf/sync_time"] = await self._sync_weights()
        else:
            loop = asyncio.get_running_loop()
            record.update(await loop.run_in_executor(self._train_thread, self._train_on, groups))
            record["perf/rollout_wait"] = wait
        self.state["rl_step"] = step
        record["perf/step_time"] = time.perf_counter() - t_step
        return record

    async def _generate(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams,
        n_samples: int,
        seed_parts: tuple[Any, ...],
        stats: RolloutStats,
    ) -> list[Group]:
        """Sample ``n_samples`` rollouts per prompt on the current generator; ``generate_fn``
        failures are counted in ``stats``."""
        return await generate_groups(
            prompts,
            generator=self.generator,
            tokenizer=self.tokenizer,
            sampling=sampling,
            n_samples=n_samples,
            seed_parts=seed_parts,
            policy_version=self.policy.version,
            generate_fn=self.generate_fn,
            stats=stats,
            generate_fn_name=_component_name(
                "rollout.generate_fn", self.config.rollout.generate_fn
            ),
        )

    def _eval_due(self, step: int) -> bool:
        """Whether any eval set is evaluated after RL step ``step``."""
        return any(s.due(step, self.config.rl.steps) for s in self.eval_sets)

    async def evaluate(self, step: int) -> dict[str, float]:
        """Sample and score every eval set due at ``step``; the same prompts every time.

        Failed samples score 0. An eval set whose every sample failed stops the run with the
        failure report (at step 0 this is the first time the reward runs)."""
        out: dict[str, float] = {}
        for eval_set in self.eval_sets:
            if not eval_set.prompts or not eval_set.due(step, self.config.rl.steps):
                continue
            seed_parts: tuple[Any, ...] = (self.config.seed, "eval", step)
            if eval_set.name is not None:
                seed_parts = (self.config.seed, "eval", eval_set.name, step)
            stats = RolloutStats()
            groups = await self._generate(
                eval_set.prompts, eval_set.sampling, eval_set.n_samples, seed_parts, stats
            )
            await eval_set.scorer.score(groups, stats)
            where = f"eval at step {step}" + (f", set {eval_set.name!r}" if eval_set.name else "")
            stats.check(where)
            self._failure_log.log(where, stats.rollouts, stats.failed, stats.first)
            out.update(eval_set.metrics(groups))
        return out

    # ----------------------------------------------------------------------------- async mode
    def _start_pipeline(self) -> None:
        """Start generating rounds ahead of training (``rl.async_generation``); the policy
        trains in its own thread so the event loop keeps driving generation."""
        threads = self.config.threads
        self._train_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="rl-train",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )
        self.pipeline = RolloutPipeline(
            produce=self._produce,
            serve=self._serve,
            max_staleness=self.config.rl.max_staleness,
            first_version=self._first_version,
            last_step=self.config.rl.steps,
            next_step=self.state["rl_step"] + 1,
            released=self.policy.version,
            ready=self._ready_rounds,
        )
        self._ready_rounds = {}
        self.pipeline.start()

    def _weights_copy(self) -> Weights | None:
        """A CPU copy of the policy's weights for a later round, or ``None`` when none is needed
        (staleness 0: the next round starts while the trainer waits for it; or the generator
        already serves this version)."""
        if self.config.rl.max_staleness == 0:
            return None
        if self.generator.weight_version >= self.policy.version:
            return None
        if self.runtime is not None:  # ray: the policy ranks keep the copy
            return self.policy.keep_copy()
        return [(n, t.detach().to("cpu", copy=True)) for n, t in self.policy.named_weights()]

    # ----------------------------------------------------------------------------- main
    def run(self) -> list[dict[str, Any]]:
        """Run to the end (resuming if asked); returns the records written this run.

        While it runs (from the main thread), SIGTERM and SIGINT stop it cleanly: the current
        step finishes, a checkpoint is written and ``run`` returns early with
        :attr:`stopped_by` set to the signal, so ``--resume`` continues exactly where it
        stopped. A second signal exits the process at once (status ``128 + signal``) without a
        checkpoint; the newest complete checkpoint stays valid.
        """
        self.stopped_by: int | None = None
        """The signal that stopped the run before its last step (``None``: it ran to the end)."""
        self.stop_checkpoint: Path | None = None
        """The checkpoint written when a signal stopped the run."""
        with StopSignals() as self._stop_signals:
            return asyncio.run(self._run())

    async def _run(self) -> list[dict[str, Any]]:
        cfg = self.config
        metrics = MetricsLogger(
            self.run_dir,
            tensorboard=cfg.logging.tensorboard,
            progress=cfg.logging.progress,
            phase_steps={"sft": cfg.sft.steps, "rl": cfg.rl.steps},
            resume_lines=self._resume_lines,
        )
        records = []

        t_start = time.perf_counter()

        def emit(rec: dict[str, Any]) -> None:
            rec["perf/elapsed_s"] = time.perf_counter() - t_start  # wall time of this process
            records.append(rec)
            metrics.log(rec, global_step=self.state["sft_step"] + self.state["rl_step"])

        def due() -> bool:
            every = cfg.checkpoint.every
            return bool(every) and (self.state["sft_step"] + self.state["rl_step"]) % every == 0

        try:
            # Phase 1: SFT warm-up, with its own learning rate and optimizer.
            if self.state["sft_step"] < cfg.sft.steps:
                overrides = {"lr": cfg.sft.lr} if cfg.sft.lr is not None else {}
                self.policy = self._build_policy(self.init_model_path, temperature=1.0, **overrides)
                self._load_resumed_policy()
                while self.state["sft_step"] < cfg.sft.steps:
                    emit(self._sft_step())
                    # A checkpoint after the warm-up's last step is taken at the start of RL
                    # (below): resuming there needs the RL phase's policy and optimizer.
                    if self.state["sft_step"] == cfg.sft.steps:
                        break
                    saved = due()
                    if saved:
                        self._save(metrics)
                    if self._stop_signals.signum is not None:
                        await self._stop(metrics, saved=saved)
                        return records
                tmp = self.run_dir / ".tmp-sft_model"
                self.policy.save(tmp, with_optimizer=False)
                if self.sft_model_path.exists():
                    shutil.rmtree(self.sft_model_path)
                tmp.rename(self.sft_model_path)
                self.policy = None

            # Phase 2: RL. Policy, generator and reference start from the same weights (version 0).
            start = self._rl_start_path()
            temperature = cfg.rollout.sampling.temperature or 1.0
            self.policy = self._build_policy(start, temperature=temperature)
            gen_spec = self._with("generator", cfg.generator, model_path=start, seed=cfg.seed)
            if self.runtime is not None:
                self.generator = self.runtime.build_generator(gen_spec)
                await self.runtime.build_transport(self._transport_spec(start))
            else:
                self.generator = registry.build("generator", gen_spec, field="generator")
            if cfg.rl.partial_rollouts and not self.generator.supports_abort:
                raise ConfigError(
                    f"rl.partial_rollouts: generator {cfg.generator.type!r} cannot abort "
                    "requests; use a generator that can (hf, sglang) or turn partial_rollouts off."
                )
            if cfg.algorithm.use_reference:
                self.reference = self._build_policy(
                    start, role="reference", temperature=temperature
                )
            if cfg.critic is not None:
                self.critic = self._build_critic(start)
            self.transport, self.receiver = self._build_transports(start)
            self._load_resumed_policy()
            self._first_version = self.policy.version - self.state["rl_step"]
            if self.generator.weight_version != self.policy.version:
                await self._sync_weights()
            saved = False
            if not self.state["eval_at_0"]:
                rec = {"step": 0, "phase": "rl", **await self.evaluate(0)}
                self.state["eval_at_0"] = True
                emit(rec)
                saved = cfg.sft.steps > 0 and due()  # the warm-up's last step was due
                if saved:
                    self._save(metrics)
            if self._stop_signals.signum is not None and self.state["rl_step"] < cfg.rl.steps:
                await self._stop(metrics, saved=saved)
                return records
            if cfg.rl.async_generation:
                self._start_pipeline()
            elif self._ready_rounds:
                raise ConfigError(
                    "rl.async_generation: the checkpoint holds rollout rounds produced ahead by "
                    "an async run; resume it with rl.async_generation=true."
                )
            while self.state["rl_step"] < cfg.rl.steps:
                rec = await self._rl_step()
                step = self.state["rl_step"]
                eval_due = self._eval_due(step)
                if self.pipeline is not None and (eval_due or due()):
                    # Quiesce: the rounds before this version are done, the generator is idle.
                    await self.pipeline.drain(self.policy.version)
                    if eval_due:
                        rec["perf/sync_time"] = await self._sync_weights()
                if eval_due:
                    rec.update(await self.evaluate(step))
                emit(rec)
                saved = due()
                if saved:
                    self._save(metrics)
                if self._stop_signals.signum is not None and step < cfg.rl.steps:
                    await self._stop(metrics, saved=saved)
                    return records
                if self.pipeline is not None:
                    await self.pipeline.release(self.policy.version, self._weights_copy())
            # The final model first: if writing it fails, the weights are already on disk
            # (HFPolicy.save writes a plain safetensors file before converting).
            self.policy.save(self.run_dir / "final_model", with_optimizer=False)
            self._save(metrics)
        finally:
            if self.pipeline is not None:
                await self.pipeline.close()
            if self._train_thread is not None:
                self._train_thread.shutdown(wait=True)
            metrics.close()
            if self.generator is not None:
                await self.generator.close()
            if self.transport is not None:
                self.transport.close()
            # (the ray runtime closes its own receiver)
            if self.receiver not in (None, self.transport) and self.runtime is None:
                self.receiver.close()
            if self.runtime is not None:
                self.runtime.shutdown()
        return records

    # ----------------------------------------------------------------------------- stopping
    async def _stop(self, metrics: MetricsLogger, *, saved: bool) -> None:
        """Stop early on a signal: quiesce the rollout pipeline (async mode) and write a
        checkpoint of the step just finished unless ``saved`` (the schedule already wrote it)."""
        if self.pipeline is not None:
            await self.pipeline.drain(self.policy.version)
        if not saved:
            self._save(metrics)
        self.stopped_by = self._stop_signals.signum
        self.stop_checkpoint = latest_checkpoint(self.run_dir)
