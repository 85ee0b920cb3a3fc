"""Numeric domains checked at load (Range annotations), ``--set`` values read as YAML, and the
recipe loader's YAML 1.2 scalars."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.config import (
    NonNegInt,
    OptimizerConfig,
    PositiveFloat,
    PositiveInt,
    Probability,
    Range,
    allowed_range,
    apply_overrides,
    check_ranges,
    from_dict,
    load_config_file,
    parse_override,
)
from rl_core.errors import ConfigError


@dataclass(kw_only=True, slots=True)
class Inner:
    count: PositiveInt = 1
    rate: Probability = 0.5
    beta: Annotated[float, Range(ge=0, lt=1)] = 0.9


@dataclass(kw_only=True, slots=True)
class Outer:
    inner: Inner = field(default_factory=Inner)
    maybe: PositiveFloat | None = None
    opt_inner: Inner | None = None
    ids: list[NonNegInt] = field(default_factory=list)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"inner": {"count": 0}}, r"^inner\.count: must be >= 1, got 0\.$"),
        ({"inner": {"count": -5}}, r"^inner\.count: must be >= 1, got -5\.$"),
        ({"inner": {"rate": 1.5}}, r"^inner\.rate: must be in \[0, 1\], got 1\.5\.$"),
        ({"inner": {"rate": math.nan}}, r"^inner\.rate: must be in \[0, 1\], got nan\.$"),
        ({"inner": {"beta": 1}}, r"^inner\.beta: must be in \[0, 1\), got 1\.0\.$"),
        ({"maybe": 0}, r"^maybe: must be > 0, got 0\.0\.$"),
        ({"maybe": math.inf}, r"^maybe: must be > 0, got inf\.$"),
        ({"opt_inner": {"count": 0}}, r"^opt_inner\.count: must be >= 1, got 0\.$"),
        ({"ids": [1, -1]}, r"^ids\[1\]: must be >= 0, got -1\.$"),
        ({"inner": {"count": "3"}}, r"^inner\.count: expected int, got '3'"),
        ({"maybe": math.nan}, r"^maybe: must be > 0, got nan\.$"),
    ],
)
def test_out_of_range_names_path_value_and_range(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_in_range_values_load():
    cfg = from_dict(Outer, {"inner": {"count": 3, "rate": 1, "beta": 0}, "maybe": None, "ids": [0]})
    assert (cfg.inner.count, cfg.inner.rate, cfg.inner.beta, cfg.maybe) == (3, 1.0, 0.0, None)
    assert from_dict(Outer, {"maybe": 2}).maybe == 2.0


def test_plain_float_rejects_nan():
    @dataclass(kw_only=True, slots=True)
    class Plain:
        x: float = 0.0

    with pytest.raises(ConfigError, match="x: expected a number, got nan"):
        from_dict(Plain, {"x": math.nan})


def test_allowed_range_and_check_ranges():
    assert str(Range(ge=1)) == ">= 1" and str(Range(gt=0, le=1)) == "in (0, 1]"
    assert str(Range(ge=0, lt=2**32)) == "in [0, 4294967296)" and str(Range()) == "finite"
    assert allowed_range(PositiveInt | None) == ">= 1" and allowed_range(int) == ""
    with pytest.raises(ConfigError, match=r"^x\.count: must be >= 1, got 0\.$"):
        check_ranges(Inner(count=0), "x")
    # Configs built in Python check their ranges too (OptimizerConfig's __post_init__).
    with pytest.raises(ConfigError, match=r"policy\.adam_beta2: must be in \[0, 1\), got 1\.0"):
        OptimizerConfig(adam_beta2=1.0)


@given(st.floats(allow_nan=True, allow_infinity=True))
@settings(max_examples=200, deadline=None)
def test_range_contains_matches_its_definition(x):
    r = Range(gt=-1.5, le=2.0)
    assert r.contains(x) == (math.isfinite(x) and -1.5 < x <= 2.0)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("a.b=hello", "hello"),
        ("a=run one", "run one"),
        ("a=8", 8),
        ("a=1e-4", 1e-4),
        ("a=-2.5", -2.5),
        ("a=true", True),
        ("a=False", False),
        ("a=yes", "yes"),  # YAML 1.2: only true/false are booleans
        ("a=null", None),
        ("a=None", None),
        ("a=~", None),
        ("a=[1, 2]", [1, 2]),
        ("a={type: jsonl, path: x.jsonl}", {"type": "jsonl", "path": "x.jsonl"}),
        ("a=my_reward:score", "my_reward:score"),
        ("a=path/to/r.py:score", "path/to/r.py:score"),
        ("a=[unclosed", "[unclosed"),  # not YAML: kept as the string
        ("a={x: [1}", "{x: [1}"),
        ("a=", ""),
        ("a=2024-01-01", "2024-01-01"),  # YAML dates stay text
        ("a = 3", 3),
    ],
)
def test_set_values_parse_as_yaml(text, value):
    assert parse_override(text)[1] == value


def test_set_mapping_replaces_a_component_section():
    data = apply_overrides({"data": {}}, ["data.train={type: jsonl, path: x.jsonl}"])
    assert data == {"data": {"train": {"type": "jsonl", "path": "x.jsonl"}}}


@pytest.mark.parametrize("text", ["novalue", "=1", "a..b=1", ".a=1"])
def test_bad_set_syntax(text):
    with pytest.raises(ConfigError, match="--set"):
        parse_override(text)


def test_recipe_yaml_reads_exponent_floats(tmp_path):
    (tmp_path / "r.yaml").write_text("lr: 1e-4\nwd: 1.0e-2\nflag: on\nn: 1_000\n")
    assert load_config_file(tmp_path / "r.yaml") == {
        "lr": 1e-4,
        "wd": 1e-2,
        "flag": "on",
        "n": 1000,
    }
