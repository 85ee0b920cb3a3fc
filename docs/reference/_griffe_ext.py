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
  (mkdocstrings renders Markdown, where the roles would show as literal text); reST's ``::``
  literal-block marker is dropped (the indented block renders as code).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import griffe

_ROLE = re.compile(
    r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|ref):`(?P<tilde>~?)"
    r"(?P<text>[^`<]*?)(?:\s*<(?P<target>[^>`]+)>)?`"
)


# reST's literal-block marker before an indented block: "text::" shows as "text:", a "::" line
# goes (Markdown renders the indented block as code by itself).
_LITERAL_END = re.compile(r"(?m)^(.*\S)::\n(?=\n[ \t]+\S)")
_LITERAL_ALONE = re.compile(r"(?m)^[ \t]*::\n(?=\n[ \t]+\S)")


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
    """Lazy exports as aliases, one rendering per re-exported object, Sphinx roles as links.

    Options (mkdocs.yml): ``packages``, the import names of the documented packages. The first of
    them griffe loads has the others loaded into the same collection, so that a role naming
    another package's object can be checked: a role whose target is in none of the packages and
    is not an importable module either (a renamed or removed name) is logged as a warning, which
    fails ``mkdocs build --strict``.
    """

    def __init__(self, packages: list[str] | None = None) -> None:
        super().__init__()
        self.packages = list(packages or [])
        self._loading = False

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        """Adjust the freshly loaded package ``pkg`` (see the module docstring)."""
        _add_lazy_exports(pkg)
        _document_once(pkg, loader)
        if self._loading or pkg.name not in self.packages:
            return
        self._loading = True
        try:
            for name in self.packages:
                if name not in loader.modules_collection:
                    loader.load(name, try_relative_path=False)
        finally:
            self._loading = False
        loader.resolve_aliases(implicit=False, external=False)
        for name in self.packages:
            for module in _modules(loader.modules_collection.get_member(name)):
                _rewrite_roles(module, self.packages, set())


def _add_lazy_exports(pkg: griffe.Module) -> None:
    """Add each lazily imported ``__all__`` name of ``pkg``'s packages as an alias."""
    for module in _modules(pkg):
        lazy = _lazy_exports(module) if module.is_init_module else {}
        for name in _exports(module):
            if name not in module.members and name in lazy:
                module.set_member(name, griffe.Alias(name, f"{lazy[name]}.{name}", parent=module))


def _document_once(pkg: griffe.Module, loader: griffe.GriffeLoader) -> None:
    """Hide a re-exported object in its defining module (it is documented where exported)."""
    for module in _modules(pkg):
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


def _rewrite_roles(obj: griffe.Object, packages: list[str], seen: set[str]) -> None:
    """Rewrite the Sphinx roles of ``obj``'s docstring and its members' (see the module doc)."""
    if obj.path in seen:
        return
    seen.add(obj.path)
    if obj.docstring is not None:
        text = _ROLE.sub(lambda m: _role_html(obj, m, packages), obj.docstring.value)
        obj.docstring.value = _LITERAL_ALONE.sub("", _LITERAL_END.sub(r"\1:\n", text))
    for member in obj.members.values():
        if not member.is_alias:
            _rewrite_roles(member, packages, seen)  # type: ignore[arg-type]


def _exists(obj: griffe.Object, path: str) -> bool:
    """Whether ``path`` names an object of the loaded packages (a class's inherited members
    and instance attributes included)."""
    collection = obj.modules_collection
    try:
        collection.get_member(path)
    except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError):
        pass
    else:
        return True
    owner_path, _, name = path.rpartition(".")
    try:
        owner = collection.get_member(owner_path)
        if not owner.is_class:
            return False
        classes = [owner, *owner.mro()]
    except (KeyError, ValueError, AttributeError, griffe.AliasResolutionError):
        return False
    assigned = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?=[^=]")
    return any(name in c.members or assigned.search(c.source) for c in classes)


def _resolve(obj: griffe.Object, name: str, packages: list[str]) -> str | None:
    """The full path ``name`` means in ``obj``'s scope (classes: their bases too), or None."""
    name = name.lstrip(".")
    if name.split(".", 1)[0] in packages:
        return name
    head, _, rest = name.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        candidates = [scope]
        if scope.is_class:
            with contextlib.suppress(ValueError, griffe.AliasResolutionError):
                candidates += scope.mro()  # type: ignore[attr-defined]
        for owner in candidates:
            if owner.is_class and _exists(owner, f"{owner.path}.{head}"):
                return f"{owner.path}.{name}"
            member = owner.members.get(head)
            if member is not None:
                base = member.target_path if member.is_alias else member.path  # type: ignore[union-attr]
                return f"{base}.{rest}" if rest else base
        try:
            full = scope.resolve(head)
        except griffe.NameResolutionError:
            scope = scope.parent
            continue
        return f"{full}.{rest}" if rest else full
    return None


def _role_html(obj: griffe.Object, match: re.Match[str], packages: list[str]) -> str:
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
    full = _resolve(obj, target, packages)
    top = (full or target).lstrip(".").split(".", 1)[0]
    if top in packages:
        if full is not None and _exists(obj, full):
            return f'<autoref identifier="{full}" optional>{code}</autoref>'
    elif full is not None or top in sys.stdlib_module_names or importlib.util.find_spec(top):
        return code  # an external name: torch, transformers, the standard library
    where = f"{_relative(obj.filepath)}:{obj.docstring.lineno if obj.docstring else '?'}"
    griffe.logger.warning(
        f"{where}: the docstring of {obj.path} refers to {match.group(0)}, which names "
        "nothing in the documented packages: fix the name (the full path, e.g. "
        ":class:`rl_core.interfaces.Generator`, always resolves)"
    )
    return code


def _relative(path: Path | list[Path]) -> str:
    """``path`` relative to the working directory when it is under it."""
    if isinstance(path, list):
        path = path[0]
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
