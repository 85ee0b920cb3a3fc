"""Defaults chosen for the run where the recipe leaves them open (:mod:`rl_trainer.defaults`,
issue #36): the generator process for long async local runs, the compiled policy for RL phases
long enough to repay the compile, inductor's persistent cache; the recipe's value always wins; a
short run does not compile. And the allocator trim once per RL step leaves results unchanged."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from rl_core.config import ComponentSpec
from rl_trainer.assembly import build_policy, report_auto_choices
from rl_trainer.cli import recipe_path
from rl_trainer.config import load_trainer_config
from rl_trainer.defaults import (
    GENERATOR_PROCESS_MIN_STEPS,
    INDUCTOR_CACHE_ENV,
    auto_choices,
    compile_min_steps,
    generator_process,
    policy_compile,
    thread_split,
    use_inductor_cache,
)
from rl_trainer.loop import Trainer


def _cfg(*overrides: str) -> Any:
    return load_trainer_config(recipe_path("demo"), list(overrides))


ASYNC_LONG = ("rl.async_generation=true", "threads=2", "rl.steps=1000")


def test_the_thresholds_follow_the_measured_costs() -> None:
    """ceil(cost / gain per step): 5 s / 0.014 s for the generator process, 12 s / 0.02 s (one
    trainer thread) and 12 s / 0.005 s (more) for the compile."""
    assert GENERATOR_PROCESS_MIN_STEPS == 358
    assert compile_min_steps(1) == 600
    assert compile_min_steps(2) == compile_min_steps(8) == 2400


def test_generator_process_is_chosen_for_long_async_local_hf_runs() -> None:
    cfg = _cfg(*ASYNC_LONG)
    assert generator_process(cfg) is True
    assert thread_split(cfg) == (1, 1)  # one core each, as measured
    (choice,) = [c for c in auto_choices(cfg) if c.field == "runtime.generator_process"]
    assert choice.value is True and "GIL" in choice.reason


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (("rl.async_generation=false",), "synchronous"),
        (("threads=1",), "one core"),
        (("rl.steps=100",), "rl.steps 100 < 358"),
        (("policy.lora.rank=4",), "LoRA"),
        (("weight_transport.type=disk_full",), "weight_transport"),
        (("rollout.generate_fn.type=calculator",), "generate_fn"),
    ],
)
def test_each_rule_keeps_the_generator_in_process(extra: tuple[str, ...], why: str) -> None:
    cfg = _cfg(*ASYNC_LONG, *extra)
    assert generator_process(cfg) is False
    (choice,) = [c for c in auto_choices(cfg) if c.field == "runtime.generator_process"]
    assert choice.value is False and why in choice.reason


def test_the_recipes_generator_process_wins() -> None:
    off = _cfg(*ASYNC_LONG, "runtime.generator_process=false")
    assert generator_process(off) is False
    assert thread_split(off) == (2, 1)
    assert "runtime.generator_process" not in [c.field for c in auto_choices(off)]
    on = _cfg(
        "rl.async_generation=true", "threads=2", "rl.steps=3", "runtime.generator_process=true"
    )
    assert generator_process(on) is True


def test_a_short_run_does_not_compile() -> None:
    """The demo recipe (400 RL steps, one thread) and a short run stay eager; the SFT warm-up and the
    reference never compile on their own."""
    for cfg in (_cfg(), _cfg("rl.steps=5")):
        assert policy_compile(cfg) is False
    long = _cfg("rl.steps=600")
    assert policy_compile(long, phase="sft") is None


def test_compile_is_chosen_when_the_run_repays_it() -> None:
    # One trainer thread (threads: 1): 600 steps repay it, 599 do not.
    assert policy_compile(_cfg("rl.steps=600")) is True
    assert policy_compile(_cfg("rl.steps=599")) is False
    # Two trainer threads (sync, threads: 2): the gain is 4x smaller, so 2400 steps.
    assert policy_compile(_cfg("threads=2", "rl.steps=600")) is False
    assert policy_compile(_cfg("threads=2", "rl.steps=2400")) is True
    # Async with the generator process: the trainer keeps one thread.
    assert policy_compile(_cfg(*ASYNC_LONG)) is True
    # Not on a device the costs were not measured on.
    assert policy_compile(_cfg("rl.steps=5000", "policy.device=cuda")) is False
    (choice,) = [c for c in auto_choices(_cfg("rl.steps=600")) if c.field == "policy.compile_model"]
    assert choice.value is True and "600 >= 600" in choice.reason


def test_the_recipes_compile_model_wins() -> None:
    assert policy_compile(_cfg("rl.steps=5000", "policy.compile_model=false")) is None
    assert policy_compile(_cfg("rl.steps=2", "policy.compile_model=true")) is None
    fields = [c.field for c in auto_choices(_cfg("rl.steps=5000", "policy.compile_model=false"))]
    assert "policy.compile_model" not in fields


class _SpyRuntime:
    """A runtime that records the spec it is asked to build (the ray runtime's seam)."""

    def __init__(self) -> None:
        self.specs: list[tuple[ComponentSpec, str]] = []

    def build_policy(self, spec: ComponentSpec, *, role: str) -> None:
        self.specs.append((spec, role))


def test_build_policy_passes_the_choice_and_the_recipe_wins(tmp_path) -> None:
    def options(cfg: Any, **kw: Any) -> dict[str, Any]:
        rt = _SpyRuntime()
        build_policy(cfg, rt, str(tmp_path), **kw)
        return rt.specs[0][0].options

    assert options(_cfg("rl.steps=600"))["compile_model"] is True
    assert "compile_model" not in options(_cfg("rl.steps=600"), phase="sft")  # eager default
    assert "compile_model" not in options(_cfg("rl.steps=600"), role="reference")
    assert options(_cfg("rl.steps=5"))["compile_model"] is False
    explicit = _cfg("rl.steps=600", "policy.compile_model=false")
    assert options(explicit)["compile_model"] is False


def test_compiling_runs_get_a_persistent_inductor_cache(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    env: dict[str, str] = {}
    assert use_inductor_cache(_cfg("rl.steps=5"), env) is None and env == {}
    where = use_inductor_cache(_cfg("rl.steps=600"), env)
    assert where == str(tmp_path / "xdg" / "rl-train" / "inductor") == env[INDUCTOR_CACHE_ENV]
    assert (tmp_path / "xdg" / "rl-train" / "inductor").is_dir()
    # The environment's own setting wins.
    mine = {INDUCTOR_CACHE_ENV: str(tmp_path / "mine")}
    assert use_inductor_cache(_cfg("rl.steps=2", "policy.compile_model=true"), mine) is None
    assert mine == {INDUCTOR_CACHE_ENV: str(tmp_path / "mine")}
    choices = auto_choices(_cfg("rl.steps=2", "policy.compile_model=true"), {})
    assert [c.field for c in choices] == ["runtime.generator_process", INDUCTOR_CACHE_ENV]


def test_the_run_says_what_it_chose() -> None:
    out = io.StringIO()
    report_auto_choices(_cfg(*ASYNC_LONG), file=out)
    line = out.getvalue()
    assert line.startswith("rl-train: chosen for this run: runtime.generator_process: True")
    assert "policy.compile_model: True (rl.steps 1000 >= 600" in line
    # a run whose choices keep the plain behaviour (a short synchronous run) prints nothing
    quiet = io.StringIO()
    report_auto_choices(_cfg("rl.steps=2"), file=quiet)
    assert quiet.getvalue() == ""


def _trim_run(tiny_recipe_dict, run_dir, trim: bool, calls: list[int], monkeypatch, every=False):
    import rl_core.memory as memory

    real = memory.trim_host_memory

    def counting() -> bool:
        calls.append(1)
        return real()

    recipe = tiny_recipe_dict(
        run_dir,
        seed=5,
        policy={"type": "hf", "lr": 0.01, "trim_host_memory": False},
        rl={"steps": 3},
        runtime={"trim_host_memory": trim},
        eval={"every": 0},
    )
    trainer = Trainer(load_trainer_config(recipe))
    if every:  # trim after every step, whatever the growth
        trainer.run_state.host_trim = memory.HostMemoryTrim(min_growth_bytes=0)
    with monkeypatch.context() as patch:
        patch.setattr(memory, "trim_host_memory", counting)
        records = trainer.run()
    weights = {n: t.detach().clone() for n, t in trainer.policy.named_weights()}
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]
    return rows, weights


def test_the_trim_per_rl_step_leaves_results_unchanged(tiny_recipe_dict, tmp_path, monkeypatch):
    """The trainer trims after the first RL step and then only when the resident memory grew
    by 256 MiB (the tiny model's steps never do); forced to trim after every step it trims 3
    times; off, never. All three runs log the same records and end with bitwise the same
    weights."""
    on_calls: list[int] = []
    every_calls: list[int] = []
    off_calls: list[int] = []
    on, w_on = _trim_run(tiny_recipe_dict, tmp_path / "on", True, on_calls, monkeypatch)
    every, w_every = _trim_run(
        tiny_recipe_dict, tmp_path / "every", True, every_calls, monkeypatch, every=True
    )
    off, w_off = _trim_run(tiny_recipe_dict, tmp_path / "off", False, off_calls, monkeypatch)
    assert len(on_calls) == 1 and len(every_calls) == 3 and off_calls == []
    assert on == off == every
    assert w_on.keys() == w_off.keys()
    assert all(torch.equal(w_on[k], w_off[k]) and torch.equal(w_on[k], w_every[k]) for k in w_on)


def test_check_says_what_the_run_will_choose(tmp_path) -> None:
    """``rl-train check`` lists the chosen settings with their reasons (not as findings: the
    check still passes) and prints them."""
    from rich.console import Console

    from rl_trainer.check import check_recipe, print_report

    sets = [f"run_dir={tmp_path / 'run'}", *ASYNC_LONG]
    report = check_recipe(recipe_path("demo"), sets, rows=1)
    assert not report.problems
    assert report.chosen[0].startswith("runtime.generator_process: True (async local run")
    assert report.chosen[1].startswith("policy.compile_model: True (rl.steps 1000 >= 600")
    out = io.StringIO()
    print_report(report, Console(file=out, width=400))
    assert "chosen for this run: runtime.generator_process: True" in out.getvalue()
    mine = check_recipe(recipe_path("demo"), [*sets, "policy.compile_model=false"], rows=1)
    assert not any(c.startswith("policy.compile_model") for c in mine.chosen)


def _gc_run(tiny_recipe_dict, run_dir, freeze: bool, seen: list[int], monkeypatch):
    import gc

    import rl_trainer.phases.rl as rl_phase

    real = rl_phase.stages.train

    def train(run_state, groups):
        seen.append(gc.get_freeze_count())
        return real(run_state, groups)

    recipe = tiny_recipe_dict(
        run_dir,
        seed=5,
        policy={"type": "hf", "lr": 0.01},
        sft={"steps": 2},
        rl={"steps": 3},
        runtime={"freeze_gc": freeze},
        eval={"every": 0},
    )
    trainer = Trainer(load_trainer_config(recipe))
    with monkeypatch.context() as patch:
        patch.setattr(rl_phase.stages, "train", train)
        records = trainer.run()
    weights = {n: t.detach().clone() for n, t in trainer.policy.named_weights()}
    rows = [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records]
    return rows, weights


def test_the_gc_freeze_is_on_while_training_undone_at_the_end_and_changes_nothing(
    tiny_recipe_dict, tmp_path, monkeypatch
):
    """``runtime.freeze_gc`` (default on): every RL step trains with the built objects frozen
    out of the collector's passes, the run's end gives them back (nothing stays frozen in
    the process), and the records and final weights are those of a run without it."""
    import gc

    assert gc.get_freeze_count() == 0
    on_seen: list[int] = []
    off_seen: list[int] = []
    on, w_on = _gc_run(tiny_recipe_dict, tmp_path / "on", True, on_seen, monkeypatch)
    assert gc.get_freeze_count() == 0
    off, w_off = _gc_run(tiny_recipe_dict, tmp_path / "off", False, off_seen, monkeypatch)
    assert len(on_seen) == 3 and all(n > 1000 for n in on_seen)
    assert off_seen == [0, 0, 0]
    assert on == off
    assert all(torch.equal(w_on[k], w_off[k]) for k in w_on)


def test_the_gc_freeze_is_chosen_for_runs_of_50_steps_or_more() -> None:
    """``runtime.freeze_gc`` auto: on from ``FREEZE_GC_MIN_STEPS`` steps of the phase that runs
    the run's steps (its one collection is paid back by the full collections it saves), off for
    short runs; the recipe's value wins."""
    from rl_trainer.defaults import FREEZE_GC_MIN_STEPS, freeze_gc

    assert FREEZE_GC_MIN_STEPS == 50
    assert freeze_gc(_cfg("rl.steps=50")) is True
    assert freeze_gc(_cfg("rl.steps=49")) is False
    assert freeze_gc(_cfg("rl.steps=5", "runtime.freeze_gc=true")) is True
    assert freeze_gc(_cfg("rl.steps=500", "runtime.freeze_gc=false")) is False
