"""rl-core installs and imports with torch and numpy only: no megatron, sglang, ray,
transformers or aiohttp at import time (DESIGN §2). Builds the real wheel, checks what it
declares, and installs it into an empty virtual environment."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

PKG = Path(__file__).resolve().parents[1]
FORBIDDEN = [
    "megatron",
    "sglang",
    "ray",
    "transformers",
    "vllm",
    "tokenizers",
    "safetensors",
    "aiohttp",
    "rl_hf",
    "rl_agents",
]

CHECK = r"""
import json, pkgutil, sys
import rl_core, rl_core.types, rl_core.interfaces, rl_core.errors, rl_core.config
import rl_core.registry, rl_core.batching, rl_core.algorithms, rl_core.testing, rl_core.rewards
import rl_core.critics, rl_core.evaluation, rl_core.locations, rl_core.serde
bad = sorted(m for m in sys.modules if m.split(".")[0] in %r)
subpackages = sorted(m.name for m in pkgutil.iter_modules(rl_core.__path__))
print(json.dumps({"version": rl_core.__version__, "forbidden": bad, "modules": subpackages}))
"""


@pytest.fixture(scope="module")
def wheel(release_builds) -> Path:
    """rl-core's wheel, built from this checkout's sdist like a release (the root conftest's
    ``release_builds``: shared with tests/test_packaging.py, built once per session)."""
    path = release_builds(PKG)[1]
    assert path.name.startswith("rlpost_core-") and path.suffix == ".whl", path
    return path


def test_wheel_declares_only_numpy_and_torch(wheel):
    """Every unconditional requirement of the wheel is numpy or torch (extras aside)."""
    with zipfile.ZipFile(wheel) as zf:
        (meta_name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        meta = zf.read(meta_name).decode()
        names = zf.namelist()
    requires = [
        Requirement(line.split(":", 1)[1].strip())
        for line in meta.splitlines()
        if line.startswith("Requires-Dist:")
    ]
    required = sorted(r.name for r in requires if r.marker is None)
    assert required == ["numpy", "torch"]
    extras = [
        line.split(":", 1)[1].strip()
        for line in meta.splitlines()
        if line.startswith("Provides-Extra:")
    ]
    assert "hf" not in extras and "agents" not in extras
    # The batteries live in their own distributions, not in rl-core's wheel.
    for moved in ("reference", "agents", "tools", "examples", "trajectory.py"):
        assert not any(n.startswith(f"rl_core/{moved}") for n in names), moved


def test_wheel_imports_without_heavy_dependencies(wheel, tmp_path, link_installed):
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # torch 2.13.0 (the CPU build: an open range resolves to a CUDA build of several GB) and
    # numpy, with their own requirements, hard-linked from this test's venv (the locked versions;
    # seconds instead of pip unpacking torch again); pip then installs only the wheel, and
    # whatever else it declares (nothing: test_wheel_declares_only_numpy_and_torch).
    (site,) = env_dir.glob("lib/python*/site-packages")
    for root in ("torch", "numpy"):
        source = Path(importlib.metadata.distribution(root).locate_file(""))
        link_installed(source, site, root, set())
    subprocess.run(
        [
            str(py),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-compile",
            "torch==2.13.0",
            "numpy",
            f"{wheel}",
        ],
        check=True,
    )
    out = subprocess.run(
        [str(py), "-c", CHECK % (FORBIDDEN,)],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["forbidden"] == []
    assert result["version"].startswith("0.")
    assert not {"reference", "agents", "tools", "examples", "trajectory"} & set(result["modules"])
    # And the environment really is minimal: transformers and aiohttp are not even installed.
    for heavy in ("transformers", "aiohttp"):
        probe = subprocess.run(
            [str(py), "-c", f"import {heavy}"], capture_output=True, cwd=tmp_path
        )
        assert probe.returncode != 0, heavy
