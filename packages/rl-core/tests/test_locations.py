"""Code and paths by location: ``file.py:attr`` references, recipe-relative paths, --set values
relative to the current directory, and import errors that say what was searched."""

from __future__ import annotations

import pickle
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest

from rl_core import registry
from rl_core.config import (
    CodeRef,
    ComponentSpec,
    InputPath,
    apply_overrides,
    from_dict,
    load_config_file,
    to_dict,
)
from rl_core.errors import BackendNotFoundError, ConfigError
from rl_core.locations import Located


@dataclass(kw_only=True, slots=True)
class Paths:
    data: Annotated[str, InputPath()] | None = None
    code: Annotated[str, CodeRef()] = "grpo"
    comp: ComponentSpec | None = None


@pytest.fixture
def modname(monkeypatch):
    """A module name no other test uses (sys.modules and sys.path are restored afterwards)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"user_{uuid.uuid4().hex[:8]}"
    yield name
    for k in [k for k in sys.modules if k == name or k.startswith(f"{name}.")]:
        del sys.modules[k]


def test_file_reference_loads_and_imports_siblings(tmp_path, modname):
    (tmp_path / f"{modname}_helper.py").write_text("K = 3\n")
    (tmp_path / f"{modname}.py").write_text(
        f"from {modname}_helper import K\n\ndef score(p, r, l):\n    return K\n"
    )
    fn = registry.load_object(f"{tmp_path}/{modname}.py:score")
    assert fn(None, None, None) == 3
    assert fn.__module__ == modname  # imported under its module name: picklable by reference
    assert registry.load_object(f"{tmp_path}/{modname}.py:score") is fn  # loaded once


def test_file_in_package_imports_as_package_module(tmp_path, modname):
    pkg = tmp_path / modname
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "consts.py").write_text("K = 5\n")
    (pkg / "rewards.py").write_text("from .consts import K\n\ndef score(p, r, l):\n    return K\n")
    fn = registry.load_object(f"{pkg}/rewards.py:score")
    assert fn(None, None, None) == 5 and fn.__module__ == f"{modname}.rewards"


def test_relative_file_reference_resolves_against_its_directory(tmp_path, modname):
    (tmp_path / f"{modname}.py").write_text("VALUE = 7\n")
    ref = Located(f"{modname}.py:VALUE", tmp_path)
    assert registry.load_object(ref) == 7


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("missing_dir/none.py:f", r"code file .*missing_dir/none\.py' does not exist"),
        ("no_such_module_xyz:f", r"no 'no_such_module_xyz' on sys\.path, which holds:"),
        ("json:no_such_attr", r"module 'json' has no attribute 'no_such_attr'"),
        ("json", r"expected 'package\.module:attr' or 'path/to/file\.py:attr'"),
    ],
)
def test_reference_errors_say_what_was_searched(ref, message):
    with pytest.raises(BackendNotFoundError, match=message):
        registry.load_object(ref)


def test_module_not_found_suggests_fixes():
    with pytest.raises(BackendNotFoundError) as e:
        registry.load_object("no_such_module_xyz:f")
    text = str(e.value)
    assert "beside the recipe" in text and "PYTHONPATH" in text
    assert all(p in text for p in sys.path if p)


def test_user_code_raising_on_import_names_file_and_line(tmp_path, modname):
    (tmp_path / f"{modname}.py").write_text("x = 1\nraise RuntimeError('boom')\n")
    with pytest.raises(BackendNotFoundError, match=rf"RuntimeError: boom at .*{modname}\.py:2"):
        registry.load_object(f"{tmp_path}/{modname}.py:f")
    (tmp_path / f"{modname}_b.py").write_text("import no_such_dependency_xyz\n")
    with pytest.raises(BackendNotFoundError, match="ModuleNotFoundError.*no_such_dependency_xyz"):
        registry.load_object(f"{tmp_path}/{modname}_b.py:f")
    (tmp_path / f"{modname}_c.py").write_text("def f(:\n")
    with pytest.raises(BackendNotFoundError, match="SyntaxError"):
        registry.load_object(f"{tmp_path}/{modname}_c.py:f")


def test_file_shadowed_by_a_loaded_module_is_an_error(tmp_path):
    (tmp_path / "json.py").write_text("X = 1\n")
    with pytest.raises(BackendNotFoundError, match="would import as module 'json'.*rename"):
        registry.load_object(f"{tmp_path}/json.py:X")


def test_recipe_relative_paths_and_modules(tmp_path, modname):
    sub = tmp_path / "recipes"
    sub.mkdir()
    (sub / "train.jsonl").write_text("{}\n")
    (sub / f"{modname}.py").write_text("def score(p, r, l):\n    return 1.0\n")
    (sub / "r.yaml").write_text(
        f"data: train.jsonl@[0:10]\ncode: {modname}:score\ncomp: {{type: '{modname}:score'}}\n"
    )
    cfg = from_dict(Paths, load_config_file(sub / "r.yaml"))
    assert cfg.data == f"{sub / 'train.jsonl'}@[0:10]"
    assert cfg.code == f"{sub / modname}.py:score"
    assert cfg.comp is not None and cfg.comp.type == f"{sub / modname}.py:score"
    assert registry.resolve("rl.rewards", cfg.comp.type)(None, None, None) == 1.0


def test_set_values_resolve_against_the_current_directory(tmp_path, monkeypatch):
    recipe_dir, cwd = tmp_path / "recipes", tmp_path / "work"
    recipe_dir.mkdir()
    cwd.mkdir()
    (recipe_dir / "a.jsonl").write_text("{}\n")
    (cwd / "b.jsonl").write_text("{}\n")
    (recipe_dir / "r.yaml").write_text("data: a.jsonl\ncomp: {type: x, path: a.jsonl}\n")
    monkeypatch.chdir(cwd)
    data = load_config_file(recipe_dir / "r.yaml")
    assert from_dict(Paths, data).data == str(recipe_dir / "a.jsonl")
    over = apply_overrides(data, ["data=b.jsonl", "comp.path=b.jsonl"], base_dir=Path.cwd())
    cfg = from_dict(Paths, over)
    assert cfg.data == str(cwd / "b.jsonl")
    # A component's options keep their origin until its own Config reads them.
    assert cfg.comp is not None
    assert from_dict(Paths, {"data": cfg.comp.options["path"]}).data == str(cwd / "b.jsonl")
    assert to_dict(cfg)["comp"]["path"] == "b.jsonl" and type(to_dict(cfg)["comp"]["path"]) is str


def test_missing_input_path_names_field_and_resolved_path(tmp_path):
    with pytest.raises(ConfigError, match=rf"data: '{tmp_path}/nope\.jsonl' does not exist"):
        from_dict(Paths, {"data": Located("nope.jsonl", tmp_path)})
    with pytest.raises(ConfigError, match=r"comp\.type: code file .*nope\.py' does not exist"):
        from_dict(Paths, {"comp": {"type": Located("nope.py:f", tmp_path)}})
    with pytest.raises(ConfigError, match=r"data: empty"):
        from_dict(Paths, {"data": ""})


def test_located_pickles_with_its_directory(tmp_path):
    s = pickle.loads(pickle.dumps(Located("a.py:f", tmp_path)))
    assert s == "a.py:f" and s.base_dir == tmp_path
