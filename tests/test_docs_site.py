"""The API reference site (mkdocs.yml, docs/reference/): it builds with ``mkdocs build --strict``
(no warning: no broken link, no unknown cross-reference, no docstring griffe cannot parse), every
package's page documents each name of its ``__all__``, and every public module has its ``:::``
directive on its package's page (a module added without one fails here, not silently)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# import name -> source root of its distribution
PACKAGES = {
    "rl_core": "packages/rl-core/src",
    "rl_hf": "packages/rl-hf/src",
    "rl_agents": "packages/rl-agents/src",
    "rl_buffer": "packages/rl-buffer/src",
    "rl_weightsync": "packages/rl-weightsync/src",
    "rl_sglang": "packages/rl-sglang/src",
    "rl_megatron": "packages/rl-megatron/src",
    "rl_trainer": "apps/trainer/src",
}

# A few names per package that must be rendered, including ones only a submodule exports.
KNOWN = {
    "rl_core": ["rl_core.RLError", "rl_core.interfaces.Generator", "rl_core.types.Rollout"],
    "rl_hf": ["rl_hf.HFPolicy", "rl_hf.HFGenerator", "rl_hf.build_tiny_model"],
    "rl_agents": ["rl_agents.AgentServer", "rl_agents.trajectory.TrajectoryBuilder"],
    "rl_buffer": ["rl_buffer.GroupBuffer", "rl_buffer.schedule_step"],
    "rl_weightsync": ["rl_weightsync.DiskDeltaTransport", "rl_weightsync.BroadcastTransport"],
    "rl_sglang": ["rl_sglang.SGLangGenerator", "rl_sglang.SGLangTopology"],
    "rl_megatron": ["rl_megatron.MegatronPolicy", "rl_megatron.MegatronCritic"],
    "rl_trainer": ["rl_trainer.config.TrainerConfig", "rl_trainer.ray.RayRuntime"],
}

_TOOLS = ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python", "material")


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported (found without importing it; a missing parent too)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def _static_all(init: Path) -> list[str]:
    """The names of ``__all__`` in ``init``, read without importing it."""
    for node in ast.parse(init.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return [n for n in ast.literal_eval(node.value) if n != "__version__"]
    return []


def _public_modules(pkg: str, src: str) -> list[str]:
    """Every importable module of ``pkg`` with no underscore-led part (``version`` aside)."""
    root = ROOT / src
    out = []
    for path in sorted((root / pkg).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if parts[-1] == "version" or any(p.startswith("_") for p in parts):
            continue
        # a module counts only inside packages (a template or a sitecustomize folder does not)
        folders = parts if path.name == "__init__.py" else parts[:-1]
        if all(
            (root.joinpath(*folders[:i]) / "__init__.py").exists()
            for i in range(1, len(folders) + 1)
        ):
            out.append(".".join(parts))
    return out


def _extension():
    """The griffe extension of mkdocs.yml, loaded from its file."""
    pytest.importorskip("griffe", reason="the docs tools are not installed (griffe)")
    path = ROOT / "docs" / "reference" / "_griffe_ext.py"
    spec = importlib.util.spec_from_file_location("_griffe_ext", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_extension_links_roles_and_flags_broken_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    """On a small package: a role that resolves becomes an autoref to the object's full path, an
    external one (the standard library) plain code, and one that names nothing a warning naming
    the file and the role (what makes ``mkdocs build --strict`` fail); reST's ``text::`` literal
    marker becomes ``text:``; a lazily imported ``__all__`` name becomes a package alias, and a
    re-exported object is documented once."""
    ext = _extension()  # skips without griffe
    import griffe

    pkg = tmp_path / "pkg_a"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        '"""Package A: :class:`~pkg_a.core.Thing`, :meth:`Thing.run`, :func:`os.path.join`.\n\n'
        'Use it::\n\n    Thing().run()\n"""\n'
        "from pkg_a.core import Thing\n"
        '__all__ = ["Lazy", "Thing"]\n'
        '_LAZY = {"Lazy": "pkg_a.lazy"}\n'
    )
    (pkg / "core.py").write_text(
        '__all__ = ["Thing"]\n\n\nclass Thing:\n'
        '    """A thing; see :func:`removed_helper` and :attr:`size`."""\n\n'
        "    def __init__(self):\n        self.size = 1\n\n"
        '    def run(self):\n        """Run it."""\n'
    )
    (pkg / "lazy.py").write_text('class Lazy:\n    """Imported on first use."""\n')
    loader = griffe.GriffeLoader(
        search_paths=[tmp_path],
        allow_inspection=False,
        extensions=griffe.load_extensions(ext.PublicAPI(packages=["pkg_a"])),
    )
    with caplog.at_level("WARNING"):
        top = loader.load("pkg_a")
    doc = top.docstring.value
    assert '<autoref identifier="pkg_a.core.Thing" optional><code>Thing</code></autoref>' in doc
    assert '<autoref identifier="pkg_a.core.Thing.run" optional>' in doc
    assert "<code>os.path.join</code>" in doc and ":func:" not in doc
    assert "Use it:\n\n    Thing().run()" in doc  # reST's literal marker "::" dropped
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "core.py" in warnings[0] and ":func:`removed_helper`" in warnings[0]
    assert top.members["Lazy"].is_alias and top.members["Lazy"].target_path == "pkg_a.lazy.Lazy"
    assert top.members["Thing"].is_public
    assert not top.members["core"].members["Thing"].is_public


def test_every_public_module_has_a_reference_directive():
    """Each public module is rendered: ``::: module`` on its package's reference page."""
    missing = []
    for pkg, src in PACKAGES.items():
        page = (ROOT / "docs" / "reference" / f"{pkg}.md").read_text(encoding="utf-8")
        directives = set(re.findall(r"^::: ([\w.]+)\s*$", page, flags=re.M))
        missing += [
            f"docs/reference/{pkg}.md: add the line '::: {module}'"
            for module in _public_modules(pkg, src)
            if module not in directives
        ]
    assert not missing, "public modules missing from the API reference:\n" + "\n".join(missing)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built by ``mkdocs build --strict`` from the checkout (once for this module)."""
    absent = [name for name in _TOOLS if not _installed(name)]
    if absent:
        pytest.skip(
            f"the docs tools are not installed ({', '.join(absent)}): "
            'pip install "mkdocs>=1.6,<2" "mkdocs-material>=9.5,<10" "mkdocstrings[python]>=1.0,<2"'
        )
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q"]
    cmd += ["-f", str(ROOT / "mkdocs.yml"), "-d", str(out)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert "WARNING" not in proc.stderr, proc.stderr
    print(f"mkdocs build --strict: {seconds:.1f} s")
    return out


@pytest.mark.parametrize("pkg", list(PACKAGES))
def test_reference_page_documents_the_public_api(site: Path, pkg: str):
    """The page of ``pkg`` has an anchor for each name of the package's ``__all__`` (lazily
    imported names included) and for a few known names of its modules; the docstrings' Sphinx
    roles are rendered (as links or code), not shown as literal ``:class:`...```."""
    page = site / "reference" / f"{pkg}.html"
    assert page.is_file(), f"no reference page {page.name} in the built site"
    html = page.read_text(encoding="utf-8")
    names = [f"{pkg}.{n}" for n in _static_all(ROOT / PACKAGES[pkg] / pkg / "__init__.py")]
    missing = [n for n in names + KNOWN[pkg] if f'id="{n}"' not in html]
    assert not missing, f"{page.name} does not document: {missing}"
    literal = re.findall(r":(?:class|func|meth|mod|attr):`", html)
    assert not literal, f"{page.name} shows {len(literal)} Sphinx roles as literal text"


def _inventory(site: Path) -> set[str]:
    """The object names of the site's ``objects.inv`` (every rendered object, under its full
    path and, for a re-exported one, its defining module's path too)."""
    data = (site / "objects.inv").read_bytes()
    start = 0
    for _ in range(4):  # the four header lines of a Sphinx inventory, then zlib
        start = data.index(b"\n", start) + 1
    lines = zlib.decompress(data[start:]).decode("utf-8").splitlines()
    return {line.split(" ", 1)[0] for line in lines if line}


def test_every_public_name_is_documented(site: Path):
    """Every name in the ``__all__`` of every public module is rendered somewhere in the site
    (a public name without a docstring is left out of the pages, so it fails here)."""
    inventory = _inventory(site)
    missing = []
    for pkg, src in PACKAGES.items():
        for module in _public_modules(pkg, src):
            if module not in inventory:
                continue  # not on its page at all: the directive test names it
            path = ROOT / src / module.replace(".", "/")
            source = (
                path.with_suffix(".py")
                if path.with_suffix(".py").exists()
                else path / "__init__.py"
            )
            missing += [
                f"{module}.{name} ({source.relative_to(ROOT)}): add a docstring"
                for name in _static_all(source)
                if f"{module}.{name}" not in inventory
            ]
    assert not missing, "public names not in the API reference:\n" + "\n".join(missing)


def test_cross_references_link_across_pages(site: Path):
    """A docstring's role naming another package's object becomes a link to that page's anchor
    (rl_hf's generator docs name rl_core's Generator interface)."""
    html = (site / "reference" / "rl_hf.html").read_text(encoding="utf-8")
    assert re.search(r'href="rl_core\.html#rl_core\.interfaces\.Generator"', html), (
        "no link from rl_hf's page to rl_core.interfaces.Generator"
    )


def test_guides_are_in_the_site(site: Path):
    """The docs/ guides are pages of the site, and the landing page links to them."""
    index = (site / "index.html").read_text(encoding="utf-8")
    for guide in sorted((ROOT / "docs").glob("*.md")):
        if guide.name == "index.md":
            continue
        built = site / f"{guide.stem}.html"
        assert built.is_file(), f"docs/{guide.name} is not in the site"
        assert f'href="{guide.stem}.html"' in index, f"index.md does not link docs/{guide.name}"
