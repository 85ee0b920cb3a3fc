"""Typed config loading: types, unknown fields, overrides, files."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from rl_core.config import (
    ComponentSpec,
    apply_overrides,
    from_dict,
    load_config_file,
    parse_override,
    to_dict,
)
from rl_core.errors import ConfigError, RLError


@dataclass(kw_only=True, slots=True)
class Inner:
    n: int = 3
    mode: Literal["a", "b"] = "a"
    ratios: tuple[float, ...] = (0.5,)


@dataclass(kw_only=True, slots=True)
class Root:
    inner: Inner = field(default_factory=Inner)
    lr: float = 1e-3
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    backend: ComponentSpec = field(default_factory=lambda: ComponentSpec(type="hf"))
    path: Path = Path("x")


@dataclass(kw_only=True, slots=True)
class NeedsValue:
    value: int


def test_builds_nested_and_converts():
    cfg = from_dict(
        Root, {"inner": {"n": 4, "ratios": [1, 2]}, "lr": 1, "path": "a/b", "tags": ["x"]}
    )
    assert cfg.inner.n == 4 and cfg.inner.ratios == (1.0, 2.0)
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float)
    assert cfg.path == Path("a/b")
    assert to_dict(cfg)["inner"]["ratios"] == [1.0, 2.0]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inner": {"n": "four"}}, "inner.n: expected int, got 'four'"),
        ({"inner": {"m": 1}}, "inner.m: unknown field of Inner"),
        ({"inner": {"mode": "c"}}, "inner.mode: 'c' is not allowed"),
        ({"lr": True}, "lr: expected float"),
        ({"tags": "x"}, "tags: expected a list"),
        ({"tags": [1]}, "tags[0]: expected str"),
        ({"backend": {"lr": 1}}, "backend: expected a table with a 'type' key"),
        ({"inner": 3}, "inner: expected a table for Inner"),
    ],
)
def test_errors_name_the_field(data, message):
    with pytest.raises(ConfigError) as e:
        from_dict(Root, data)
    assert message in str(e.value)
    assert isinstance(e.value, RLError)


def test_missing_required_field():
    with pytest.raises(ConfigError, match="value: missing required field"):
        from_dict(NeedsValue, {})


def test_component_spec_collects_options():
    cfg = from_dict(Root, {"backend": {"type": "sglang", "url": "http://127.0.0.1:1", "n": 2}})
    assert cfg.backend == ComponentSpec(
        type="sglang", options={"url": "http://127.0.0.1:1", "n": 2}
    )
    assert from_dict(Root, {"backend": "x"}).backend.type == "x"


def test_overrides():
    data = apply_overrides(
        {"inner": {"n": 1}},
        ["inner.n=5", "lr=2e-4", "name=run one", 'tags=["a","b"]', "inner.mode=b"],
    )
    cfg = from_dict(Root, data)
    assert (cfg.inner.n, cfg.lr, cfg.name, cfg.tags, cfg.inner.mode) == (
        5,
        2e-4,
        "run one",
        ["a", "b"],
        "b",
    )
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("x=null") == (["x"], None)
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_override("novalue")
    with pytest.raises(ConfigError, match="not a table"):
        apply_overrides({"lr": 1}, ["lr.x=1"])


def test_files(tmp_path):
    (tmp_path / "r.yaml").write_text("lr: 0.5\ninner:\n  n: 7\n")
    (tmp_path / "r.toml").write_text("lr = 0.5\n[inner]\nn = 7\n")
    for name in ("r.yaml", "r.toml"):
        cfg = from_dict(Root, load_config_file(tmp_path / name))
        assert cfg.lr == 0.5 and cfg.inner.n == 7
    (tmp_path / "bad.yaml").write_text("lr: [1,\n")
    with pytest.raises(ConfigError, match="bad.yaml: could not parse"):
        load_config_file(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config_file(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(ConfigError, match="top level must be a table"):
        load_config_file(tmp_path / "list.yaml")
