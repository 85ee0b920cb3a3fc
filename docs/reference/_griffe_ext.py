"""Griffe extension for the API reference (loaded by mkdocstrings, see mkdocs.yml).

It reads the sources statically (nothing is imported) and adjusts what griffe sees so the pages
show the public API once, with working links:

- Lazy exports: a package whose ``__init__`` imports its public names on first use (PEP 562: a
  ``_LAZY = {"Name": "pkg.module"}`` table, or ``from pkg.module import Name`` inside
  ``__getattr__``) gets those ``__all__`` names as aliases, so ``::: rl_hf`` renders ``HFPolicy``.
- One rendering per object: a name a package re-exports in its ``__all__`` is documented at the
  package (``rl_buffer.schedule_step``, the import path users write) and left out of its
  defining module's section (``rl_buffer.balance``), which lists the rest of that module.
- Sphinx roles in docstrings (``:class:`~rl_core.interfaces.Generator```, ``:meth:`generate```)
  become links to the rendered object when the name resolves, and inline code otherwise
  (mkdocstrings renders Markdown, where the roles would show as literal text).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):`(?P<tilde>~?)"
    r"(?P<text>[^`<]*?)(?:\s*<(?P<target>[^>`]+)>)?`"
)


def _lazy_exports(module: griffe.Module) -> dict[str, str]:
    """``{name: defining module}`` for the names ``module`` imports on first use."""
    path = module.filepath
    if not isinstance(path, Path) or not path.exists():
        return {}
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets
        ):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                continue
            if isinstance(table, dict):
                found.update({str(k): str(v) for k, v in table.items()})
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom) and inner.module and inner.level == 0:
                    for alias in inner.names:
                        found.setdefault(alias.asname or alias.name, inner.module)
    return found


def _modules(module: griffe.Module) -> list[griffe.Module]:
    """``module`` and every submodule under it."""
    out = [module]
    for member in module.members.values():
        if not member.is_alias and member.is_module:
            out.extend(_modules(member))  # type: ignore[arg-type]
    return out


def _exports(module: griffe.Module) -> list[str]:
    """The names in ``module.__all__`` (statically read), or [] without one."""
    names = module.exports
    return [n for n in names or [] if isinstance(n, str)]


class PublicAPI(griffe.Extension):
    """Lazy exports as aliases, one rendering per re-exported object, Sphinx roles as links."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Adjust the freshly loaded package ``pkg`` (see the module docstring)."""
        modules = _modules(pkg)
        for module in modules:
            lazy = _lazy_exports(module) if module.is_init_module else {}
            for name in _exports(module):
                if name not in module.members and name in lazy:
                    alias = griffe.Alias(name, f"{lazy[name]}.{name}", parent=module)
                    module.set_member(name, alias)
        for module in modules:
            for name in _exports(module):
                member = module.members.get(name)
                if member is None or not member.is_alias:
                    continue
                target_path = member.target_path  # type: ignore[union-attr]
                if not target_path.startswith(module.path + "."):
                    continue
                try:
                    target = loader.modules_collection.get_member(target_path)
                except (KeyError, ValueError, AttributeError):
                    continue
                if target.is_alias or target.parent is module:
                    continue
                member.public = True
                target.public = False
        for module in modules:
            self._rewrite_roles(module, set())

    def _rewrite_roles(self, obj: griffe.Object, seen: set[str]) -> None:
        if obj.path in seen:
            return
        seen.add(obj.path)
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(lambda m: _role_html(obj, m), obj.docstring.value)
        for member in obj.members.values():
            if not member.is_alias:
                self._rewrite_roles(member, seen)  # type: ignore[arg-type]


def _resolve(obj: griffe.Object, name: str) -> str | None:
    """The full path ``name`` means in ``obj``'s scope, or None (e.g. an external name)."""
    name = name.lstrip(".")
    if name.startswith("rl_"):
        return name
    head, _, rest = name.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            full = scope.resolve(head)
        except griffe.NameResolutionError:
            scope = scope.parent
            continue
        return f"{full}.{rest}" if rest else full
    return None


def _role_html(obj: griffe.Object, match: re.Match[str]) -> str:
    """One role as an optional cross-reference (a link if the target is rendered, else code)."""
    text = match.group("text").strip()
    target = (match.group("target") or text).strip().lstrip("~")
    if match.group("target"):
        title = text
    elif match.group("tilde"):
        title = target.rsplit(".", 1)[-1]
    else:
        title = target
    code = f"<code>{title}</code>"
    full = _resolve(obj, target)
    if full is None or not full.startswith("rl_"):
        return code
    return f'<autoref identifier="{full}" optional>{code}</autoref>'
