"""Defaults chosen for the run where the recipe leaves the choice open (issue #36).

Three settings pay a start-up cost for a per-step gain, so the fastest choice depends on the
run. Where the recipe does not set them, the trainer chooses from the run's configuration and
the costs measured in docs/performance.md (2 CPU cores, the demo and small settings); a value
the recipe (or ``--set``) gives always wins::

    choices = auto_choices(cfg)           # what was chosen and why (rl-train check prints it)
    generator_process(cfg)                # runtime.generator_process, resolved
    policy_compile(cfg, phase="rl")       # policy.compile_model, resolved (None: not an option)

- ``runtime.generator_process`` (``None`` = auto): the generator in a process of its own takes
  its Python off the trainer's GIL. Chosen for asynchronous runs on the local runtime with the
  ``hf`` generator, the in-process weight transport, the built-in rollout (no
  ``rollout.generate_fn``), no LoRA adapters and ``threads >= 2``
  (each process gets a core) that are long enough to repay the child's start-up
  (:data:`GENERATOR_PROCESS_MIN_STEPS`).
- ``policy.compile_model`` (auto when the recipe's ``policy`` options do not name it): only
  for an ``hf`` policy on the CPU whose RL phase is long enough to repay the compile
  (:func:`compile_min_steps`); the SFT warm-up and the reference model stay eager.
- ``runtime.freeze_gc`` (``None`` = auto): the built objects frozen out of the garbage
  collector's passes for the phase that runs the run's steps, when it has at least
  :data:`FREEZE_GC_MIN_STEPS` of them (:func:`freeze_gc`).
- ``TORCHINDUCTOR_CACHE_DIR``: when the policy compiles and the environment does not set it,
  inductor's cache goes to ``~/.cache/rl-train/inductor`` (it outlives ``/tmp`` cleaning and
  reboots: a machine pays the ~30 s cold compile once, every later run the warm one).
"""

from __future__ import annotations

import math
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rl_trainer.config import TrainerConfig

__all__ = [
    "COMPILE_COST_S",
    "COMPILE_GAIN_S",
    "FREEZE_GC_MIN_STEPS",
    "GENERATOR_PROCESS_COST_S",
    "GENERATOR_PROCESS_GAIN_S",
    "GENERATOR_PROCESS_MIN_STEPS",
    "INDUCTOR_CACHE_ENV",
    "AutoChoice",
    "auto_choices",
    "compile_min_steps",
    "default_inductor_cache",
    "freeze_gc",
    "generator_process",
    "policy_compile",
    "thread_split",
    "use_inductor_cache",
]

GENERATOR_PROCESS_COST_S = 5.0
"""Start-up of the generator process: the child's imports and model load, 3-5 s on 2 cores
(docs/performance.md §10); the upper end."""
GENERATOR_PROCESS_GAIN_S = 0.014
"""Seconds saved per RL step by the generator process in async runs: demo 0.153 -> 0.138 s per
step, small 0.063 -> 0.049 (docs/performance.md §6, 100 steps x 3 seeds on a quiet machine,
both compiled); the smaller of the two."""
GENERATOR_PROCESS_MIN_STEPS = math.ceil(GENERATOR_PROCESS_COST_S / GENERATOR_PROCESS_GAIN_S)
"""RL steps from which the generator process pays back: ``ceil(5 s / 0.014 s) = 358``."""

COMPILE_COST_S = 12.0
"""The policy's start-up compile with inductor's on-disk cache warm: 7.5-11.6 s at one thread,
~8-12 s per run at two (demo model, docs/performance.md §7); the upper end. The first compile on
a machine costs ~30 s more once; the persistent cache (:func:`use_inductor_cache`) keeps it.

Since the compile no longer traces its first graph twice (``rl_hf._compile.compiled_call``) it
measures lower: ~3.3 s of compiling plus ~1.5 s of dynamo's imports (small e2e model, one
thread, cache warm, load 1.5-2.5). The constant stays at 12 s on purpose: with the lower cost
the demo setting (400 steps) would compile, and at 200 demo steps compiling gained nothing per
step (0.164 vs 0.155 s, load 2.2-2.7), so that start-up would not be repaid."""
COMPILE_GAIN_S = {1: 0.02, 2: 0.005}
"""Seconds saved per RL step by the compiled policy, by the trainer's torch threads (``2``: two
or more). One thread: the train phase 0.145 -> 0.125 s (demo, generator process 1 + 1,
docs/performance.md §10; §7's train step 169-176 -> 136-148 ms). Two: small sync 0.074 -> 0.068
and async 0.068 -> 0.063 s per step, demo none (0.172 vs 0.173; §6)."""


FREEZE_GC_MIN_STEPS = 50
"""Steps from which ``runtime.freeze_gc`` is on by default. The freeze costs one full collection
(its ``gc.collect()``: ~0.1-0.3 s in a trainer process, ~1 s in a long test session's heap of
~1M objects) and saves the full collections the loop would run, ~one per 10 demo steps at
~0.1-0.26 s each (docs/performance.md section 15): it pays from a few tens of steps. A short
run (every test's) is left as Python sets it."""


def freeze_gc(cfg: TrainerConfig) -> bool:
    """``runtime.freeze_gc`` resolved: the recipe's value, else on when the phase that runs the
    run's steps (the RL phase; the SFT phase with ``mode: sft``) has at least
    :data:`FREEZE_GC_MIN_STEPS` of them."""
    if cfg.runtime.freeze_gc is not None:
        return bool(cfg.runtime.freeze_gc)
    steps = cfg.sft.steps if cfg.mode == "sft" else cfg.rl.steps
    return steps >= FREEZE_GC_MIN_STEPS


def compile_min_steps(trainer_threads: int) -> int:
    """RL steps from which compiling the policy pays back at ``trainer_threads`` torch threads:
    ``ceil(COMPILE_COST_S / COMPILE_GAIN_S)``: ``ceil(12 / 0.02) = 600`` at one thread,
    ``ceil(12 / 0.005) = 2400`` at more. Measured on the tiny demo model: a larger model gains
    more per step (the compiled layers' share of a step grows), so it errs on the side of eager;
    ``policy.compile_model: true`` compiles any run."""
    gain = COMPILE_GAIN_S[1 if trainer_threads <= 1 else 2]
    return math.ceil(COMPILE_COST_S / gain)


INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
"""The environment variable naming inductor's on-disk cache."""


@dataclass(frozen=True, slots=True)
class AutoChoice:
    """One setting the trainer chose because the recipe left it open."""

    field: str
    """The setting (``runtime.generator_process``, ``policy.compile_model``, or the environment
    variable ``TORCHINDUCTOR_CACHE_DIR``)."""
    value: Any
    """What was chosen."""
    reason: str
    """Why, with the measured numbers it rests on."""

    def line(self) -> str:
        """``field: value (reason)``."""
        return f"{self.field}: {self.value} ({self.reason})"


def _generator_process_auto(cfg: TrainerConfig) -> AutoChoice | None:
    """The auto choice of ``runtime.generator_process``; ``None`` when the recipe set it or the
    run has no generator (``mode: sft``)."""
    if cfg.runtime.generator_process is not None or cfg.mode != "rl":
        return None
    field = "runtime.generator_process"
    why_not = None
    if cfg.runtime.type != "local":
        why_not = "the ray runtime runs generators as actors already"
    elif not cfg.rl.async_generation:
        why_not = (
            "synchronous run: generation and training take turns, nothing overlaps (demo sync "
            "2.35x TRL with it vs 2.61x without, docs/performance.md section 6)"
        )
    elif cfg.threads < 2:
        why_not = "threads: 1 gives the run one core; a generator process would take a second"
    elif cfg.generator.type != "hf":
        why_not = f"generator {cfg.generator.type!r}: measured and tested only with 'hf'"
    elif cfg.weight_transport.type != "inprocess":
        why_not = f"weight_transport {cfg.weight_transport.type!r}: measured only with 'inprocess'"
    elif cfg.rollout.generate_fn is not None:
        why_not = "a custom rollout.generate_fn: measured only with the built-in rollout"
    elif cfg.policy.options.get("lora") is not None:
        why_not = "a LoRA policy: the generator process takes merged weights, not adapters"
    elif cfg.rl.steps < GENERATOR_PROCESS_MIN_STEPS:
        why_not = (
            f"rl.steps {cfg.rl.steps} < {GENERATOR_PROCESS_MIN_STEPS}: its ~"
            f"{GENERATOR_PROCESS_COST_S:g} s start-up is not repaid at "
            f"{GENERATOR_PROCESS_GAIN_S:g} s per step"
        )
    if why_not is not None:
        return AutoChoice(field=field, value=False, reason=why_not)
    return AutoChoice(
        field=field,
        value=True,
        reason=(
            f"async local run of {cfg.rl.steps} steps >= {GENERATOR_PROCESS_MIN_STEPS}: the "
            "generator's Python leaves the trainer's GIL, one core each (demo async 2.94x -> "
            "3.26x TRL, small 1.90x -> 2.63x, docs/performance.md section 6)"
        ),
    )


def generator_process(cfg: TrainerConfig) -> bool:
    """``runtime.generator_process`` as the run uses it: the recipe's value, else the auto
    choice (:mod:`rl_trainer.defaults`)."""
    if cfg.runtime.generator_process is not None:
        return cfg.runtime.generator_process
    auto = _generator_process_auto(cfg)
    return bool(auto is not None and auto.value)


def _trainer_threads(cfg: TrainerConfig) -> int:
    """The trainer's torch threads (:func:`thread_split`)."""
    return thread_split(cfg)[0]


def _compile_auto(cfg: TrainerConfig) -> AutoChoice | None:
    """The auto choice of ``policy.compile_model`` for the RL phase; ``None`` when the recipe
    set it, the policy has no such option, or the run has no RL phase."""
    from rl_trainer.build import config_fields

    if cfg.mode != "rl" or "compile_model" in cfg.policy.options:
        return None
    if "compile_model" not in config_fields("policy", cfg.policy):
        return None
    field = "policy.compile_model"
    device = str(cfg.policy.options.get("device", "cpu"))
    if not device.startswith("cpu"):
        return AutoChoice(
            field=field, value=False, reason=f"device {device!r}: the costs are measured on CPU"
        )
    threads = _trainer_threads(cfg)
    need = compile_min_steps(threads)
    gain = COMPILE_GAIN_S[1 if threads <= 1 else 2]
    arithmetic = (
        f"~{COMPILE_COST_S:g} s compile / {gain:g} s saved per step at {threads} trainer thread(s)"
    )
    if cfg.rl.steps < need:
        return AutoChoice(
            field=field, value=False, reason=f"rl.steps {cfg.rl.steps} < {need} = {arithmetic}"
        )
    return AutoChoice(
        field=field, value=True, reason=f"rl.steps {cfg.rl.steps} >= {need} = {arithmetic}"
    )


def policy_compile(cfg: TrainerConfig, *, phase: Literal["rl", "sft"] = "rl") -> bool | None:
    """``compile_model`` of the policy built for ``phase``: the recipe's value, else the auto
    choice for the RL phase; the SFT warm-up stays eager unless the recipe compiles. ``None``:
    leave the policy's options alone (the recipe set it, or the policy has no such option)."""
    if "compile_model" in cfg.policy.options:
        return None
    if phase != "rl":
        return None
    auto = _compile_auto(cfg)
    return None if auto is None else bool(auto.value)


def _compiles(cfg: TrainerConfig) -> bool:
    """Whether the RL phase's policy compiles (the recipe's value or the auto choice)."""
    explicit = cfg.policy.options.get("compile_model")
    if explicit is not None:
        return bool(explicit)
    return bool(policy_compile(cfg))


def default_inductor_cache() -> Path:
    """``$XDG_CACHE_HOME/rl-train/inductor`` (``~/.cache/rl-train/inductor`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "rl-train" / "inductor"


def _inductor_auto(cfg: TrainerConfig, environ: MutableMapping[str, str]) -> AutoChoice | None:
    """The inductor cache choice; ``None`` when nothing compiles or the environment sets it."""
    if not _compiles(cfg) or environ.get(INDUCTOR_CACHE_ENV):
        return None
    return AutoChoice(
        field=INDUCTOR_CACHE_ENV,
        value=str(default_inductor_cache()),
        reason="the policy compiles: a persistent cache pays the cold compile once per machine",
    )


def use_inductor_cache(
    cfg: TrainerConfig, environ: MutableMapping[str, str] | None = None
) -> str | None:
    """Point inductor's cache at :func:`default_inductor_cache` when the run's policy compiles
    and ``environ`` (default ``os.environ``) does not set ``TORCHINDUCTOR_CACHE_DIR``; returns
    the directory set, or ``None``. A directory that cannot be created is left to inductor's
    default (``/tmp``)."""
    env = os.environ if environ is None else environ
    auto = _inductor_auto(cfg, env)
    if auto is None:
        return None
    try:
        Path(auto.value).mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    env[INDUCTOR_CACHE_ENV] = auto.value
    return str(auto.value)


def auto_choices(
    cfg: TrainerConfig, environ: MutableMapping[str, str] | None = None
) -> list[AutoChoice]:
    """Every setting chosen for this run because the recipe left it open, with the reason
    (settings the recipe gives are not listed)."""
    env = os.environ if environ is None else environ
    found = [_generator_process_auto(cfg), _compile_auto(cfg), _inductor_auto(cfg, env)]
    return [c for c in found if c is not None]


def thread_split(cfg: TrainerConfig) -> tuple[int, int | None]:
    """``(trainer, generator)`` torch threads of a run on the local runtime, from ``threads``
    (the cores it may use); ``None``: the generator keeps its own setting.

    - synchronous, one thread, or the ``ray`` runtime: ``(threads, None)``: nothing runs
      beside the trainer (on Ray each actor has its own CPUs);
    - ``rl.async_generation``, generator in this process: ``(threads, g)`` with
      ``g = threads // 2``: the generating thread runs beside the trainer's threads, and
      ``threads + threads`` oversubscribed the cores (demo, 2 threads: -15..20% per step);
    - ``rl.async_generation`` with the generator process (``runtime.generator_process``, as
      :func:`rl_trainer.defaults.generator_process` resolves it): ``(threads - g, g)``: each
      process on cores of its own (demo and small, 2 threads: 1 + 1 beat 2 + 1 by 10-25%).

    docs/performance.md has the measurements.
    """
    if cfg.runtime.type != "local" or not cfg.rl.async_generation or cfg.threads < 2:
        return cfg.threads, None
    g = cfg.threads // 2
    return (cfg.threads - g if generator_process(cfg) else cfg.threads), g
