"""``rl-train run`` on damaged inputs: every user mistake ends in one ``error: <RLError
subclass>: ...`` report with exit status 2, never a raw traceback.

The sweep sets an out-of-range value into every range-checked field of the trainer's config and
of the components a tiny recipe uses (found from the ``Range`` annotations, so new fields are
covered without editing this file), then wrong types, missing files, bad ``--set`` syntax,
damaged YAML, unknown components and broken user code. Most cases fail at config load; the
model backends' options fail when the trainer validates them, before any model is trained. A
hypothesis fuzz substitutes random values into random fields of the demo recipe.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import traceback
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rl_core.errors
from rl_core import registry
from rl_core.algorithms import GRPO, PolicyLoss
from rl_core.config import ComponentSpec, Range, load_config_file
from rl_core.errors import RLError
from rl_hf.tiny import TinyModelSpec
from rl_trainer.cli import main, recipe_path
from rl_trainer.config import TrainerConfig, load_trainer_config

TINY = {
    "arch": "qwen2",
    "hidden_size": 32,
    "num_layers": 1,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 64,
}

BASE = {
    "seed": 0,
    "model": {"init": TINY},
    "task": {"type": "reverse", "n_train": 32, "n_eval": 4, "min_len": 2, "max_len": 3},
    "policy": {"type": "hf", "lr": 0.001},
    "generator": {"type": "hf", "max_batch_size": 16},
    "weight_transport": {"type": "inprocess"},
    "buffer": {"type": "group"},
    "rollout": {"prompts_per_step": 2, "n_samples": 2, "sampling": {"max_new_tokens": 3}},
    "rl": {"steps": 1},
    "eval": {"every": 0},
    "logging": {"tensorboard": False, "progress": False},
}
"""A recipe that trains one tiny step when nothing is damaged."""

ERROR_LINE = re.compile(r"^error: (\w+): ", re.M)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A recipe directory with the base recipe, a data file and user-code files; the run
    directory is shared so the tiny model is built once."""
    d = tmp_path_factory.mktemp("damaged")
    (d / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{w}=", "label": w[::-1]}) + "\n" for w in ("ab", "cd"))
    )
    (d / "good_reward.py").write_text("def score(prompt, response, label):\n    return 0.0\n")
    (d / "raises_on_import.py").write_text("import math\n\nX = 1 / 0\n")
    (d / "syntax_error.py").write_text("def score(:\n")
    (d / "bad_dependency.py").write_text("import no_such_dependency_xyz  # noqa\n")
    (d / "base.yaml").write_text(yaml.safe_dump({**BASE, "run_dir": str(d / "run")}))
    return d


def _assert_clean_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``rl-train`` in-process; fail on a raw exception, a traceback, a status other than 2
    or a report that is not one ``error: <RLError subclass>:`` line. Returns stderr."""
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors exit 2 with a usage line, no traceback
        code = e.code
    except BaseException:
        pytest.fail(f"rl-train {argv}: raw exception\n{traceback.format_exc()}")
    err = capsys.readouterr().err
    assert "Traceback" not in err, f"rl-train {argv}:\n{err}"
    assert code == 2, f"rl-train {argv}: exit {code}, stderr:\n{err}"
    if err.startswith("usage:"):
        return err
    found = ERROR_LINE.findall(err)
    assert len(found) == 1, f"rl-train {argv}: expected one error line, got:\n{err}"
    cls = getattr(rl_core.errors, found[0], None)
    assert isinstance(cls, type) and issubclass(cls, RLError), f"{found[0]} is not an RLError"
    return err


def _run(workdir: Path, *sets: str) -> list[str]:
    argv = ["run", str(workdir / "base.yaml"), "--no-report"]
    for s in sets:
        argv += ["--set", s]
    return argv


# ------------------------------------------------------------------ the range sweep


def _ranges(tp: Any) -> tuple[type, list[Range], bool]:
    """The numeric base type and Range markers of a field type (``X | None`` included), and
    whether they apply to the items of a list rather than to the field itself."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return args[0], [m for m in tp.__metadata__ if isinstance(m, Range)], False
    if origin in (list, tuple) and args:
        base, ranges, _ = _ranges(args[0])
        return base, ranges, True
    for a in args:
        base, ranges, items = _ranges(a)
        if ranges:
            return base, ranges, items
    return object, [], False


def _range_fields(cls: type, prefix: str) -> list[tuple[str, type, Range, bool]]:
    """Every Range-checked field under dataclass ``cls`` (nested tables included)."""
    out = []
    hints = typing.get_type_hints(cls, include_extras=True)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        base, ranges, items = _ranges(hints[f.name])
        out += [(path, base, r, items) for r in ranges]
        plain = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(plain) and plain is not ComponentSpec:
            out += _range_fields(plain, path)
    return out


def _bad_values(base: type, r: Range) -> list[Any]:
    """Values just outside ``r`` (and a NaN / infinity for floats)."""
    step = 1 if base is int else 0.5
    bad: list[Any] = []
    if r.ge is not None:
        bad.append(r.ge - step)
    if r.gt is not None:
        bad.append(r.gt)
    if r.le is not None:
        bad.append(r.le + step)
    if r.lt is not None:
        bad.append(r.lt)
    if base is float:
        bad.append(math.nan if r.le is not None or r.lt is not None else math.inf)
    return [int(v) if base is int else v for v in bad]


def _yaml_value(v: Any) -> str:
    if isinstance(v, float) and math.isnan(v):
        return ".nan"
    if isinstance(v, float) and math.isinf(v):
        return ".inf" if v > 0 else "-.inf"
    return str(v)


def _component_config(kind: str, name: str) -> type:
    return registry.resolve(registry.GROUPS[kind], name).Config


SWEEP_ROOTS: list[tuple[type, str, tuple[str, ...]]] = [
    (TrainerConfig, "", ()),
    (_component_config("task", "reverse"), "task", ()),
    (_component_config("policy", "hf"), "policy", ()),
    (_component_config("generator", "hf"), "generator", ()),
    (_component_config("weight_transport", "inprocess"), "weight_transport", ()),
    (_component_config("buffer", "group"), "buffer", ()),
    (PolicyLoss.Config, "algorithm.loss", ()),
    (GRPO.Config, "algorithm.advantage_options", ()),
    (TinyModelSpec, "model.init", ()),
    # A data file instead of the task's: its source's options are checked too.
    (_component_config("data_source", "jsonl"), "data.train", ("data.train={type: jsonl}",)),
]
"""(Config class, where it sits in the recipe, extra --set lines that select it)."""

SWEEP = [
    pytest.param(
        prefix_sets,
        path,
        f"[{_yaml_value(value)}]" if items else _yaml_value(value),
        f"{path}[0]" if items else path,
        str(r),
        id=f"{path}={_yaml_value(value)}",
    )
    for cls, prefix, prefix_sets in SWEEP_ROOTS
    for path, base, r, items in _range_fields(cls, prefix)
    for value in _bad_values(base, r)
]
OTHER_ERROR = {"buffer.max_staleness": "the trainer bounds staleness itself"}
"""Fields whose every value is refused by an earlier check with its own message."""


def test_sweep_covers_every_section():
    paths = {p.values[1] for p in SWEEP}
    assert len(paths) >= 60, len(paths)
    for expected in ("rollout.n_samples", "rl.steps", "policy.lr", "generator.max_batch_size",
                     "task.n_train", "model.init.num_layers", "data.train.max_prompt_tokens",
                     "runtime.generate_timeout_s", "checkpoint.keep", "seed"):  # fmt: skip
        assert expected in paths, expected


@pytest.mark.parametrize(("prefix_sets", "path", "value", "where", "allowed"), SWEEP)
def test_out_of_range_value_is_reported(workdir, capsys, prefix_sets, path, value, where, allowed):
    sets = [s.replace("{type: jsonl}", f"{{type: jsonl, path: {workdir}/train.jsonl}}")
            for s in prefix_sets]  # fmt: skip
    err = _assert_clean_error(_run(workdir, *sets, f"{path}={value}"), capsys)
    expected = OTHER_ERROR.get(path, f"{where}: must be {allowed}, got ")
    assert expected in err, err


# ------------------------------------------------------------------ other damage

DAMAGED_SETS = [
    # wrong types
    ("rl.steps=abc", r"rl\.steps: expected int"),
    ("rl.steps=1.5", r"rl\.steps: expected int"),
    ("rollout.sampling=5", r"rollout\.sampling: expected a table"),
    ("rl.async_generation=maybe", r"rl\.async_generation: expected bool"),
    ("model.init=small", r"model\.init: expected a table"),
    ("task=[1, 2]", r"task: expected a table with a 'type' key"),
    ("task={type: 3}", r"task\.type: expected a registry name"),
    ("rollout.filters=3", r"rollout\.filters: expected a list"),
    ("rollout.sampling.stop_token_ids=[1, x]", r"stop_token_ids\[1\]: expected int"),
    ("algorithm.aggregation=sum", r"algorithm\.aggregation: 'sum' is not allowed"),
    ("algorithm.loss={variant: nope}", r"variant: unknown 'nope'"),
    ("runtime=kubernetes", r"runtime\.type: 'kubernetes' is not allowed"),
    ("rl.steps=0", r"rl\.steps: 0 with sft\.steps: 0 would run nothing"),
    # unknown fields
    ("rollout.n_sample=4", r"rollout\.n_sample: unknown field of RolloutConfig"),
    ("task.n_trains=4", r"task\.n_trains: unknown field"),
    ("policy.learning_rate=1", r"policy\.learning_rate: unknown field"),
    # bad --set syntax
    ("novalue", r"expected KEY=VALUE"),
    ("=5", r"the key must be dotted field names"),
    ("rl..steps=5", r"the key must be dotted field names"),
    ("rl.steps.x=1", r"rl\.steps is 1, not a table"),
    # missing files and paths
    ("model.path=/nonexistent/model/dir", r"model\.path: '/nonexistent/model/dir' does not exist"),
    ("model.path=no_such_model", r"model\.path: '.*/no_such_model' does not exist"),
    ("data.train={type: jsonl, path: missing.jsonl}", r"data\.train\.path: '.*missing\.jsonl'"),
    ("data.train={type: jsonl, path: ''}", r"data\.train\.path: empty"),
    # unknown components
    ("task=nope", r"task\.type: unknown rl\.tasks backend 'nope'"),
    ("reward=nope", r"reward\.type: unknown rl\.rewards backend 'nope'"),
    ("buffer=nope", r"buffer\.type: unknown rl\.buffers backend 'nope'"),
    ("rollout.filters=[{type: nope}]", r"rollout\.filters\[0\]\.type: unknown"),
    ("algorithm.advantage=nope", r"algorithm\.advantage: unknown rl\.advantages backend"),
    ("generator=warp_drive", r"generator\.type: unknown rl\.generators backend 'warp_drive'"),
    # user code by location
    ("reward=no_such_file.py:score", r"reward\.type: code file .*no_such_file\.py' does not exist"),
    ("reward=no_such_module_xyz:score", r"cannot import module 'no_such_module_xyz'"),
    ("reward=good_reward.py:nope", r"has no attribute 'nope'"),
    ("reward=raises_on_import.py:X", r"ZeroDivisionError.*raises_on_import\.py:3"),
    ("reward=syntax_error.py:score", r"SyntaxError"),
    ("reward=bad_dependency.py:x", r"no_such_dependency_xyz"),
    ("reward=os:path.nope", r"module 'os' has no attribute 'path\.nope'"),
    ("reward=..:f", r"'\.\.' is not a module name"),
    ("reward=/etc/passwd:f", r"is not a Python file; a code file ends in \.py"),
    ("model.path=~no_such_user_xyz/m", r"model\.path: '.*~no_such_user_xyz/m' does not exist"),
]


@pytest.mark.parametrize(("override", "message"), DAMAGED_SETS, ids=[d[0] for d in DAMAGED_SETS])
def test_damaged_override_is_reported(workdir, capsys, monkeypatch, override, message):
    monkeypatch.chdir(workdir)  # --set paths resolve against the current directory
    err = _assert_clean_error(_run(workdir, override), capsys)
    assert re.search(message, err), err


DAMAGED_FILES = [
    ("unclosed.yaml", "rl: {steps: 1\n", r"could not parse"),
    ("tabs.yaml", "rl:\n\tsteps: 1\n", r"could not parse"),
    ("list.yaml", "- a\n- b\n", r"top level must be a table"),
    ("scalar.yaml", "42\n", r"top level must be a table"),
    ("empty.yaml", "", r"task: set a built-in task"),
    ("binary.yaml", b"\xff\xfe\x00junk", r"cannot read the recipe|could not parse"),
    ("bad.toml", "rl = {steps = }\n", r"could not parse"),
    ("recipe.txt", "rl: {}\n", r"unknown config format"),
    ("int_keys.yaml", "1: 2\n", r"top-level key 1 is not a name"),
    ("nested_bad.yaml", "rl: [1, 2]\n", r"rl: expected a table for RLConfig"),
]


@pytest.mark.parametrize(
    ("name", "text", "message"), DAMAGED_FILES, ids=[d[0] for d in DAMAGED_FILES]
)
def test_damaged_recipe_file_is_reported(tmp_path, capsys, name, text, message):
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    err = _assert_clean_error(["run", str(p), "--no-report"], capsys)
    assert re.search(message, err), err


def test_missing_recipe_is_reported(tmp_path, capsys):
    err = _assert_clean_error(["run", str(tmp_path / "nope.yaml")], capsys)
    assert "no such file and no bundled recipe" in err


# ------------------------------------------------------------------ subprocess and end to end


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "rl_trainer.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "override",
    ["rollout.n_samples=0", "data.train={type: jsonl, path: missing.jsonl}", "reward=x.py:f"],
)
def test_subprocess_reports_one_error_line(workdir, tmp_path, override):
    proc = _cli("run", str(workdir / "base.yaml"), "--no-report", "--set", override, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and ERROR_LINE.match(lines[0]), proc.stderr


def test_recipe_dir_code_and_data_without_pythonpath(tmp_path):
    """A recipe naming ``my_reward:score`` and ``train.jsonl`` beside it runs from another
    directory with no PYTHONPATH entry for it (#24); --set paths resolve against the cwd."""
    rdir, cwd = tmp_path / "project", tmp_path / "elsewhere"
    rdir.mkdir()
    cwd.mkdir()
    (rdir / "helpers.py").write_text("BONUS = 0.5\n")
    (rdir / "my_reward.py").write_text(
        textwrap.dedent(
            """
            from helpers import BONUS

            def score(prompt, response, label):
                return BONUS if response.strip() == label else 0.0
            """
        )
    )
    (rdir / "train.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{w}=", "label": w[::-1]}) + "\n" for w in ("ab", "cd"))
    )
    recipe = {
        **{k: v for k, v in BASE.items() if k != "task"},
        "run_dir": str(tmp_path / "run"),
        "data": {"train": {"type": "jsonl", "path": "train.jsonl"}},
        "reward": {"type": "my_reward:score"},
    }
    (rdir / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    (cwd / "eval.jsonl").write_text((rdir / "train.jsonl").read_text())
    env_path = os.environ.get("PYTHONPATH", "")
    assert str(rdir) not in env_path.split(os.pathsep)
    proc = _cli(
        "run", str(rdir / "recipe.yaml"), "--no-report",
        "--set", "data.eval={type: jsonl, path: eval.jsonl}", "--set", "eval.every=1",
        cwd=cwd,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[0])
    assert summary["rl_steps_this_run"] >= 1
    assert "first_eval_reward" in summary  # the eval data from --set was found in cwd


# ------------------------------------------------------------------ fuzz


def _leaf_paths(data: Any, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(data, dict):
        out = [prefix] if prefix else []
        for k, v in data.items():
            out += _leaf_paths(v, (*prefix, str(k)))
        return out
    return [prefix]


def _schema_paths(cls: type, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        out.append(path)
        if dataclasses.is_dataclass(hints[f.name]) and hints[f.name] is not ComponentSpec:
            out += _schema_paths(hints[f.name], path)
    return out


DEMO = load_config_file(recipe_path("demo"))
FUZZ_PATHS = sorted(set(_leaf_paths(DEMO)) | set(_schema_paths(TrainerConfig)))

FUZZ_STRINGS = [
    *("hf", "grpo", "reverse", "jsonl", "", ".", "a\x00b", "~no_such_user/x"),
    *("x.py:f", "os:sep", "a:b:c", "..:f", "/etc/passwd:f", "json:loads", "rl_core:__name__"),
]
"""Registry names, paths and code references that are close to valid ones."""

VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**40), max_value=2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(FUZZ_STRINGS),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)


def _set(data: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node = data
    for k in path[:-1]:
        nxt = node.get(k)
        if not isinstance(nxt, dict):
            nxt = node[k] = {}
        node = nxt
    node[path[-1]] = value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(FUZZ_PATHS), VALUES), min_size=1, max_size=3))
def test_fuzzed_demo_recipe_loads_or_raises_rl_error(changes):
    data = json.loads(json.dumps(DEMO))
    for path, value in changes:
        _set(data, path, value)
    try:
        cfg = load_trainer_config(data)
    except RLError:
        return
    except Exception:
        pytest.fail(f"{changes!r}: raw exception\n{traceback.format_exc()}")
    assert isinstance(cfg, TrainerConfig)
