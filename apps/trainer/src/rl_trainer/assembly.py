"""Component assembly: every piece of a run built from its :class:`TrainerConfig`.

:func:`assemble` builds what the driver keeps for the whole run (data, buffer, rewards,
filters, sampler, algorithm) and validates the backends' options; the models are built when
their phase starts (:func:`build_policy`, :func:`build_critic`, :func:`build_generator`,
:func:`build_transports`), locally or as Ray actors when a runtime is given::

    parts = assemble(cfg)                       # Components: no model weights yet
    policy = build_policy(cfg, runtime, path)   # per phase (SFT, RL), and the reference
    sender, receiver = build_transports(cfg, runtime, path)

A new component (a teacher, LoRA adapters) gets a field in :class:`Components` or a builder
here; the phases only call the builders.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rl_buffer.filters import GuardedFilter
from rl_buffer.sampler import DynamicSampler
from rl_buffer.scoring import Scorer
from rl_core import registry
from rl_core.algorithms import ADVANTAGE_ESTIMATORS, PolicyLoss, ValueLoss
from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import ConfigError
from rl_core.interfaces import GenerateFn, GroupFilter, GroupRewardFn, RewardFn
from rl_trainer.build import (
    build_callable,
    build_task,
    component_name,
    config_fields,
    data_specs,
    init_model_path,
    transport_spec,
    validate_backends,
    with_defaults,
)
from rl_trainer.config import TrainerConfig
from rl_trainer.defaults import (
    auto_choices,
    freeze_gc,
    generator_process,
    policy_compile,
    thread_split,
    use_inductor_cache,
)
from rl_trainer.ops.evaluation import EvalSet, build_eval_sets

__all__ = [
    "Components",
    "assemble",
    "build_critic",
    "build_generator",
    "build_generator_beside",
    "build_policy",
    "build_transports",
    "free_port",
    "report_auto_choices",
]

T = TypeVar("T")


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(kw_only=True, slots=True)
class Components:
    """What the driver keeps for the whole run (built by :func:`assemble`)."""

    init_model_path: str
    """The initial model directory (``model.path``, or the tiny model built under the run)."""
    tokenizer: Any
    """The model's tokenizer."""
    buffer: Any
    """The rollout buffer (:class:`~rl_core.interfaces.Buffer`)."""
    train_data: Any
    """The training prompts (:class:`~rl_core.interfaces.DataSource`)."""
    scorer: Scorer
    """Scores training rollouts (reward, optional group reward)."""
    eval_sets: list[EvalSet]
    """The eval sets (``eval``), each with its prompts, sampling and scorer."""
    filters: list[GuardedFilter]
    """The group filters (``rollout.filters``), guarded so user errors are counted."""
    sampler: DynamicSampler
    """Over-samples rounds until ``rollout.prompts_per_step`` groups pass the filters."""
    generate_fn: Any
    """The custom rollout function (``rollout.generate_fn``), or ``None``."""
    advantage_fn: Any
    """The advantage estimator (``algorithm.advantage``)."""
    loss_config: PolicyLoss.Config
    """The policy loss options (``algorithm.loss``)."""
    loss_fn: PolicyLoss
    """The policy loss."""
    value_loss_fn: ValueLoss | None
    """The critic's loss (``None`` without a critic)."""


def assemble(cfg: TrainerConfig) -> Components:
    """Build the run's driver-side components from ``cfg`` and validate the backends' options
    (policy, generator, weight transport; and the ``ray`` runtime's settings), so a mistake
    fails before any model is built."""
    model_path = init_model_path(cfg)
    report_auto_choices(cfg)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    buffer = registry.build("buffer", cfg.buffer, field="buffer")
    validate_backends(cfg, model_path)
    if cfg.teacher is not None:
        from rl_trainer.step.teacher import check_teacher_tokenizer

        check_teacher_tokenizer(cfg.teacher, tokenizer)
    if cfg.runtime.type == "ray":
        from rl_trainer.ray import check_ray_config

        check_ray_config(cfg, transport_spec(cfg, model_path))
    train_data, scorer, eval_sets = _data_and_rewards(cfg, tokenizer)
    _check_model_limits(cfg, model_path, train_data, eval_sets)
    filters: list[GuardedFilter] = []
    for i, spec in enumerate(cfg.rollout.filters):
        where = f"rollout.filters[{i}]"
        fn = build_callable("filter", spec, GroupFilter, field=where)
        filters.append(GuardedFilter(fn, component_name(where, spec)))
    sampler = DynamicSampler(
        DynamicSampler.Config(
            batch_size=cfg.rollout.prompts_per_step,
            over_sampling_factor=cfg.rollout.over_sampling_factor,
            max_rounds=cfg.rollout.max_rounds,
            surplus=cfg.rollout.surplus_groups,
        ),
        filters,
    )
    generate_fn = None
    if cfg.rollout.generate_fn is not None:
        generate_fn = build_callable(
            "generate_fn", cfg.rollout.generate_fn, GenerateFn, field="rollout.generate_fn"
        )
    if cfg.rl.partial_rollouts and not getattr(buffer, "supports_partial", False):
        raise ConfigError(
            f"rl.partial_rollouts: buffer type {cfg.buffer.type!r} has no partial store "
            "(put_partial/take_partial); use buffer.type: fifo or turn partial_rollouts off."
        )
    advantage_fn, loss_config, value_loss_fn = _algorithm(cfg)
    return Components(
        init_model_path=model_path,
        tokenizer=tokenizer,
        buffer=buffer,
        train_data=train_data,
        scorer=scorer,
        eval_sets=eval_sets,
        filters=filters,
        sampler=sampler,
        generate_fn=generate_fn,
        advantage_fn=advantage_fn,
        loss_config=loss_config,
        loss_fn=PolicyLoss(loss_config),
        value_loss_fn=value_loss_fn,
    )


def report_auto_choices(cfg: TrainerConfig, file: Any = None) -> None:
    """Print the settings the run turns on because the recipe left them open
    (:func:`rl_trainer.defaults.auto_choices`: the generator process, compilation, the inductor
    cache) as the run's first line on stderr (or ``file``); a choice that keeps the plain
    behaviour (off) is not announced on every run (``rl-train check`` lists every choice)."""
    choices = [c for c in auto_choices(cfg) if c.value not in (False, None)]
    if choices:
        lines = "; ".join(c.line() for c in choices)
        print(f"rl-train: chosen for this run: {lines}", file=file or sys.stderr, flush=True)


def _data_and_rewards(cfg: TrainerConfig, tokenizer: Any) -> tuple[Any, Scorer, list[EvalSet]]:
    """The train prompts, the scorer and the eval sets. A built-in task writes its splits under
    the run and scores responses unless ``reward`` is set; signatures are checked now, so a
    mismatch says how the trainer calls the component."""
    task = build_task(cfg)
    train_spec, eval_spec = data_specs(cfg, task, data_dir=cfg.run_path / "data")
    train_data = registry.build("data_source", train_spec, field="data.train", tokenizer=tokenizer)
    if cfg.mode == "sft":  # no rewards, no sampled eval: the SFT phase scores eval/loss itself
        return train_data, Scorer(_no_reward, tokenizer, reward_name="none"), []
    eval_data = (
        registry.build("data_source", eval_spec, field="data.eval", tokenizer=tokenizer)
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
    registry.check_callable(reward_fn, RewardFn, field=reward_field, ref=reward_spec.type)
    reward_name = component_name(reward_field, reward_spec)
    group_reward_fn = None
    if cfg.group_reward is not None:
        group_reward_fn = build_callable(
            "reward", cfg.group_reward, GroupRewardFn, field="group_reward"
        )
    scorer = Scorer(
        reward_fn,
        tokenizer,
        group_reward_fn=group_reward_fn,
        reward_name=reward_name,
        group_reward_name=component_name("group_reward", cfg.group_reward),
    )
    eval_sets = build_eval_sets(
        cfg.eval,
        default_source=eval_data,
        default_reward=reward_fn,
        default_reward_name=reward_name,
        train_sampling=cfg.rollout.sampling,
        tokenizer=tokenizer,
    )
    for s in [scorer, *(e.scorer for e in eval_sets)]:
        s.set_timeouts(cfg.rollout.reward_timeout_s, cfg.rollout.reward_round_timeout_s)
    return train_data, scorer, eval_sets


def _check_model_limits(
    cfg: TrainerConfig, model_path: str, train_data: Any, eval_sets: list[EvalSet]
) -> None:
    """What the model cannot honour, refused before it is built (:mod:`rl_trainer.load_checks`):
    routing replay on a dense model; prompts that with their response budget pass its context."""
    from rl_trainer.load_checks import check_context, check_routing, read_model_config

    model_cfg = read_model_config(model_path)
    check_routing(cfg.rollout.routing_replay, model_cfg, model_path)
    if cfg.mode == "sft":
        return
    budget = "rollout.sampling.max_new_tokens"
    sets: list[tuple[str, Any, Any, int, str]] = [
        ("data.train", train_data, None, cfg.rollout.sampling.max_new_tokens, budget)
    ]
    for e in eval_sets:
        name = "eval" if e.name is None else f"eval.datasets[{e.name!r}]"
        field = "eval.sampling.max_new_tokens" if e.name is None else f"{name}.sampling"
        sets.append((name, None, e.prompts, e.sampling.max_new_tokens, field))
    check_context(model_cfg, model_path, sets)


def _no_reward(prompt: Any, response: str, **_: Any) -> float:
    """The reward of a ``mode: sft`` run, which samples nothing (never called)."""
    return 0.0


def _algorithm(cfg: TrainerConfig) -> tuple[Any, PolicyLoss.Config, ValueLoss | None]:
    """The advantage estimator, the policy loss options and the critic's loss."""
    alg = cfg.algorithm
    if alg.advantage in ADVANTAGE_ESTIMATORS:
        est_cls = ADVANTAGE_ESTIMATORS[alg.advantage]
        advantage_fn = est_cls(
            from_dict(est_cls.Config, alg.advantage_options, path="algorithm.advantage_options")
        )
    else:
        advantage_fn = registry.build(
            "advantage",
            ComponentSpec(type=alg.advantage, options=alg.advantage_options),
            field="algorithm.advantage",
        )
    value_loss_fn = (
        ValueLoss(from_dict(ValueLoss.Config, alg.value_loss, path="algorithm.value_loss"))
        if cfg.critic is not None
        else None
    )
    loss_config = from_dict(PolicyLoss.Config, alg.loss, path="algorithm.loss")
    if loss_config.kl_coef > 0 and not alg.use_reference:
        raise ConfigError("algorithm.loss.kl_coef > 0 needs algorithm.use_reference: true.")
    return advantage_fn, loss_config, value_loss_fn


# ----------------------------------------------------------------------------- models
def build_policy(
    cfg: TrainerConfig,
    runtime: Any,
    model_path: str,
    *,
    role: str = "policy",
    phase: Literal["rl", "sft"] = "rl",
    **overrides: Any,
) -> Any:
    """The policy (or, with ``role="reference"``, the reference model) loaded from
    ``model_path``; ``overrides`` replace options (the SFT phase's ``lr``, the sampling
    temperature). On the ``ray`` runtime it lives in the policy ranks. The RL phase's policy
    compiles when the recipe leaves ``compile_model`` open and the run is long enough
    (:func:`rl_trainer.defaults.policy_compile`); a compiling policy gets inductor's persistent
    cache (:func:`rl_trainer.defaults.use_inductor_cache`)."""
    spec = with_defaults("policy", cfg.policy, model_path=model_path, seed=cfg.seed)
    auto: dict[str, Any] = {}
    if role == "policy":
        compile_model = policy_compile(cfg, phase=phase)
        if compile_model is not None:
            auto["compile_model"] = compile_model
    spec = ComponentSpec(
        type=spec.type, options={**auto, **spec.options, "model_path": model_path, **overrides}
    )
    if spec.options.get("compile_model") and runtime is None:
        use_inductor_cache(cfg)
    if runtime is not None:
        return runtime.build_policy(spec, role=role)
    return registry.build("policy", spec, field="policy")


def build_critic(cfg: TrainerConfig, runtime: Any, model_path: str) -> Any:
    """The critic (``critic``) loaded from ``model_path``."""
    spec = cfg.critic
    spec = ComponentSpec(
        type=spec.type, options={"seed": cfg.seed, **spec.options, "model_path": model_path}
    )
    if runtime is not None:
        return runtime.build_critic(spec)
    return registry.build("critic", spec, field="critic")


def _boots_in_child(cfg: TrainerConfig, runtime: Any) -> bool:
    """Whether the generator is a :class:`~rl_trainer.generator_process.ProcessGenerator`
    (``runtime.generator_process`` on the local runtime)."""
    return runtime is None and generator_process(cfg)


async def build_generator_beside(
    cfg: TrainerConfig, runtime: Any, model_path: str, build: Callable[[], T]
) -> tuple[T, Any]:
    """``build()`` (the RL phase's policy) and :func:`build_generator`'s generator.

    A generator process is spawned first and boots (imports, model load: seconds) in its own
    process while ``build()`` runs in this one, so the two start-ups overlap instead of adding
    up. Any other generator is built after ``build()``, in this process. If ``build()``
    raises, a started generator is closed before its error propagates.
    """
    if not _boots_in_child(cfg, runtime):
        made = build()
        return made, await build_generator(cfg, runtime, model_path)
    booting = asyncio.ensure_future(build_generator(cfg, runtime, model_path))
    await asyncio.sleep(0)  # the task spawns the child, then waits for it in a worker thread
    try:
        made = build()
    except BaseException:
        try:
            generator = await booting
        except BaseException:  # build()'s error is the one to report
            pass
        else:
            await generator.close()
        raise
    return made, await booting


async def build_generator(cfg: TrainerConfig, runtime: Any, model_path: str) -> Any:
    """The generator serving ``model_path`` (on the ``ray`` runtime: the engine pool, and the
    weight transport's receivers in it). It must be able to abort requests for partial
    rollouts."""
    gen_threads = thread_split(cfg)[1]
    spec = with_defaults(
        "generator",
        cfg.generator,
        model_path=model_path,
        seed=cfg.seed,
        **({} if gen_threads is None else {"threads": gen_threads}),
    )
    if runtime is not None:
        generator = runtime.build_generator(spec)
        await runtime.build_transport(transport_spec(cfg, model_path))
    elif _boots_in_child(cfg, runtime):
        from rl_trainer.generator_process import ProcessGenerator

        threads = int(spec.options.get("threads") or cfg.threads)  # the child's torch threads
        # Spawned now; it boots in its own process while this one waits in a worker thread
        # (build_generator_beside builds the policy meanwhile).
        generator = ProcessGenerator(spec, threads=threads, wait=False, freeze_gc=freeze_gc(cfg))
        try:
            await asyncio.to_thread(generator.wait_ready)
        except BaseException:
            await generator.close()
            raise
    else:
        generator = registry.build("generator", spec, field="generator")
    if cfg.rl.partial_rollouts and not generator.supports_abort:
        raise ConfigError(
            f"rl.partial_rollouts: generator {cfg.generator.type!r} cannot abort "
            "requests; use a generator that can (hf, sglang) or turn partial_rollouts off."
        )
    return generator


def build_transports(cfg: TrainerConfig, runtime: Any, start_path: str) -> tuple[Any, Any]:
    """The sender side and the generator's receiver side of the weight transport.

    File and in-process transports serve both sides with one object. A collective transport
    (its ``Config`` has ``rank``/``world_size``) gets a sender at rank 0 and, in the local
    runtime, a receiver at rank 1 in the generator's thread, on a free loopback port unless
    the recipe names one. On the ``ray`` runtime the sender lives on policy rank 0 and the
    receivers in the engines (or in the driver, for a driver generator).
    """
    spec = transport_spec(cfg, start_path)
    fields = config_fields("weight_transport", spec)
    if runtime is not None:
        return None, runtime.receiver
    if not {"rank", "world_size"} <= fields:
        sender = registry.build("weight_transport", spec, field="weight_transport")
        return sender, sender
    opts = dict(spec.options)
    if "port" in fields and "port" not in opts:
        opts["port"] = free_port()
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
