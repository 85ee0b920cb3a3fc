"""The trainer's typed run state (:mod:`rl_trainer.run_state`) and the import graph it allows:
the state types import nothing from the stages, phases or driver; no module below the driver
takes the whole ``Trainer``; the package has no import circle (imports inside functions and
under ``TYPE_CHECKING`` count: they tie modules as much as any other)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rl_trainer
from rl_core.errors import RLError
from rl_trainer.run_state import Counters, PhaseModels, RunState

PACKAGE = Path(rl_trainer.__file__).parent

DRIVER = "rl_trainer.loop"
COMMANDS = {"rl_trainer.cli", "rl_trainer.ops.replay", "rl_trainer.ops.eval_only"}
"""The user-facing commands: the only modules above the driver (they build a ``Trainer``)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``path`` imports anywhere (``from pkg import sub`` names ``sub``
    when it is a module, else ``pkg``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in modules] or [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name.startswith("rl_trainer"):
                found.add(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_state_types_import_nothing_from_the_step_or_the_driver(graph):
    below = _reach(graph, "rl_trainer.run_state")
    above = {m for m in graph if m.startswith(("rl_trainer.phases", "rl_trainer.step.stages"))}
    above |= {
        DRIVER,
        "rl_trainer.lifecycle.state",
        "rl_trainer.step.offload",
        "rl_trainer.step.lora",
    } | COMMANDS
    assert not below & above, f"rl_trainer.run_state reaches {sorted(below & above)}"


def test_only_the_commands_import_the_driver(graph):
    importers = {m for m, deps in graph.items() if DRIVER in deps}
    assert importers <= COMMANDS, f"modules below the driver import it: {importers - COMMANDS}"


def test_the_trainer_package_has_no_import_circle(graph):
    circles = [m for m in graph if m in _reach(graph, m)]
    assert not circles, f"modules on an import circle: {sorted(circles)}"


def test_counters_round_trip_through_a_checkpoint_and_count_versions():
    c = Counters(sft_step=3, rl_step=5, eval_at_0=True, first_version=7)
    stored = c.as_checkpoint()
    assert stored == {"sft_step": 3, "rl_step": 5, "eval_at_0": True}  # the checkpoint format
    back = Counters.from_checkpoint(stored)
    assert (back.sft_step, back.rl_step, back.eval_at_0, back.first_version) == (3, 5, True, 0)
    assert c.global_step == 8
    assert c.train_version(1, updates_per_step=4) == 7
    assert c.train_version(3, updates_per_step=4) == 15


def test_offloadable_models_leave_out_a_shared_base_view_and_a_server_teacher():
    class Model:
        def offload(self) -> None: ...

    class BaseView:
        shares_policy = True

    class ServerTeacher:
        pass

    policy, critic = Model(), Model()
    models = PhaseModels(
        policy=policy, critic=critic, reference=BaseView(), teacher=ServerTeacher()
    )
    assert models.offloadable() == [policy, critic]


def test_emit_outside_a_run_is_an_rl_error(tiny_recipe_dict, tmp_path):
    from rl_trainer.config import load_trainer_config
    from rl_trainer.loop import Trainer

    trainer = Trainer(load_trainer_config(tiny_recipe_dict(tmp_path / "r")))
    try:
        assert isinstance(trainer.run_state, RunState)
        with pytest.raises(RLError, match="inside Trainer.run"):
            trainer.run_state.emit({"step": 1})
    finally:
        trainer.release_run_dir()
