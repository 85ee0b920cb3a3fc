"""Generate ``docs/configuration.md`` from the config dataclasses' field docstrings.

    python -m rl_trainer.docgen > docs/configuration.md

A test checks that the committed file is up to date.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import typing
from typing import Any

from rl_core.config import allowed_range
from rl_trainer import config as config_module

__all__ = ["field_docs", "render"]


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings written under each field of dataclass ``cls`` (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _type_str(tp: Any) -> str:
    s = str(tp) if not isinstance(tp, type) else tp.__name__
    s = s.replace("typing.", "").replace("rl_core.config.", "").replace("rl_trainer.config.", "")
    return s.replace("|", "\\|")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        if dataclasses.is_dataclass(v):
            if type(v).__name__ == "ComponentSpec":
                return f"{{type: {v.type}}}"
            return "(table)"
        return repr(v)
    return "required"


def _config_classes(tp: Any) -> list[tuple[type, str]]:
    """The config dataclasses a field type holds: itself, ``X | None`` or ``list[X]`` (with a
    ``[]`` suffix for list items)."""
    if dataclasses.is_dataclass(tp) and tp.__module__ == config_module.__name__:
        return [(tp, "")]
    suffix = "[]" if typing.get_origin(tp) is list else ""
    return [
        (a, suffix)
        for a in typing.get_args(tp)
        if dataclasses.is_dataclass(a) and a.__module__ == config_module.__name__
    ]


def render() -> str:
    """The Markdown reference of :class:`rl_trainer.config.TrainerConfig`."""
    out = [
        "# Configuration reference",
        "",
        "Generated from the config dataclasses by `python -m rl_trainer.docgen`; do not edit by hand.",
        "A recipe (YAML or TOML) sets any of these; `--set a.b=c` overrides one field.",
        "Unknown, ill-typed or out-of-range fields fail at load with their path, the value and the",
        "allowed range (the `allowed` column; every range excludes infinity and NaN). Component",
        "sections (`{type: ...}`) take the options of the named component's own `Config`.",
        "",
        "## Paths and code",
        "",
        "- **Relative paths resolve against the recipe's directory**: `model.path`, a data source's",
        "  `path` (`data.train`, `data.eval`, `eval.datasets[].data`) and code files. Values given",
        "  with `--set` resolve against the current directory. `run_dir` is an output and stays",
        "  relative to the current directory. `model.path` and data paths must exist when the",
        "  config is loaded (the error names the field and the resolved path).",
        "- **Code by name or by location**: a component `type` (and `algorithm.advantage`) is a",
        "  registry name (`reverse`, `hf`), `package.module:attr`, or `path/to/file.py:attr`.",
        "  A module that sits beside the recipe needs no `PYTHONPATH`:",
        '  `reward: {type: "my_reward:score"}` loads `my_reward.py` from the recipe\'s directory.',
        "  A file is imported under its module name with its directory on `sys.path` (the one above",
        "  its outermost package), so it can import the files beside it. Import errors list what was",
        "  searched.",
        "- **`--set KEY=VALUE`** reads VALUE as YAML: `--set rl.steps=50`,",
        "  `--set data.train={type: jsonl, path: x.jsonl}`, `--set rollout.sampling.stop_token_ids=[2]`,",
        "  `--set critic=null`; anything that is not valid YAML stays a string.",
        "",
    ]
    seen: set[type] = set()

    def section(cls: type, prefix: str) -> None:
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        title = prefix or "(root)"
        out.extend([f"## `{title}`", "", (inspect.getdoc(cls) or "").split("\n")[0], ""])
        out.extend(["| field | type | allowed | default | meaning |", "|---|---|---|---|---|"])
        extras = typing.get_type_hints(cls, include_extras=True)
        nested = []
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            allowed = allowed_range(extras[f.name]).replace("|", "\\|")
            out.append(
                f"| `{f.name}` | `{_type_str(tp)}` | {allowed} | `{_default(f)}` "
                f"| {docs.get(f.name, '')} |"
            )
            name = f"{prefix}.{f.name}" if prefix else f.name
            for inner, suffix in _config_classes(tp):
                nested.append((inner, name + suffix))
        out.append("")
        for tp, p in nested:
            section(tp, p)

    section(config_module.TrainerConfig, "")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
