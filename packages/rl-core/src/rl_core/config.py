"""Typed configuration: dataclasses per component, loaded from YAML/TOML plus ``--set`` overrides.

Every component owns a nested ``Config`` dataclass (``@dataclass(kw_only=True, slots=True)``).
:func:`from_dict` builds one from plain data and checks every field's type; an unknown,
missing or ill-typed field raises :class:`~rl_core.errors.ConfigError` naming its full path::

    >>> from_dict(TrainerConfig, {"rollout": {"n_samples": "four"}})
    ConfigError: rollout.n_samples: expected int, got 'four' (str).

Supported field types: ``bool``, ``int``, ``float``, ``str``, ``Path``, ``Literal[...]``,
``enum.Enum`` subclasses, ``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[str, X]``,
``Any`` and nested dataclasses. A field typed :class:`ComponentSpec` selects a backend by name
(``{"type": "hf", ...options}``); its options are validated by the backend's own ``Config`` once
the registry resolves it (see :func:`rl_core.registry.build`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from rl_core.errors import ConfigError

__all__ = [
    "ComponentSpec",
    "OptimizerConfig",
    "apply_overrides",
    "from_dict",
    "load_config_file",
    "parse_override",
    "to_dict",
]

T = TypeVar("T")


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam settings shared by the trainable backends' configs (``HFPolicy.Config``,
    ``MegatronPolicy.Config`` and their critics subclass it)."""

    lr: float = 1e-5
    """Peak learning rate of Adam with decoupled weight decay (AdamW)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (Megatron exempts biases and norm weights)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 turns clipping off (the norm is still reported)."""
    warmup_steps: int = 0
    """Linear warmup: optimizer step ``s`` (0-based) uses ``lr * min(1, (s + 1) /
    warmup_steps)``; constant afterwards."""

    def __post_init__(self) -> None:
        if self.lr < 0:
            raise ConfigError(f"policy.lr: must be >= 0, got {self.lr}.")
        if self.grad_clip < 0:
            raise ConfigError(f"policy.grad_clip: must be >= 0 (0 = off), got {self.grad_clip}.")
        if self.warmup_steps < 0:
            raise ConfigError(f"policy.warmup_steps: must be >= 0, got {self.warmup_steps}.")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"policy.{name}: must be in [0, 1), got {getattr(self, name)}.")


@dataclasses.dataclass(kw_only=True, slots=True)
class ComponentSpec:
    """Selects a pluggable component: a registry name (or ``"module:attr"``) plus its options.

    In a recipe: ``policy: {type: hf, lr: 1e-4}``. The options are checked against the
    component's own ``Config`` when it is built.
    """

    type: str
    """Registry short name (entry point) or ``"module:attr"``."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Everything else in the section, passed to the component's ``Config``."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _fail(path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(
        f"{path or '<root>'}: expected {expected}, got {value!r} ({type(value).__name__})."
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` and convert it (e.g. list -> tuple, str -> Path)."""
    if tp is Any or tp is object:
        return value
    origin = get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _fail(path, " | ".join(_type_name(a) for a in args), value)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError as e:
                errors.append(str(e))
        raise _fail(path, " | ".join(_type_name(a) for a in args if a is not type(None)), value)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            raise ConfigError(
                f"{path}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}."
            )
        return value
    if tp is ComponentSpec:
        if isinstance(value, ComponentSpec):
            return value
        if isinstance(value, str):
            return ComponentSpec(type=value)
        if not isinstance(value, Mapping) or "type" not in value:
            raise ConfigError(
                f"{path}: expected a table with a 'type' key naming the backend "
                f'(e.g. {{type = "hf"}}), got {value!r}.'
            )
        opts = {k: v for k, v in value.items() if k != "type"}
        if "options" in opts and len(opts) == 1 and isinstance(opts["options"], Mapping):
            opts = dict(opts["options"])
        return ComponentSpec(type=str(value["type"]), options=opts)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise _fail(path, f"a table for {tp.__name__}", value)
        return from_dict(tp, value, path=path)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ConfigError(
                f"{path}: {value!r} is not allowed; choose one of {allowed}."
            ) from None
    if origin in (list, Sequence) or tp is list:
        (item,) = get_args(tp) or (Any,)
        if not isinstance(value, list | tuple):
            raise _fail(path, f"a list of {_type_name(item)}", value)
        return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple or tp is tuple:
        args = get_args(tp)
        if not isinstance(value, list | tuple):
            raise _fail(path, "a list", value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ConfigError(f"{path}: expected {len(args)} items, got {len(value)}.")
        return tuple(
            _convert(a, v, f"{path}[{i}]")
            for i, (a, v) in enumerate(zip(args or [Any] * len(value), value))
        )
    if origin in (dict, Mapping) or tp is dict:
        kt, vt = get_args(tp) or (str, Any)
        if not isinstance(value, Mapping):
            raise _fail(path, "a table", value)
        return {_convert(kt, k, path): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _fail(path, "bool (true/false)", value)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise _fail(path, "int", value)
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _fail(path, "float", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _fail(path, "str", value)
    if tp is Path:
        if isinstance(value, str | Path):
            return Path(value)
        raise _fail(path, "a path string", value)
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _fail(path, tp.__name__, value)
    return value


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data, checking names and types recursively.

    Raises :class:`ConfigError` naming the dotted path of an unknown, missing or ill-typed field.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"{cls!r} is not a dataclass type")
    data = dict(data or {})
    hints = get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        known = ", ".join(sorted(fields))
        raise ConfigError(
            f"{where}{unknown[0]}: unknown field of {cls.__name__}; known fields: {known}."
        )
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: missing required field of {cls.__name__}.")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path or cls.__name__}: {e}") from e


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config (dataclasses, enums, paths and tuples converted)."""
    if isinstance(obj, ComponentSpec):
        return {"type": obj.type, **{k: to_dict(v) for k, v in obj.options.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON recipe into plain data."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found.")
    text = p.read_text()
    try:
        if p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:  # pragma: no cover - depends on the install
                raise ConfigError(
                    f"{p}: YAML recipes need PyYAML: pip install 'rl-core[yaml]'."
                ) from e
            data = yaml.safe_load(text)
        elif p.suffix == ".toml":
            data = tomllib.loads(text)
        elif p.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(
                f"{p}: unknown config format {p.suffix!r}; use .yaml, .toml or .json."
            )
    except ConfigError:
        raise
    except Exception as e:  # parser errors carry the line number in their text
        raise ConfigError(f"{p}: could not parse: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a table/mapping, got {type(data).__name__}.")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as YAML/JSON-ish (numbers, bools, lists) if it can
    be, else kept as a string."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set rollout.n_samples=8.")
    key, raw = text.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"--set {text!r}: empty key.")
    raw = raw.strip()
    value: Any
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        low = raw.lower()
        if low in ("true", "false"):
            value = low == "true"
        elif low in ("null", "none", "~"):
            value = None
        else:
            try:
                value = tomllib.loads(f"v = {raw}")["v"]
            except tomllib.TOMLDecodeError:
                value = raw
    return keys, value


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=c`` override set (creating tables as needed)."""
    out = json.loads(json.dumps(data, default=str))
    for text in overrides:
        keys, value = parse_override(text)
        node = out
        for i, k in enumerate(keys[:-1]):
            nxt = node.get(k)
            if nxt is None:
                nxt = node[k] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(
                    f"--set {text!r}: {'.'.join(keys[: i + 1])} is {nxt!r}, not a table."
                )
            node = nxt
        node[keys[-1]] = value
    return out
