"""Loading a test directory's helper file as a module under pytest's ``--import-mode=importlib``
(where test files cannot import their siblings by name)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load_module"]


def load_module(name: str, path: str | Path) -> ModuleType:
    """The module at ``path``, registered in ``sys.modules`` as ``name`` before it runs (so
    dataclasses and pickling find it) and loaded once: a second call returns the same module."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
