"""Plugin registry: components by entry-point name, or ``"module:attr"`` for user code.

Each package declares what it provides as entry points, e.g. in rl-weightsync's pyproject::

    [project.entry-points."rl.weight_transports"]
    disk_delta = "rl_weightsync.disk_delta:DiskDeltaTransport"

A recipe then names it: ``weight_transport: {type: disk_delta, directory: /shared/sync}``.
``"my_pkg.rewards:exact"`` loads user code directly (only what the config names is imported).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import BackendNotFoundError, ConfigError

__all__ = [
    "GROUPS",
    "available",
    "build",
    "load_object",
    "register",
    "resolve",
]

GROUPS: dict[str, str] = {
    "policy": "rl.policies",
    "critic": "rl.critics",
    "generator": "rl.generators",
    "buffer": "rl.buffers",
    "data_source": "rl.data_sources",
    "weight_transport": "rl.weight_transports",
    "reward": "rl.rewards",
    "generate_fn": "rl.generate_fns",
    "filter": "rl.filters",
    "advantage": "rl.advantages",
    "loss": "rl.losses",
    "task": "rl.tasks",
}
"""Component kind -> entry-point group."""

_LOCAL: dict[str, dict[str, Any]] = {}


def register(group: str, name: str, obj: Any) -> None:
    """Register ``obj`` under ``name`` in ``group`` for this process (tests, notebooks)."""
    _LOCAL.setdefault(group, {})[name] = obj


def load_object(ref: str) -> Any:
    """Import ``"package.module:attr"`` (attr may be dotted)."""
    if ":" not in ref:
        raise BackendNotFoundError(f"{ref!r}: expected 'package.module:attr'.")
    mod_name, attr = ref.split(":", 1)
    try:
        obj: Any = importlib.import_module(mod_name)
    except ImportError as e:
        raise BackendNotFoundError(f"{ref!r}: cannot import module {mod_name!r}: {e}.") from e
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendNotFoundError(
                f"{ref!r}: module {mod_name!r} has no attribute {attr!r}."
            ) from None
    return obj


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def available(group: str) -> list[str]:
    """Names registered in ``group`` (entry points and local registrations)."""
    return sorted(set(_entry_points(group)) | set(_LOCAL.get(group, {})))


def resolve(group: str, name: str, *, field: str = "") -> Any:
    """The object named ``name`` in ``group``: a local registration, an entry point, or a
    ``"module:attr"`` reference. ``field`` names the config field for the error message."""
    where = f"{field}: " if field else ""
    if name in _LOCAL.get(group, {}):
        return _LOCAL[group][name]
    if ":" in name:
        try:
            return load_object(name)
        except BackendNotFoundError as e:
            raise BackendNotFoundError(f"{where}{e}") from None
    eps = _entry_points(group)
    if name not in eps:
        known = ", ".join(available(group)) or "none installed"
        raise BackendNotFoundError(
            f"{where}unknown {group} backend {name!r}; installed: {known}. Install the package "
            "that provides it or use a 'module:attr' reference."
        )
    try:
        return eps[name].load()
    except ImportError as e:
        raise BackendNotFoundError(
            f"{where}{group} backend {name!r} is installed but failed to import: {e}."
        ) from e


def build(kind: str, spec: ComponentSpec | str, *, field: str = "", **runtime: Any) -> Any:
    """Resolve ``spec.type`` in the group of ``kind`` and construct it.

    A class with a nested ``Config`` dataclass is built as ``cls(cls.Config(**options), **runtime)``
    with the options validated (errors name ``field.option``). A plain function or object with
    no options is returned as is (function seams: rewards, filters, losses); options for such an
    object are an error.
    """
    if isinstance(spec, str):
        spec = ComponentSpec(type=spec)
    group = GROUPS.get(kind, kind)
    obj = resolve(group, spec.type, field=f"{field}.type" if field else "type")
    config_cls = getattr(obj, "Config", None) if inspect.isclass(obj) else None
    if config_cls is not None:
        config = from_dict(config_cls, spec.options, path=field)
        return obj(config, **runtime)
    if spec.options:
        raise ConfigError(
            f"{field or kind}: {spec.type!r} takes no options (it has no Config); "
            f"remove {sorted(spec.options)}."
        )
    if inspect.isclass(obj):
        return obj(**runtime)
    return obj


def check_callable(
    obj: Any, protocol: type, *, field: str, n_args: int | None = None
) -> Callable[..., Any]:
    """Check at load time that ``obj`` is callable with ``n_args`` positional arguments, so a wrong
    signature is reported when the config is read, not mid-run."""
    if not callable(obj):
        raise ConfigError(f"{field}: {obj!r} is not callable; expected a {protocol.__name__}.")
    if n_args is not None:
        try:
            sig = inspect.signature(obj)
        except (TypeError, ValueError):
            return obj
        try:
            sig.bind(*([None] * n_args))
        except TypeError as e:
            raise ConfigError(
                f"{field}: {getattr(obj, '__qualname__', obj)!r} does not match {protocol.__name__} "
                f"({n_args} positional arguments): {e}."
            ) from None
    return obj


def options_of(spec: ComponentSpec) -> Mapping[str, Any]:
    """The options of a spec (for components configured by hand)."""
    return spec.options
