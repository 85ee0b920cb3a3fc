"""``make bench-gpu`` (benchmarks/gpu.py) prepared here for a machine with CUDA: the smoke run
takes every part's code path on the CPU (one layer), and without CUDA the command measures
nothing and says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rl_core.testing.modules import load_module

ROOT = Path(__file__).resolve().parents[1]
gpu = load_module("gpu_bench", ROOT / "benchmarks" / "gpu.py")


def test_smoke_run_measures_every_part_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    assert (
        gpu.main(["--smoke", "--parts", "train_hf,generate_hf,delta_apply", "--out", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    parts = result["parts"]
    assert parts["train_hf"]["tokens_per_s"] > 0 and parts["train_hf"]["parameters"] > 0
    assert parts["train_hf"]["mfu"] is None  # no known peak on a CPU: no made-up MFU
    assert parts["generate_hf"]["generated_tokens"] == 4 * 8  # EOS ignored: every token made
    delta = parts["delta_apply"]
    assert delta["applied_equals_new"] is True  # the applied bytes are the stepped weights
    assert 0 < delta["delta_gb"] < delta["model_gb"]


def test_megatron_part_reports_instead_of_failing(tmp_path: Path) -> None:
    pytest.importorskip("megatron.core")
    out = tmp_path / "gpu.json"
    assert gpu.main(["--smoke", "--parts", "train_megatron", "--out", str(out)]) == 0
    part = json.loads(out.read_text())["parts"]["train_megatron"]
    assert "skipped" in part or part["tokens_per_s"] > 0, part


def test_mfu_peaks_by_device_name() -> None:
    assert gpu.peak_tflops("NVIDIA H200") == pytest.approx(989.4)
    assert gpu.peak_tflops("NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert gpu.peak_tflops("Some Other GPU") is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_without_cuda_it_says_so_and_exits_zero() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0
    assert "no CUDA device" in proc.stdout
