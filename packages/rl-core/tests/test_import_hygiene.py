"""rl-core installs and imports with torch and numpy only: no megatron, sglang, ray or
transformers at import time (DESIGN §2). Builds the real wheel and installs it into an empty
virtual environment."""

from __future__ import annotations

import json
import subprocess
import sys
import venv
from pathlib import Path

PKG = Path(__file__).resolve().parents[1]
FORBIDDEN = ["megatron", "sglang", "ray", "transformers", "vllm", "tokenizers", "safetensors"]

CHECK = r"""
import json, sys
import rl_core, rl_core.types, rl_core.interfaces, rl_core.errors, rl_core.config
import rl_core.registry, rl_core.batching, rl_core.algorithms, rl_core.testing
import rl_core.reference  # the lazy package itself must not pull transformers in
bad = sorted(m for m in sys.modules if m.split(".")[0] in %r)
print(json.dumps({"version": rl_core.__version__, "forbidden": bad}))
"""


def test_wheel_imports_without_heavy_dependencies(tmp_path):
    wheel_dir = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheel_dir), str(PKG)],
        check=True,
    )
    (wheel,) = wheel_dir.glob("rl_core-*.whl")
    env_dir = tmp_path / "env"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # torch pinned to the CPU build (an open range resolves to a CUDA build of several GB).
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "torch==2.13.0", "numpy", f"{wheel}"],
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
    # And the environment really is minimal: transformers is not even installed there.
    probe = subprocess.run(
        [str(py), "-c", "import transformers"], capture_output=True, cwd=tmp_path
    )
    assert probe.returncode != 0
