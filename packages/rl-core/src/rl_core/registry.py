"""Plugin registry: components by entry-point name, or ``"module:attr"`` /
``"path/to/file.py:attr"`` for user code.

Each package declares what it provides as entry points, e.g. in rl-weightsync's pyproject::

    [project.entry-points."rl.weight_transports"]
    disk_delta = "rl_weightsync.disk_delta:DiskDeltaTransport"

A recipe then names it: ``weight_transport: {type: disk_delta, directory: /shared/sync}``.
``"my_pkg.rewards:exact"`` or ``"rewards/exact.py:score"`` loads user code directly (only what
the config names is imported); see :mod:`rl_core.locations` for where relative names resolve.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rl_core.config import ComponentSpec, from_dict
from rl_core.errors import BackendNotFoundError, ConfigError
from rl_core.locations import (
    Located,
    absolute_path,
    base_dir_of,
    check_target,
    is_file_ref,
    split_ref,
)

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
    """Import ``"package.module:attr"`` or ``"path/to/file.py:attr"`` (attr may be dotted).

    A relative file path resolves against the reference's directory (its recipe's, see
    :mod:`rl_core.locations`) or the current directory. A file is imported under its module
    name: the directory above its outermost package (the file's own directory for a plain
    file) goes on ``sys.path``, as ``python path/to/file.py`` would do, so it can import the
    files beside it. Every failure raises :class:`BackendNotFoundError` saying what was searched
    and how to fix it.
    """
    target, attr = split_ref(ref)
    if not target or not attr:
        raise BackendNotFoundError(
            f"{str(ref)!r}: expected 'package.module:attr' or 'path/to/file.py:attr'."
        )
    check_target(target, ref, BackendNotFoundError)
    if is_file_ref(target):
        path = absolute_path(Located(target, base_dir_of(ref)))
        obj: Any = _import_file(path.resolve(), ref)
        where = f"file {str(path)!r}"
    else:
        obj = _import_module(target, ref)
        where = f"module {target!r}"
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise BackendNotFoundError(
                f"{str(ref)!r}: {where} has no attribute {attr!r}; check the name after ':'."
            ) from None
    return obj


def _import_failed(ref: str, what: str, e: BaseException) -> BackendNotFoundError:
    """The error for user code that raised while it was imported, naming its file:line."""
    frames = traceback.extract_tb(e.__traceback__)
    at = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return BackendNotFoundError(
        f"{str(ref)!r}: importing {what} raised {type(e).__name__}: {e}{at}; fix that code."
    )


def _import_module(name: str, ref: str) -> Any:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name != e.name and not name.startswith(f"{e.name}."):
            raise _import_failed(ref, f"module {name!r}", e) from e
        searched = "\n  ".join(p or "(current directory)" for p in sys.path)
        beside, where = "", "beside the recipe"
        if isinstance(ref, Located):  # its recipe's directory was searched first
            rel = Path(*name.split("."))
            files = [ref.base_dir / rel.with_suffix(".py"), ref.base_dir / rel / "__init__.py"]
            beside = f"no {' or '.join(repr(str(f)) for f in files)}, and "
            where = f"in {str(ref.base_dir)!r}"
        raise BackendNotFoundError(
            f"{str(ref)!r}: cannot import module {name!r}: {beside}no {e.name!r} on sys.path, "
            f"which holds:\n  {searched}\nInstall the package that provides it, put "
            f"{name.replace('.', '/')}.py {where}, name the file itself "
            f"('path/to/{name.rsplit('.', 1)[-1]}.py:attr'), or add its directory to PYTHONPATH."
        ) from None
    except Exception as e:  # the module's own code raised while it was imported
        raise _import_failed(ref, f"module {name!r}", e) from e


def _import_file(path: Path, ref: str) -> Any:
    """Import the file at ``path`` under its module name, its import root on ``sys.path``."""
    if not path.is_file():
        raise BackendNotFoundError(
            f"{str(ref)!r}: code file {str(path)!r} does not exist; relative paths resolve "
            f"against {base_dir_of(ref)}. Fix the path."
        )
    root = path.parent
    parts = [] if path.stem == "__init__" else [path.stem]
    while (root / "__init__.py").is_file():
        parts.insert(0, root.name)
        root = root.parent
    name = ".".join(parts)
    if not name.replace(".", "").replace("_", "").isalnum() or not name.isascii():
        raise BackendNotFoundError(
            f"{str(ref)!r}: {str(path)!r} would import as {name!r}, which is not a module name; "
            "rename the file (and its package directories) to Python identifiers."
        )
    loaded = sys.modules.get(name)
    if loaded is None:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        try:
            loaded = importlib.import_module(name)
        except Exception as e:
            raise _import_failed(ref, f"{str(path)!r}", e) from e
    found = getattr(loaded, "__file__", None)
    if found is None or Path(found).resolve() != path:
        raise BackendNotFoundError(
            f"{str(ref)!r}: {str(path)!r} would import as module {name!r}, but that name is "
            f"already {found or 'a namespace package'}; rename the file."
        )
    return loaded


def _entry_points(group: str) -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=group)}


def available(group: str) -> list[str]:
    """Names registered in ``group`` (entry points and local registrations)."""
    return sorted(set(_entry_points(group)) | set(_LOCAL.get(group, {})))


def resolve(group: str, name: str, *, field: str = "") -> Any:
    """The object named ``name`` in ``group``: a local registration, an entry point, or a
    ``"module:attr"`` / ``"path/to/file.py:attr"`` reference. ``field`` names the config field
    for the error message."""
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
            "that provides it or name your own code ('package.module:attr' or "
            "'path/to/file.py:attr')."
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


def _protocol_params(protocol: type) -> list[str] | None:
    """Parameter names of a ``typing.Protocol``'s own ``__call__`` (without ``self``), if any."""
    call = protocol.__dict__.get("__call__") if getattr(protocol, "_is_protocol", False) else None
    if call is None:
        return None
    return [p.name for p in inspect.signature(call).parameters.values()][1:]


def _plain_signature(sig: inspect.Signature) -> str:
    """``sig`` without annotations or return type: ``(a, b=1, *, c)``."""
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def check_callable(
    obj: Any,
    protocol: type,
    *,
    field: str,
    n_args: int | None = None,
    call: Sequence[str] | None = None,
    ref: str | None = None,
) -> Callable[..., Any]:
    """Check at load time that ``obj`` can be called the way the framework calls it, so a wrong
    signature is reported when the config is read, not mid-run.

    The call's positional arguments are ``call`` (their names, for the message), else the
    parameters of ``protocol.__call__`` when ``protocol`` is a ``typing.Protocol`` (``RewardFn``:
    ``prompt, response, rollout``), else ``n_args`` unnamed ones; with none of them only
    callability is checked. ``ref`` is how the config names ``obj`` (``'my_pkg.rewards:score'``).
    The error shows both sides, e.g.::

        reward: 'my_reward:score' takes (a, b), which does not match RewardFn: the trainer
        calls it as score(prompt, response, rollout) (too many positional arguments).
    """
    what = protocol.__name__ if protocol is not object else "the call"
    name = ref or getattr(obj, "__qualname__", None) or type(obj).__qualname__
    if not callable(obj):
        expected = f"a {what} (" if protocol is not object else "("
        raise ConfigError(
            f"{field}: {ref or repr(obj)!r} (of type {type(obj).__name__}) is not callable; "
            f"expected {expected}a function, or an object with __call__)."
        )
    params = list(call) if call is not None else _protocol_params(protocol)
    if params is None and n_args is not None:
        params = [f"arg{i + 1}" for i in range(n_args)]
    if params is None:
        return obj
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # builtins without a signature: nothing to check
        return obj
    try:
        sig.bind(*([None] * len(params)))
    except TypeError as e:
        fn_name = getattr(obj, "__name__", None) or type(obj).__name__
        shown = ", ".join(params)
        raise ConfigError(
            f"{field}: {name!r} takes {_plain_signature(sig)}, which does not match {what}: "
            f"the trainer calls it as {fn_name}({shown}) ({e}). Give it the parameters "
            f"({shown}); any others need default values."
        ) from None
    return obj


def options_of(spec: ComponentSpec) -> Mapping[str, Any]:
    """The options of a spec (for components configured by hand)."""
    return spec.options
