"""scripts/wheelhouse.sh, the cached wheelhouse behind `make setup`, on a tiny offline index.

The "network" is a file:// index of hand-made wheels (pip's configuration is switched off),
so each test runs in seconds and needs no index: the cold path fills the wheelhouse and installs
from it, a second install finds it with the index gone, a changed constraints file is a new key,
and a broken or unfinished wheelhouse is never trusted.
"""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
import venv
import zipfile
from pathlib import Path

import pip
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "wheelhouse.sh"
MARKER = ".rl-wheels-complete"
NAMES = ("whtiny-a", "whtiny-b", "whtiny-local")
EXPECTED = ["whtiny_a==1.0", "whtiny_b==1.0", "whtiny_local==1.0"]

# A PEP 517 backend in the local project's own folder (no build requirements, so nothing is
# fetched): `pip wheel` builds its wheel, which the wheelhouse must not keep.
BACKEND = """
import base64, hashlib, pathlib, zipfile

def _wheel(directory, files):
    files = {**files, "whtiny_local-1.0.dist-info/METADATA":
             "Metadata-Version: 2.1\\nName: whtiny-local\\nVersion: 1.0\\n",
             "whtiny_local-1.0.dist-info/WHEEL":
             "Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n"}
    lines = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        lines.append(f"{path},sha256={digest.decode()},{len(text.encode())}")
    lines.append("whtiny_local-1.0.dist-info/RECORD,,")
    name = "whtiny_local-1.0-py3-none-any.whl"
    with zipfile.ZipFile(pathlib.Path(directory) / name, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr("whtiny_local-1.0.dist-info/RECORD", "\\n".join(lines) + "\\n")
    return name

def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _wheel(wheel_directory, {"whtiny_local.py": "X = 1\\n"})

def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    here = str(pathlib.Path(__file__).resolve().parent)
    return _wheel(wheel_directory, {"whtiny_local.pth": here + "\\n"})
"""


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = ()) -> None:
    """Write a pure-Python wheel ``name`` ``version`` (one module) depending on ``requires``."""
    dist = f"{name}-{version}.dist-info"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name}.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n{meta}",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
        f"{len(text.encode())}"
        for path, text in files.items()
    ]
    with zipfile.ZipFile(folder / f"{name}-{version}-py3-none-any.whl", "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
        zf.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory) -> Path:
    """One venv for every test of this module, holding a copy of this environment's pip (the
    version `make setup` installs; copying it takes a fraction of ensurepip's seconds)."""
    folder = tmp_path_factory.mktemp("wheelhouse-venv")
    venv.create(folder, with_pip=False)
    [site] = folder.glob("lib/python3*/site-packages")
    source = Path(pip.__file__).resolve().parent
    shutil.copytree(source, site / "pip")
    [dist_info] = source.parent.glob(f"pip-{pip.__version__}.dist-info")
    shutil.copytree(dist_info, site / dist_info.name)
    return folder / "bin" / "python"


@pytest.fixture
def setup(tmp_path, venv_python):
    """An index of wheels, a local project, a constraints file and a runner of the script."""
    index = tmp_path / "index"
    (index / "files").mkdir(parents=True)
    _wheel(index / "files", "whtiny_a", "1.0", ("whtiny-b",))
    _wheel(index / "files", "whtiny_b", "1.0")
    _wheel(index / "files", "whtiny_b", "2.0")
    for project in ("whtiny-a", "whtiny-b"):  # a PEP 503 simple index over those files
        page = index / "simple" / project
        page.mkdir(parents=True)
        links = [
            f'<a href="../../files/{w.name}">{w.name}</a>'
            for w in sorted((index / "files").glob(f"{project.replace('-', '_')}-*.whl"))
        ]
        (page / "index.html").write_text("<html><body>" + "".join(links) + "</body></html>")
    local = tmp_path / "local"
    local.mkdir()
    (local / "backend.py").write_text(BACKEND)
    (local / "pyproject.toml").write_text(
        '[project]\nname = "whtiny-local"\nversion = "1.0"\n\n'
        '[build-system]\nrequires = []\nbuild-backend = "backend"\nbackend-path = ["."]\n'
    )
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("whtiny-b==1.0\n")
    home = tmp_path / "wheels"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {
        "PIP_CONFIG_FILE": os.devnull,  # no machine configuration: only what the test gives
        "PIP_INDEX_URL": (index / "simple").as_uri(),  # the "network"
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "RL_WHEELS_HOME": str(home),
    }
    step = ["-c", str(constraints), "--no-build-isolation", "whtiny-a", "-e", str(local)]

    def run() -> subprocess.CompletedProcess:
        proc = subprocess.run(
            ["bash", SCRIPT, venv_python, *step], env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def installed() -> list[str]:
        """``name==version`` of each whtiny distribution in the venv (read from its dist-info)."""
        site = next(venv_python.parent.parent.glob("lib/python3*/site-packages"))
        return sorted(
            p.name.removesuffix(".dist-info").replace("-", "==")
            for p in site.glob("whtiny*.dist-info")
        )

    def uninstall() -> None:
        subprocess.run(
            [venv_python, "-m", "pip", "uninstall", "-q", "-y", *NAMES],
            env=env,
            check=True,
            capture_output=True,
        )

    uninstall()  # the module's venv holds what the previous test installed

    def wheelhouses() -> list[Path]:
        return sorted(p for p in home.iterdir() if not p.name.startswith("."))

    return {
        "index": index,
        "constraints": constraints,
        "home": home,
        "run": run,
        "installed": installed,
        "uninstall": uninstall,
        "wheelhouses": wheelhouses,
    }


def test_cold_then_warm_install_the_same_set_and_warm_needs_no_index(setup, tmp_path):
    cold = setup["run"]()
    assert "no cached wheels" in cold.stdout
    after_cold = setup["installed"]()
    assert after_cold == EXPECTED  # the constraint chose b 1.0
    [wheelhouse] = setup["wheelhouses"]()
    assert (wheelhouse / MARKER).is_file()
    assert sorted(p.name for p in wheelhouse.glob("*.whl")) == [
        "whtiny_a-1.0-py3-none-any.whl",
        "whtiny_b-1.0-py3-none-any.whl",  # only what the step resolved to, not b 2.0
    ]  # and not the local project's wheel, which `pip wheel` built
    assert not [p for p in setup["home"].iterdir() if p.name.startswith(".tmp")]

    setup["uninstall"]()
    setup["index"].rename(tmp_path / "offline")  # the "network" is gone
    warm = setup["run"]()
    assert "installing from" in warm.stdout and str(wheelhouse) in warm.stdout
    assert setup["installed"]() == after_cold

    # A changed constraints file is another key: a new wheelhouse, resolved afresh.
    (tmp_path / "offline").rename(setup["index"])
    setup["uninstall"]()
    setup["constraints"].write_text("whtiny-b==2.0\n")
    assert "no cached wheels" in setup["run"]().stdout
    assert len(setup["wheelhouses"]()) == 2
    assert setup["installed"]() == ["whtiny_a==1.0", "whtiny_b==2.0", "whtiny_local==1.0"]


def test_a_broken_or_unfinished_wheelhouse_is_never_trusted(setup):
    setup["run"]()
    setup["uninstall"]()
    [wheelhouse] = setup["wheelhouses"]()
    wheel = wheelhouse / "whtiny_a-1.0-py3-none-any.whl"
    wheel.write_bytes(b"not a zip")
    proc = setup["run"]()
    assert "falling back to the networked install" in proc.stderr
    assert setup["installed"]() == EXPECTED
    assert not wheelhouse.exists()  # discarded: the next run rebuilds it

    # What a run killed before its rename would look like had it written in place: no marker.
    setup["uninstall"]()
    wheelhouse.mkdir()
    wheel.write_bytes(b"not a zip")
    proc = setup["run"]()
    assert "no cached wheels" in proc.stdout and "falling back" not in proc.stderr
    assert setup["installed"]() == EXPECTED
    assert (wheelhouse / MARKER).is_file() and zipfile.is_zipfile(wheel)
