"""The public surface is pinned, and every transport is reachable by its entry-point name."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

import rl_weightsync


def test_all_is_pinned() -> None:
    assert sorted(rl_weightsync.__all__) == sorted(
        [
            "BroadcastTransport",
            "DiskDeltaTransport",
            "DiskFullTransport",
            "DiskWeightTarget",
            "InProcessTransport",
            "Manifest",
            "MixedUpdateError",
            "TensorEntry",
            "__version__",
            "decode_delta",
            "encode_delta",
            "iter_buckets",
            "safe_join",
            "tensor_checksum",
            "verify_checksum",
        ]
    )
    for name in rl_weightsync.__all__:
        obj = getattr(rl_weightsync, name)
        assert name == "__version__" or obj.__doc__, f"{name} has no docstring"


def test_entry_points_resolve_to_named_transports() -> None:
    eps = {
        e.name: e
        for e in entry_points(group="rl.weight_transports")
        if e.value.startswith("rl_weightsync")
    }
    assert sorted(eps) == ["broadcast", "disk_delta", "disk_full", "inprocess"]
    for name, ep in eps.items():
        cls = ep.load()
        assert cls.name == name
        assert dataclasses.is_dataclass(cls.Config) and hasattr(cls.Config, "__slots__")
        with pytest.raises(TypeError):
            cls.Config(*[0] * len(dataclasses.fields(cls.Config)))  # keyword-only


def test_import_pulls_no_trainer_or_engine() -> None:
    code = "import sys, rl_weightsync; print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'megatron', 'ray', 'transformers', 'rl_trainer', 'rl_sglang'}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
