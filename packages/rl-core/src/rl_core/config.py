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
import functools
import json
import math
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args, get_origin, get_type_hints

from rl_core.errors import ConfigError
from rl_core.locations import (
    CodeRef,
    InputPath,
    locate,
    resolve_code_ref,
    resolve_input_path,
)

__all__ = [
    "CodeRef",
    "ComponentSpec",
    "InputPath",
    "NonNegFloat",
    "NonNegInt",
    "OptimizerConfig",
    "Port",
    "PositiveFloat",
    "PositiveInt",
    "Probability",
    "Range",
    "Seed",
    "allowed_range",
    "apply_overrides",
    "check_ranges",
    "from_dict",
    "load_config_file",
    "parse_override",
    "to_dict",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
    """Field marker: the numeric domain of an ``int`` or ``float`` field, checked at load.

    ``count: Annotated[int, Range(ge=1)] = 4``; :func:`from_dict` rejects a value outside it with
    the field's full path, the value and the range (``rollout.n_samples: must be >= 1, got 0``).
    The aliases below cover the common domains. Infinite and NaN values are outside every range.
    """

    ge: float | None = None
    """Inclusive lower bound."""
    gt: float | None = None
    """Exclusive lower bound."""
    le: float | None = None
    """Inclusive upper bound."""
    lt: float | None = None
    """Exclusive upper bound."""

    def __str__(self) -> str:
        lo = f"[{_num(self.ge)}" if self.ge is not None else None
        lo = lo or (f"({_num(self.gt)}" if self.gt is not None else None)
        hi = f"{_num(self.le)}]" if self.le is not None else None
        hi = hi or (f"{_num(self.lt)})" if self.lt is not None else None)
        if lo and hi:
            return f"in {lo}, {hi}"
        if lo:
            return f">= {lo[1:]}" if lo[0] == "[" else f"> {lo[1:]}"
        if hi:
            return f"<= {hi[:-1]}" if hi[-1] == "]" else f"< {hi[:-1]}"
        return "finite"

    def contains(self, value: float) -> bool:
        """Whether ``value`` is finite and inside the range."""
        return (
            math.isfinite(value)
            and (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
            and (self.lt is None or value < self.lt)
        )

    def check(self, value: float, path: str) -> None:
        """Raise :class:`ConfigError` naming ``path``, the value and the range when outside."""
        if not self.contains(value):
            raise ConfigError(f"{path or '<root>'}: must be {self}, got {value!r}.")


def _num(x: float) -> str:
    """``1`` for 1.0, ``4294967296`` for 2**32, ``1e-08`` for 1e-8."""
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


PositiveInt = Annotated[int, Range(ge=1)]
"""A count that must be at least 1."""
NonNegInt = Annotated[int, Range(ge=0)]
"""A count that may be 0 (often "off")."""
PositiveFloat = Annotated[float, Range(gt=0)]
"""A size, rate or time that must be above 0."""
NonNegFloat = Annotated[float, Range(ge=0)]
"""A coefficient or margin that may be 0 (often "off")."""
Probability = Annotated[float, Range(ge=0, le=1)]
"""A probability or fraction in [0, 1]."""
Seed = Annotated[int, Range(ge=0, lt=2**32)]
"""A random seed (numpy takes seeds in [0, 2**32))."""
Port = Annotated[int, Range(ge=0, le=65535)]
"""A TCP port; 0 usually means "pick a free one"."""


def _split_annotated(tp: Any) -> tuple[Any, tuple[Any, ...]]:
    """``Annotated[X, m...]`` -> ``(X, (m...))``; any other type -> ``(tp, ())``."""
    if get_origin(tp) is Annotated:
        base, *meta = get_args(tp)
        return base, tuple(meta)
    return tp, ()


def _markers(tp: Any) -> tuple[Any, ...]:
    """The Annotated metadata of ``tp`` or of its union members (``PositiveInt | None``)."""
    base, meta = _split_annotated(tp)
    if get_origin(base) in (typing.Union, types.UnionType):
        return meta + tuple(m for a in get_args(base) for m in _split_annotated(a)[1])
    return meta


def allowed_range(tp: Any) -> str:
    """The domain a field type allows, as the docs show it (``">= 1"``, ``"in [0, 1]"``), or
    ``""`` when it has no :class:`Range`."""
    return "; ".join(str(m) for m in _markers(tp) if isinstance(m, Range))


def check_ranges(obj: Any, path: str = "") -> None:
    """Check every :class:`Range`-annotated field of dataclass instance ``obj`` (for configs
    built in Python, e.g. from ``__post_init__``; :func:`from_dict` checks on its own)."""
    hints = get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, int | float) and not isinstance(value, bool):
            for m in _markers(hints[f.name]):
                if isinstance(m, Range):
                    m.check(value, f"{path}.{f.name}" if path else f.name)


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam settings shared by the trainable backends' configs (``HFPolicy.Config``,
    ``MegatronPolicy.Config`` and their critics subclass it)."""

    lr: NonNegFloat = 1e-5
    """Peak learning rate of Adam with decoupled weight decay (AdamW)."""
    weight_decay: NonNegFloat = 0.0
    """Decoupled weight decay (Megatron exempts biases and norm weights)."""
    adam_beta1: Annotated[float, Range(ge=0, lt=1)] = 0.9
    """Adam beta1."""
    adam_beta2: Annotated[float, Range(ge=0, lt=1)] = 0.999
    """Adam beta2."""
    adam_eps: PositiveFloat = 1e-8
    """Adam epsilon."""
    grad_clip: NonNegFloat = 1.0
    """Max global gradient norm; 0 turns clipping off (the norm is still reported)."""
    warmup_steps: NonNegInt = 0
    """Linear warmup: optimizer step ``s`` (0-based) uses ``lr * min(1, (s + 1) /
    warmup_steps)``; constant afterwards."""

    def __post_init__(self) -> None:
        check_ranges(self, "policy")


@dataclasses.dataclass(kw_only=True, slots=True)
class ComponentSpec:
    """Selects a pluggable component: a registry name (or ``"module:attr"``) plus its options.

    In a recipe: ``policy: {type: hf, lr: 1e-4}``. The options are checked against the
    component's own ``Config`` when it is built.
    """

    type: str
    """Registry short name (entry point), ``"module:attr"`` or ``"path/to/file.py:attr"``
    (resolved as in :mod:`rl_core.locations`)."""
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Everything else in the section, passed to the component's ``Config``."""


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _fail(path: str, expected: str, value: Any) -> ConfigError:
    return ConfigError(
        f"{path or '<root>'}: expected {expected}, got {value!r} ({type(value).__name__})."
    )


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against type ``tp`` and convert it (e.g. list -> tuple, str -> Path).

    ``Annotated`` markers apply after the type check: :class:`Range` checks the number,
    :class:`InputPath` and :class:`CodeRef` resolve the location (see :mod:`rl_core.locations`).
    Every other kind of type goes to the first converter of :data:`_CONVERTERS` that takes it;
    a type none takes passes the value through.
    """
    if tp is Any or tp is object:
        return value
    base, meta = _split_annotated(tp)
    if meta:
        return _convert_annotated(base, meta, value, path)
    origin = get_origin(tp)
    for takes, convert in _CONVERTERS:
        if takes(tp, origin):
            return convert(tp, value, path)
    return value


def _convert_annotated(base: Any, meta: tuple[Any, ...], value: Any, path: str) -> Any:
    """``Annotated[base, *meta]``: convert to ``base``, then apply the markers in order."""
    if isinstance(value, float) and math.isnan(value):  # name the range, not the type
        for m in meta:
            if isinstance(m, Range):
                m.check(value, path)
    out = _convert(base, value, path)
    if out is None:
        return None
    for m in meta:
        if isinstance(m, Range):
            m.check(out, path)
        elif isinstance(m, InputPath):
            resolved = resolve_input_path(value, m, path)
            out = Path(resolved) if isinstance(out, Path) else resolved
        elif isinstance(m, CodeRef):
            out = resolve_code_ref(value, path)
    return out


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    """``X | Y | None``: ``None`` if allowed, else the first member that takes the value."""
    args = get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise _fail(path, " | ".join(_type_name(a) for a in args), value)
    options = [a for a in args if a is not type(None)]
    if len(options) == 1:  # X | None: X's own error (a nested field, a range) says more
        return _convert(options[0], value, path)
    for arg in options:
        arg_base, arg_meta = _split_annotated(arg)
        try:
            out = _convert(arg_base, value, path)
        except ConfigError:
            continue
        return _convert(arg, out, path) if arg_meta else out
    raise _fail(path, " | ".join(_type_name(a) for a in options), value)


def _convert_literal(tp: Any, value: Any, path: str) -> Any:
    """``Literal[...]``: one of the listed values."""
    allowed = get_args(tp)
    if value not in allowed:
        raise ConfigError(
            f"{path}: {value!r} is not allowed; choose one of {', '.join(map(repr, allowed))}."
        )
    return value


def _convert_component(tp: Any, value: Any, path: str) -> Any:
    """:class:`ComponentSpec`: a ``type`` string, or a table with ``type`` plus options."""
    if isinstance(value, ComponentSpec):
        return value
    if isinstance(value, str):
        return ComponentSpec(type=resolve_code_ref(value, f"{path}.type"))
    if not isinstance(value, Mapping) or "type" not in value:
        raise ConfigError(
            f"{path}: expected a table with a 'type' key naming the backend "
            f'(e.g. {{type = "hf"}}), got {value!r}.'
        )
    if not isinstance(value["type"], str):
        raise _fail(f"{path}.type", "a registry name or 'module:attr'", value["type"])
    opts = {k: v for k, v in value.items() if k != "type"}
    if "options" in opts and len(opts) == 1 and isinstance(opts["options"], Mapping):
        opts = dict(opts["options"])
    return ComponentSpec(type=resolve_code_ref(value["type"], f"{path}.type"), options=opts)


def _convert_dataclass(tp: Any, value: Any, path: str) -> Any:
    """A nested config dataclass: an instance, or a table built with :func:`from_dict`."""
    if isinstance(value, tp):
        return value
    if not isinstance(value, Mapping):
        raise _fail(path, f"a table for {tp.__name__}", value)
    return from_dict(tp, value, path=path)


def _convert_enum(tp: Any, value: Any, path: str) -> Any:
    """An :class:`enum.Enum`: one of its values."""
    try:
        return tp(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in tp)
        raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {allowed}.") from None


def _convert_list(tp: Any, value: Any, path: str) -> Any:
    """``list[X]`` / ``Sequence[X]``: a list (or tuple) of ``X``, returned as a list."""
    (item,) = get_args(tp) or (Any,)
    if not isinstance(value, list | tuple):
        raise _fail(path, f"a list of {_type_name(item)}", value)
    return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]


def _convert_tuple(tp: Any, value: Any, path: str) -> Any:
    """``tuple[X, ...]`` or a fixed-length ``tuple[X, Y]``: a list (or tuple), as a tuple."""
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


def _convert_dict(tp: Any, value: Any, path: str) -> Any:
    """``dict[K, V]`` / ``Mapping[K, V]``: a table, keys and values converted."""
    kt, vt = get_args(tp) or (str, Any)
    if not isinstance(value, Mapping):
        raise _fail(path, "a table", value)
    return {_convert(kt, k, path): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}


def _convert_bool(tp: Any, value: Any, path: str) -> Any:
    """``bool``: only ``true`` / ``false`` (no 0/1, no strings)."""
    if isinstance(value, bool):
        return value
    raise _fail(path, "bool (true/false)", value)


def _convert_int(tp: Any, value: Any, path: str) -> Any:
    """``int``: an int (not a bool), or a float with an integer value."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _fail(path, "int", value)


def _convert_float(tp: Any, value: Any, path: str) -> Any:
    """``float``: an int or float (not a bool, not NaN), as a float."""
    if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
        return float(value)
    raise _fail(path, "a number" if value != value else "float", value)


def _convert_str(tp: Any, value: Any, path: str) -> Any:
    """``str``: a string."""
    if isinstance(value, str):
        return str(value)
    raise _fail(path, "str", value)


def _convert_path(tp: Any, value: Any, path: str) -> Any:
    """``Path``: a string or path, as a :class:`~pathlib.Path`."""
    if isinstance(value, str | Path):
        return Path(value)
    raise _fail(path, "a path string", value)


def _convert_instance(tp: Any, value: Any, path: str) -> Any:
    """Any other class: an instance of it, unchanged."""
    if isinstance(value, tp):
        return value
    raise _fail(path, tp.__name__, value)


_CONVERTERS: tuple[tuple[Callable[[Any, Any], bool], Callable[[Any, Any, str], Any]], ...] = (
    (lambda tp, origin: origin is typing.Union or origin is types.UnionType, _convert_union),
    (lambda tp, origin: origin is Literal, _convert_literal),
    (lambda tp, origin: tp is ComponentSpec, _convert_component),
    (lambda tp, origin: dataclasses.is_dataclass(tp) and isinstance(tp, type), _convert_dataclass),
    (lambda tp, origin: isinstance(tp, type) and issubclass(tp, enum.Enum), _convert_enum),
    (lambda tp, origin: origin in (list, Sequence) or tp is list, _convert_list),
    (lambda tp, origin: origin is tuple or tp is tuple, _convert_tuple),
    (lambda tp, origin: origin in (dict, Mapping) or tp is dict, _convert_dict),
    (lambda tp, origin: tp is bool, _convert_bool),
    (lambda tp, origin: tp is int, _convert_int),
    (lambda tp, origin: tp is float, _convert_float),
    (lambda tp, origin: tp is str, _convert_str),
    (lambda tp, origin: tp is Path, _convert_path),
    (lambda tp, origin: isinstance(tp, type), _convert_instance),
)
"""``(takes(tp, origin), convert(tp, value, path))`` in the order :func:`_convert` tries them
(the order matters: ``bool`` before ``int``, a dataclass or enum before any class)."""


def from_dict(cls: type[T], data: Mapping[str, Any] | None, *, path: str = "") -> T:
    """Build dataclass ``cls`` from plain data, checking names, types and ranges recursively.

    Raises :class:`ConfigError` naming the dotted path of an unknown, missing, ill-typed or
    out-of-range field. Relative locations (:class:`InputPath`, :class:`CodeRef` and
    ComponentSpec ``type`` fields) resolve as :mod:`rl_core.locations` describes.
    """
    if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
        raise TypeError(f"{cls!r} is not a dataclass type")
    if data is not None and not isinstance(data, Mapping):
        raise _fail(path, f"a table for {cls.__name__}", data)
    data = dict(data or {})
    hints = get_type_hints(cls, include_extras=True)
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
        return {"type": str(obj.type), **{k: to_dict(v) for k, v in obj.options.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, Path | str):
        return str(obj)
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's safe loader with YAML 1.2 scalars: ``1e-4`` is a float (YAML 1.1 wants
    ``1.0e-4`` and hands back the string ``"1e-4"``) and only true/false are booleans (YAML 1.1
    also reads yes/no/on/off as booleans)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        first: [(tag, rx) for tag, rx in resolvers if tag not in _YAML11_TAGS]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:bool",
        re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
        list("tTfF"),
    )
    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.VERBOSE,
        ),
        list("-+0123456789."),
    )
    return Loader


_YAML11_TAGS = ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:float")


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON recipe into plain data.

    Strings come back as :class:`~rl_core.locations.Located` at the file's directory, so the
    relative paths and code files a recipe names resolve beside it.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found.")
    try:
        text = p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read the recipe: {e}.") from e
    try:
        if p.suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as e:  # pragma: no cover - depends on the install
                raise ConfigError(
                    f"{p}: YAML recipes need PyYAML: pip install 'rlpost-core[yaml]'."
                ) from e
            data = yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass
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
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise ConfigError(f"{p}: top-level key {bad[0]!r} is not a name; keys must be strings.")
    return locate(data, p.absolute().parent)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``a.b.c=value``; the value is read as a YAML value (a number, bool, null, list or
    ``{key: value}`` mapping), or kept as the plain string when it is not valid YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. --set rollout.n_samples=8.")
    key, raw = text.split("=", 1)
    keys = [k.strip() for k in key.strip().split(".")]
    if not keys or not all(keys):
        raise ConfigError(
            f"--set {text!r}: the key must be dotted field names, e.g. rollout.n_samples."
        )
    raw = raw.strip()
    import yaml

    try:
        value = yaml.load(raw, Loader=_yaml_loader()) if raw else ""
    except yaml.YAMLError:
        return keys, raw
    if isinstance(value, str) and value.lower() == "none":
        return keys, None  # Python's spelling of null, as before
    if isinstance(value, str | int | float | bool | list | dict) or value is None:
        return keys, value
    return keys, raw  # dates, timestamps and other YAML-only types stay text


def _copy(data: Any) -> Any:
    """A deep copy of plain data (tables and lists copied, leaves kept)."""
    if isinstance(data, Mapping):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [_copy(v) for v in data]
    return data


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[str], *, base_dir: str | Path | None = None
) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b=c`` override set (creating tables as needed).

    With ``base_dir`` (the CLI passes the current directory) the values' relative locations
    resolve against it, whatever directory the recipe is in.
    """
    out = _copy(data)
    for text in overrides:
        keys, value = parse_override(text)
        if base_dir is not None:
            value = locate(value, base_dir)
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
