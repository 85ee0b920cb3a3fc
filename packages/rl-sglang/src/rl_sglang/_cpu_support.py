"""Running SGLang on a machine without a GPU: everything CPU-specific lives here.

SGLang 0.5.23 from PyPI is a CUDA build. It serves on CPU (``--device cpu``, torch-native attention)
when three things hold, all verified on a 2-core AVX2 machine:

- a stub ``libcuda.so.1`` (``cudastub.c`` next to this file, built by
  ``scripts/setup_sglang_env.sh`` with the system ``gcc``) is on ``LD_LIBRARY_PATH``, so the CUDA
  build of ``sgl_kernel`` imports; every driver call returns "no device";
- ``SGLANG_USE_CPU_ENGINE=1`` (otherwise the rotary embedding falls back to ``vllm._custom_ops``);
- ``--max-total-tokens`` is set (otherwise the KV cache is sized from *system RAM*: ~15 GB).

One SGLang code path needs a patch on CPU; :func:`cpu_environment` puts ``cpu_site/`` (its
``sitecustomize.py`` applies it lazily, in every server process) first on ``PYTHONPATH``:

- ``--enable-return-routed-experts`` (mixture-of-experts routing capture) allocates its host buffer
  pinned through ``torch.cuda.cudart()`` and kills a CPU server; the patch allocates it unpinned.
  With it a tiny Qwen3-MoE serves and returns the routing, equal to transformers' router.

``/release_memory_occupation`` calls ``torch.cuda.synchronize`` and kills a CPU server, so the
generator never calls it on CPU. The server's working directory must not contain a ``vllm/``
folder (it would shadow the missing ``vllm`` package); servers run in their own log directory.

The generator uses :func:`cpu_environment` and :func:`cpu_server_args` only when
``SGLangGenerator.Config.device == "cpu"``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rl_core.errors import ConfigError

__all__ = [
    "CPU_DEFAULT_MAX_TOTAL_TOKENS",
    "SGLANG_VERSION",
    "build_stub",
    "cpu_environment",
    "cpu_server_args",
    "cpu_site_dir",
    "default_python",
    "setup_script",
    "sglang_home",
    "stub_dir",
]

SGLANG_VERSION = "0.5.23"
"""The SGLang release the CPU support and the protocol notes were verified on."""
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
"""KV-cache tokens of a CPU server unless ``server_args`` sets ``max_total_tokens``."""

_STUB_SOURCE = Path(__file__).with_name("cudastub.c")


def sglang_home() -> Path:
    """Cache root: ``$RL_SGLANG_HOME`` or ``~/.cache/rl-sglang``."""
    return Path(os.environ.get("RL_SGLANG_HOME") or Path.home() / ".cache" / "rl-sglang")


def default_python() -> Path:
    """Interpreter of the SGLang venv made by ``scripts/setup_sglang_env.sh``."""
    return sglang_home() / f"sglang-{SGLANG_VERSION}" / "bin" / "python"


def setup_script() -> Path:
    """Path of ``setup_sglang_env.sh`` in a source checkout (it is not part of the wheel)."""
    return Path(__file__).resolve().parents[2] / "scripts" / "setup_sglang_env.sh"


def stub_dir() -> Path:
    """Directory holding the stub ``libcuda.so.1``."""
    return sglang_home() / "cudastub"


_STUB_LOCK = threading.Lock()


def build_stub(directory: Path | None = None) -> Path:
    """Build ``libcuda.so.1`` from ``cudastub.c`` with the system ``gcc`` (if missing or stale).

    Returns the directory to put on ``LD_LIBRARY_PATH``. Safe to call from several threads
    (server groups start concurrently) and processes (each writes its own temporary file).
    """
    with _STUB_LOCK:
        return _build_stub(directory)


def _build_stub(directory: Path | None) -> Path:
    out_dir = directory or stub_dir()
    lib = out_dir / "libcuda.so.1"
    if lib.is_file() and lib.stat().st_mtime >= _STUB_SOURCE.stat().st_mtime:
        return out_dir
    gcc = shutil.which("gcc")
    if gcc is None:
        raise ConfigError(
            "SGLangGenerator.Config.device: 'cpu' needs the stub libcuda.so.1, built with gcc, "
            "which is not installed; install gcc or run scripts/setup_sglang_env.sh once."
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"libcuda.so.1.{os.getpid()}.{threading.get_ident()}.tmp")
    subprocess.run([gcc, "-shared", "-fPIC", "-O2", "-o", str(tmp), str(_STUB_SOURCE)], check=True)
    os.replace(tmp, lib)
    return out_dir


def cpu_site_dir() -> Path:
    """Directory whose ``sitecustomize.py`` patches SGLang for CPU (see the module docstring)."""
    return Path(__file__).with_name("cpu_site")


def _prepend(env: dict[str, str], key: str, entry: str) -> None:
    old = env.get(key, "")
    env[key] = f"{entry}:{old}" if old else entry


def cpu_environment(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus what a CPU SGLang server needs: the engine switch, the stub driver and the
    CPU patches (``cpu_site/sitecustomize.py`` first on ``PYTHONPATH``)."""
    out = dict(env)
    out["SGLANG_USE_CPU_ENGINE"] = "1"
    _prepend(out, "LD_LIBRARY_PATH", str(build_stub()))
    _prepend(out, "PYTHONPATH", str(cpu_site_dir()))
    return out


def cpu_server_args(server_args: Mapping[str, Any]) -> dict[str, Any]:
    """``server_args`` with the CPU defaults filled in: a bounded KV cache, and float32 compute
    (SGLang's ``dtype=auto`` runs a float32 checkpoint in float16, which is slower on a CPU and
    moves log-probs by ~4e-4)."""
    out = dict(server_args)
    out.setdefault("max_total_tokens", CPU_DEFAULT_MAX_TOTAL_TOKENS)
    out.setdefault("dtype", "float32")
    if out.get("enable_lora"):
        out.setdefault("lora_backend", "torch_native")  # the default (csgmv) runs Triton kernels
    return out
