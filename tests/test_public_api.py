"""Every public module, class, function and method of the packages has a docstring, and the
rl-core surface is pinned."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

PACKAGES = [
    "rl_core",
    "rl_hf",
    "rl_agents",
    "rl_buffer",
    "rl_weightsync",
    "rl_sglang",
    "rl_tinker",
    "rl_trainer",
]
# Every distribution of the monorepo, by import name: they release in lockstep while 0.x.
DISTRIBUTIONS = [*PACKAGES, "rl_megatron"]


def _modules(package: str):
    pkg = importlib.import_module(package)
    yield pkg
    for info in pkgutil.walk_packages(pkg.__path__, prefix=f"{package}."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        yield importlib.import_module(info.name)


def _undocumented(module) -> list[str]:
    missing = []
    if not (module.__doc__ or "").strip():
        missing.append(module.__name__)
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if (inspect.isclass(obj) or inspect.isfunction(obj)) and not (obj.__doc__ or "").strip():
            missing.append(f"{module.__name__}.{name}")
        if inspect.isclass(obj):
            for mname, member in vars(obj).items():
                if mname.startswith("_") or not (
                    inspect.isfunction(member) or isinstance(member, property)
                ):
                    continue
                doc = member.__doc__ if not isinstance(member, property) else member.fget.__doc__
                if not (doc or "").strip() and not any(
                    (getattr(getattr(base, mname, None), "__doc__", None) or "").strip()
                    for base in obj.__mro__[1:]
                ):
                    missing.append(f"{module.__name__}.{name}.{mname}")
    return missing


@pytest.mark.parametrize("package", PACKAGES)
def test_public_names_have_docstrings(package):
    missing = [m for mod in _modules(package) for m in _undocumented(mod)]
    assert not missing, "public names without a docstring:\n" + "\n".join(missing)


def test_rl_core_surface_is_pinned():
    import rl_core.interfaces
    import rl_core.testing
    import rl_core.types

    assert set(rl_core.interfaces.__all__) == {
        "AdvantageFn",
        "Buffer",
        "Critic",
        "DataSource",
        "GenerateFn",
        "GenerationChunk",
        "Generator",
        "GroupFilter",
        "GroupRewardFn",
        "LossFn",
        "Policy",
        "RewardFn",
        "RolloutContext",
        "Tokenizer",
        "ValueLossFn",
        "WeightTarget",
        "WeightTransport",
    }
    assert set(rl_core.types.__all__) == {
        "AdvantageInputs",
        "FinishReason",
        "GenerationRequest",
        "GenerationResult",
        "Group",
        "LogProbOutput",
        "LossOutput",
        "ModelShape",
        "Prompt",
        "Rollout",
        "RolloutStatus",
        "SamplingParams",
        "TrainBatch",
        "WeightUpdate",
    }
    for name in rl_core.testing.__all__:
        assert getattr(rl_core.testing, name) is not None


def _declared_version(package: str) -> str:
    """``__version__`` of a package's ``version.py``, read without importing it (rl_megatron
    needs megatron to import)."""
    root = Path(__file__).resolve().parents[1]
    (path,) = [
        *root.glob(f"packages/*/src/{package}/version.py"),
        *root.glob(f"apps/*/src/{package}/version.py"),
    ]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and node.targets[0].id == "__version__":
            return node.value.value
    raise AssertionError(f"{path} has no __version__")


def test_versions_are_in_lockstep():
    """All distributions share one version, and each pyproject reads it from its version.py."""
    versions = {p: _declared_version(p) for p in DISTRIBUTIONS}
    assert len(set(versions.values())) == 1, versions
    root = Path(__file__).resolve().parents[1]
    pyprojects = sorted(
        [*root.glob("packages/*/pyproject.toml"), *root.glob("apps/*/pyproject.toml")]
    )
    assert len(pyprojects) == len(DISTRIBUTIONS)
    for pyproject in pyprojects:
        assert 'path = "src/rl_' in pyproject.read_text() and "/version.py" in pyproject.read_text()


def test_runtime_code_does_not_need_the_test_extra():
    """No module outside a ``testing`` package imports pytest, hypothesis or ``rl_core.testing``
    (at module level or inside a function): they come with the ``test`` extra only, so such an
    import fails on a plain install (``rl_hf._compile`` once took ``pack_sequences`` from
    ``rl_core.testing.policy``, which imports pytest)."""
    root = Path(__file__).resolve().parents[1]
    banned = ("pytest", "hypothesis", "rl_core.testing")
    found = []
    for path in sorted([*root.glob("packages/*/src/**/*.py"), *root.glob("apps/*/src/**/*.py")]):
        if "testing" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                if any(name == b or name.startswith(b + ".") for b in banned):
                    found.append(f"{path.relative_to(root)}:{node.lineno} imports {name}")
    assert not found, "\n".join(found)
