"""Where relative paths and code references in a config resolve.

A relative path or code file written in a recipe resolves against the recipe's directory; one
given with ``--set`` resolves against the current directory; one set from Python (a dict or a
``Config(...)``) resolves against the current directory too. Strings read from a recipe or
``--set`` carry their directory with them (:class:`Located`), so the rule holds wherever the
value ends up, including the options of a component built long after the recipe was read.

Only fields declared as locations are resolved, never arbitrary strings:

* ``Annotated[str, InputPath()]``: a file or directory the run reads (``model.path``, a data
  source's ``path``); made absolute, and checked to exist when the config is loaded.
* :class:`~rl_core.config.ComponentSpec` ``type`` and ``Annotated[str, CodeRef()]`` fields: a
  registry name, ``"package.module:attr"``, or ``"path/to/file.py:attr"``. A file reference is
  made absolute and checked to exist; a module found as a file beside the recipe
  (``my_reward:score`` with ``my_reward.py`` next to it) becomes a reference to that file, so it
  loads without ``PYTHONPATH`` in any process.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from rl_core.errors import ConfigError

__all__ = [
    "CodeRef",
    "InputPath",
    "Located",
    "base_dir_of",
    "is_file_ref",
    "locate",
    "resolve_code_ref",
    "resolve_input_path",
    "split_ref",
]


_SLICE_SUFFIX = re.compile(r"^(?P<path>.*?)(?P<slice>@\[-?\d*:-?\d*\])?$")
"""A data source's ``path@[a:b]`` record slice (see :func:`rl_buffer.sources.parse_sliced_path`)."""


class Located(str):
    """A string from a recipe file or ``--set``, remembering the directory its relative paths
    resolve against (``base_dir``). It compares, hashes and prints as the plain string."""

    __slots__ = ("base_dir",)
    base_dir: Path

    def __new__(cls, value: str, base_dir: Path) -> Located:
        """Wrap ``value``; ``base_dir`` should be absolute."""
        obj = super().__new__(cls, value)
        obj.base_dir = base_dir
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return (Located, (str(self), self.base_dir))


@dataclasses.dataclass(frozen=True, slots=True)
class InputPath:
    """Field marker (``Annotated[str, InputPath()]``): a file or directory the run reads.

    A relative value resolves against its recipe's directory (or the current directory); with
    ``must_exist`` the config fails at load when nothing is there. A ``path@[a:b]`` slice suffix
    (data sources) is kept and not part of the existence check.
    """

    must_exist: bool = True
    """Check at load that the path exists."""
    hint: str = ""
    """Appended to the "does not exist" error: how to produce or find the path."""


@dataclasses.dataclass(frozen=True, slots=True)
class CodeRef:
    """Field marker (``Annotated[str, CodeRef()]``): a registry name, ``"module:attr"`` or
    ``"path/to/file.py:attr"``, resolved like a :class:`~rl_core.config.ComponentSpec` type."""


def locate(data: Any, base_dir: str | Path) -> Any:
    """A copy of plain ``data`` whose string values (not keys) are :class:`Located` at
    ``base_dir`` (made absolute)."""
    base = Path(base_dir).expanduser().absolute()
    if isinstance(data, str):
        return Located(str(data), base)
    if isinstance(data, dict):
        return {k: locate(v, base) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [locate(v, base) for v in data]
    return data


def base_dir_of(value: str) -> Path:
    """The directory a relative ``value`` resolves against: its recipe's or ``--set``'s
    directory when it is :class:`Located`, else the current directory."""
    base = getattr(value, "base_dir", None)
    return base if base is not None else Path.cwd()


def _absolute(value: str) -> Path:
    p = Path(value).expanduser()
    return p if p.is_absolute() else base_dir_of(value) / p


def resolve_input_path(value: str, marker: InputPath, field: str) -> str:
    """``value`` made absolute (see :class:`InputPath`); raises :class:`ConfigError` naming
    ``field`` and the resolved path when it must exist and does not."""
    if not str(value).strip():
        raise ConfigError(f"{field}: empty; set the path of the file or directory to read.")
    m = _SLICE_SUFFIX.match(str(value))
    path, suffix = (m["path"], m["slice"] or "") if m else (str(value), "")
    resolved = _absolute(Located(path, base_dir_of(value)))
    if marker.must_exist and not resolved.exists():
        where = (
            f"relative paths resolve against {_origin(value)}"
            if not Path(path).expanduser().is_absolute()
            else "the path is absolute"
        )
        hint = f" {marker.hint}" if marker.hint else ""
        raise ConfigError(
            f"{field}: {str(resolved)!r} does not exist ({where}). Fix the path or create it.{hint}"
        )
    return f"{resolved}{suffix}"


def _origin(value: str) -> str:
    if isinstance(value, Located):
        return f"the directory of the recipe or --set that gave it, {value.base_dir}"
    return f"the current directory, {Path.cwd()}"


def split_ref(ref: str) -> tuple[str, str]:
    """``"target:attr"`` -> ``(target, attr)``; the target may be a module or a ``.py`` path."""
    target, _, attr = str(ref).rpartition(":")
    return target, attr


def is_file_ref(target: str) -> bool:
    """Whether a reference target names a file (``x.py``, ``dir/x.py``) rather than a module."""
    return target.endswith(".py") or "/" in target


def resolve_code_ref(ref: str, field: str) -> str:
    """A ComponentSpec ``type`` or :class:`CodeRef` value with its file made absolute.

    Registry names and importable ``module:attr`` references are returned unchanged. A
    ``file.py:attr`` reference must name an existing file (:class:`ConfigError` otherwise). A
    ``module:attr`` whose module is a file (or package) in the value's directory (beside the
    recipe, or the current directory for ``--set``) becomes a reference to that file, so the
    recipe's directory is importable without ``PYTHONPATH``.
    """
    if ":" not in str(ref):
        return str(ref)
    target, attr = split_ref(ref)
    if not target or not attr:
        raise ConfigError(
            f"{field}: {str(ref)!r} is not a code reference; write 'package.module:attr' or "
            "'path/to/file.py:attr'."
        )
    if is_file_ref(target):
        path = _absolute(Located(target, base_dir_of(ref)))
        if not path.is_file():
            raise ConfigError(
                f"{field}: code file {str(path)!r} does not exist (from {str(ref)!r}; relative "
                f"paths resolve against {_origin(ref)}). Fix the path."
            )
        return f"{path}:{attr}"
    if isinstance(ref, Located):
        rel = Path(*target.split("."))
        for candidate in (
            ref.base_dir / rel.with_suffix(".py"),
            ref.base_dir / rel / "__init__.py",
        ):
            if candidate.is_file():
                return f"{candidate}:{attr}"
    return ref  # a Located ref keeps its directory for the import error's "searched" list
