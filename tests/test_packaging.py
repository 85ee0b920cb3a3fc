"""The published distributions, built the way a release builds them (``python -m build``: sdist,
then the wheel from the sdist) and checked the way the index checks them (``twine check
--strict``): names that are ours, LICENSE and ``py.typed`` in every archive, version ranges
rather than exact pins, and installing the wheels into a venv that already holds another torch
from the allowed range leaves that torch in place (docs/versioning.md).

Needs the ``dev`` extra of rlpost-core (``build``, ``twine``). The distribution names were
checked free on PyPI with ``pip index versions NAME`` (2026-11-29): ``rlpost`` and all nine
``rlpost-*`` names are unregistered, while ``rl-agents`` (an unrelated 0.1.x that satisfied
``rl-agents>=0.1,<0.2``) and ``rlstack`` are taken.
"""

from __future__ import annotations

import email.parser
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECTS = sorted(
    p.parent for p in [*ROOT.glob("packages/*/pyproject.toml"), *ROOT.glob("apps/*/pyproject.toml")]
)
PREFIX = "rlpost-"
# Distribution name -> import name. Folders and import names keep the rl- / rl_ spelling.
DISTRIBUTIONS = {
    "rlpost-core": "rl_core",
    "rlpost-hf": "rl_hf",
    "rlpost-agents": "rl_agents",
    "rlpost-buffer": "rl_buffer",
    "rlpost-weightsync": "rl_weightsync",
    "rlpost-sglang": "rl_sglang",
    "rlpost-megatron": "rl_megatron",
    "rlpost-trainer": "rl_trainer",
    "rlpost-tinker": "rl_tinker",
}
# Names the project must never require again: PyPI's rl-agents is someone else's project, and the
# other old names are unregistered, so anyone could publish them.
OLD_NAMES = {f"rl-{n.removeprefix(PREFIX)}" for n in DISTRIBUTIONS}
LICENSE = (ROOT / "LICENSE").read_bytes()
# A torch release inside the range of rlpost-core / rlpost-hf other than the CPU build that
# constraints.txt pins; it lies on the local disk of this project's machines (a CUDA build that
# also runs on a CPU).
OTHER_TORCH = "2.14.1"


def _pyproject(project: Path) -> dict:
    return tomllib.loads((project / "pyproject.toml").read_text())


def _constraints() -> dict[str, str]:
    """``name -> exact version`` of constraints.txt (the locked CPU environment)."""
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


@pytest.fixture(scope="module")
def dists(release_builds) -> Path:
    """The sdist and wheel of every distribution in one folder: each wheel built from its sdist in
    an isolated build environment, once per session (the root conftest's ``release_builds``)."""
    for tool in ("build", "twine"):
        assert importlib.util.find_spec(tool), (
            f"{tool} is missing: the release checks need pip install 'rlpost-core[dev]'"
        )
    for project in PROJECTS:
        release_builds(project)
    return release_builds.out


def _wheels(dists: Path) -> dict[str, Path]:
    wheels = {canonicalize_name(p.name.split("-")[0]): p for p in dists.glob("*.whl")}
    assert set(wheels) == set(DISTRIBUTIONS), sorted(wheels)
    return wheels


def _sdists(dists: Path) -> dict[str, Path]:
    sdists = {canonicalize_name(p.name.rsplit("-", 1)[0]): p for p in dists.glob("*.tar.gz")}
    assert set(sdists) == set(DISTRIBUTIONS), sorted(sdists)
    return sdists


def _wheel_metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        return email.parser.Parser().parsestr(zf.read(name).decode())


def test_distribution_names_are_ours_and_requirements_use_them():
    """Every project is published under the free ``rlpost-`` prefix, and no requirement of any
    project (dependencies or extras) names an old ``rl-*`` distribution."""
    names = {_pyproject(p)["project"]["name"] for p in PROJECTS}
    assert names == set(DISTRIBUTIONS)
    for project in PROJECTS:
        meta = _pyproject(project)["project"]
        requirements = [*meta.get("dependencies", [])]
        for extra in meta.get("optional-dependencies", {}).values():
            requirements += extra
        for text in requirements:
            name = canonicalize_name(Requirement(text).name)
            assert name not in OLD_NAMES, f"{project.name}/pyproject.toml requires {text!r}"
            if name.startswith(PREFIX):
                assert name in DISTRIBUTIONS, f"{project.name}: unknown distribution {text!r}"


def test_twine_check_strict_passes(dists):
    """What the index would reject (metadata, README rendering) fails here first."""
    files = sorted(str(p) for p in dists.iterdir())
    assert len(files) == 2 * len(DISTRIBUTIONS), files
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *files],
        capture_output=True,
        text=True,
        env={**os.environ, "NO_COLOR": "1"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == len(files), done.stdout


def test_every_wheel_ships_license_py_typed_and_metadata(dists):
    for dist, wheel in _wheels(dists).items():
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
            licenses = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
            assert len(licenses) == 1, (dist, names)
            assert zf.read(licenses[0]) == LICENSE, dist
            assert f"{DISTRIBUTIONS[dist]}/py.typed" in names, dist
        meta = _wheel_metadata(wheel)
        assert meta["Name"] == dist
        assert meta["License-Expression"] == "Apache-2.0", dist
        assert "Typing :: Typed" in meta.get_all("Classifier"), dist
        urls = {u.split(",", 1)[0] for u in meta.get_all("Project-URL")}
        assert {"Homepage", "Documentation", "Changelog", "Issues"} <= urls, (dist, urls)


def test_every_sdist_ships_license(dists):
    for dist, sdist in _sdists(dists).items():
        with tarfile.open(sdist) as tf:
            (top,) = {n.split("/", 1)[0] for n in tf.getnames()}
            member = tf.extractfile(f"{top}/LICENSE")
            assert member is not None and member.read() == LICENSE, dist
            assert f"{top}/src/{DISTRIBUTIONS[dist]}/py.typed" in tf.getnames(), dist


def test_metadata_has_ranges_not_pins_and_the_lock_satisfies_them(dists):
    """No requirement of a published wheel is an exact ``==``/``===`` pin (that replaced a user's
    torch); torch is a range below the next major; and every version constraints.txt locks
    satisfies the ranges, so `make setup` installs a combination the metadata allows."""
    pins = _constraints()
    torch_ranges = {}
    for dist, wheel in _wheels(dists).items():
        for text in _wheel_metadata(wheel).get_all("Requires-Dist") or []:
            req = Requirement(text)
            exact = [s for s in req.specifier if s.operator in ("==", "===")]
            assert not exact, (
                f"{dist} pins {text!r}: use a range (the exact pin is constraints.txt's)"
            )
            name = canonicalize_name(req.name)
            if name in pins:
                assert req.specifier.contains(pins[name], prereleases=True), (
                    f"{dist} requires {text!r} but constraints.txt locks {name}=={pins[name]}"
                )
            if name == "torch":
                torch_ranges[dist] = req.specifier
    assert set(torch_ranges) == {"rlpost-core", "rlpost-hf"}, torch_ranges
    for dist, spec in torch_ranges.items():
        assert not spec.contains("3.0.0"), (dist, spec)
        assert spec.contains(OTHER_TORCH), (dist, spec)
        assert Version(pins["torch"]) != Version(OTHER_TORCH)


# rl-weightsync, rl-buffer and rl-core tests that need no other backend (no transformers, SGLang,
# megatron, pyarrow or datasets): the disk and in-process transports, the collective broadcast
# between processes (gloo), the codec, balancing, the buffer, losses and advantages.
OWN_TESTS = [
    "packages/rl-weightsync/tests/test_disk_delta.py",
    "packages/rl-weightsync/tests/test_disk_full.py",
    "packages/rl-weightsync/tests/test_inprocess.py",
    "packages/rl-weightsync/tests/test_codec.py",
    "packages/rl-weightsync/tests/test_broadcast.py",
    "packages/rl-buffer/tests/test_balance.py",
    "packages/rl-buffer/tests/test_buffer.py",
    "packages/rl-core/tests/test_algorithms_losses.py",
    "packages/rl-core/tests/test_algorithms_advantages.py",
]

PROBE = (
    "import json, sys, torch, rl_core, rl_weightsync, rl_buffer\n"
    "print(json.dumps({'torch': torch.__version__, 'files': "
    "[rl_core.__file__, rl_weightsync.__file__, rl_buffer.__file__]}))\n"
)


def _sglang_site_packages() -> Path | None:
    """site-packages of the SGLang venv that ``make test`` sets up (``make sglang-env``), if it is
    there and holds torch ``OTHER_TORCH``; else None."""
    try:
        from rl_sglang._cpu_support import default_python
    except ImportError:
        return None
    sites = list(default_python().parent.parent.glob("lib/python*/site-packages"))
    if len(sites) != 1 or not (sites[0] / f"torch-{OTHER_TORCH}.dist-info").is_dir():
        return None
    return sites[0]


@pytest.mark.slow
def test_installing_the_wheels_keeps_the_users_torch(dists, tmp_path, link_installed):
    """A venv that already holds torch 2.14.1 (not the locked 2.13.0): pip installs the wheels of
    rlpost-core[test], rlpost-weightsync and rlpost-buffer from the build, keeps that torch (with
    the old ``torch==2.13.0`` pin pip replaced it), and those packages' own tests pass there."""
    import json

    started = time.monotonic()
    env_dir = tmp_path / "user-env"
    try:
        venv.create(env_dir, with_pip=True)
        py = str(env_dir / "bin" / "python")
        # The user's stack: torch 2.14.1; everything else at the locked versions, torch excluded.
        others = tmp_path / "constraints-without-torch.txt"
        others.write_text("".join(f"{n}=={v}\n" for n, v in _constraints().items() if n != "torch"))
        clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PIP_CONSTRAINT")}

        def pip(*args: str) -> str:
            done = subprocess.run(
                [py, "-m", "pip", "install", "--no-compile", "-c", str(others), *args],
                capture_output=True,
                text=True,
                env=clean,
            )
            assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
            return done.stdout

        # torch 2.14.1 (a CUDA build: ~5 GB with its nvidia-* libraries) is the one the SGLang
        # venv of `make test` holds: its files are hard-linked from there (seconds instead of
        # ~30 s of unpacking); its other requirements are left to pip, at the locked versions.
        # pip then installs only what is missing (everything, without that venv).
        sglang_site = _sglang_site_packages()
        if sglang_site is not None:
            (site,) = env_dir.glob("lib/python*/site-packages")
            locked = set(_constraints()) - {"torch"}
            assert link_installed(sglang_site, site, "torch", locked) > 1000
        pip("-q", f"torch=={OTHER_TORCH}")
        out = pip(
            "--find-links", str(dists), "rlpost-core[test]", "rlpost-weightsync", "rlpost-buffer"
        )
        assert "Uninstalling torch" not in out, out[-3000:]
        probe = subprocess.run(
            [py, "-c", PROBE], capture_output=True, text=True, check=True, cwd=tmp_path, env=clean
        )
        seen = json.loads(probe.stdout.strip().splitlines()[-1])
        assert seen["torch"].split("+")[0] == OTHER_TORCH, seen
        # The packages come from the wheels in that venv, not from this checkout's sources.
        assert all(f.startswith(str(env_dir)) for f in seen["files"]), seen
        tests = subprocess.run(
            [
                py,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-m",
                "not slow and not long and not gpu",
                # The same property-test examples on every run: a failure here reproduces.
                "--hypothesis-seed=0",
                "--rootdir",
                str(ROOT),
                "-c",
                str(ROOT / "pyproject.toml"),
                *(str(ROOT / t) for t in OWN_TESTS),
            ],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            env={**clean, "OMP_NUM_THREADS": "1"},
        )
        assert tests.returncode == 0, tests.stdout[-5000:] + tests.stderr[-2000:]
        assert " passed" in tests.stdout and " failed" not in tests.stdout, tests.stdout[-2000:]
    finally:
        # ~5.5 GB (the CUDA build and its libraries): not left in pytest's kept tmp folders.
        shutil.rmtree(env_dir, ignore_errors=True)
    print(f"another torch kept: {time.monotonic() - started:.0f} s")
