"""Make the repository's packages importable, entry points included, without installing them.

``make test-gpu`` runs on GPU hosts that have torch but no virtual environment of this
repository. The sources are found through ``PYTHONPATH`` (``packages/*/src``,
``apps/*/src``), but the component registry (:mod:`rl_core.registry`) finds backends through
entry points, which live in installed distributions' metadata. This script writes, into the
directory given (put it on ``PYTHONPATH`` too), one ``<name>-<version>.dist-info`` per
``pyproject.toml`` with its ``METADATA`` and ``entry_points.txt``, which
``importlib.metadata`` discovers like an installed package. It needs only the standard library.

    python3 scripts/gpu_site.py .gpu-site
"""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _version(project_dir: Path, data: dict) -> str:
    """The version from ``[tool.hatch.version] path`` (``__version__ = "x"``), else 0.0.0."""
    rel = data.get("tool", {}).get("hatch", {}).get("version", {}).get("path")
    if rel and (project_dir / rel).is_file():
        found = re.search(r"""__version__\s*=\s*["']([^"']+)""", (project_dir / rel).read_text())
        if found:
            return found.group(1)
    return "0.0.0"


def main(site: Path) -> None:
    """Write one dist-info directory per project under ``packages/`` and ``apps/``."""
    site.mkdir(parents=True, exist_ok=True)
    for old in [*site.glob("rl_*.dist-info"), *site.glob("rlpost_*.dist-info")]:
        shutil.rmtree(old)
    for pyproject in sorted(
        [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
    ):
        data = tomllib.loads(pyproject.read_text())
        project = data["project"]
        name = project["name"]
        version = _version(pyproject.parent, data)
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = []
        for group, entries in project.get("entry-points", {}).items():
            lines.append(f"[{group}]")
            lines.extend(f"{key} = {value}" for key, value in entries.items())
            lines.append("")
        scripts = project.get("scripts", {})
        if scripts:
            lines.append("[console_scripts]")
            lines.extend(f"{key} = {value}" for key, value in scripts.items())
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-site"))
