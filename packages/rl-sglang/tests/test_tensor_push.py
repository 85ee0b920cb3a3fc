"""How SGLangGenerator.load_weights sends tensors (``tensor_push``), against a stdlib stand-in for
the server's HTTP surface (no SGLang start: seconds). A server on this host loads one safetensors
file holding exactly the pushed tensors (bitwise, every name); the file stays as the re-sync
source until the next version replaces it and is removed on close. The real server's loading of
that file is tested in test_generator.py::test_weight_update_paths_serve_exact_version[tensor]."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from rl_core.errors import ConfigError, WeightSyncError
from rl_sglang import ManagedProcess, SGLangGenerator
from rl_sglang._weights import _is_loopback
from rl_sglang.server import free_port, wait_healthy

FAKE_SERVER = Path(__file__).with_name("_fake_sglang_server.py")


@pytest.fixture
def fake(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """A stand-in server on 127.0.0.1 (``indirect`` param: a path it fails with 400): its URL
    and the log of the calls it got."""
    port, log = free_port(), tmp_path / "calls.jsonl"
    fail = [request.param] if hasattr(request, "param") else []
    proc = ManagedProcess(
        [sys.executable, str(FAKE_SERVER), str(port), str(log), *fail],
        env=dict(os.environ),
        log_path=tmp_path / "fake.out",
        cwd=tmp_path,
        port=port,
        name="fake",
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=30)
        yield url, log
    finally:
        proc.stop()


def _posts(log: Path, path: str) -> list[Any]:
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    return [body for method, p, body in calls if method == "POST" and p == path]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    embed = torch.randn(32, 8, generator=g)
    flat, flat2 = torch.randn(12, generator=g), torch.randn(16, generator=g)
    return [
        ("model.embed_tokens.weight", embed),
        ("lm_head.weight", embed),  # tied: the same storage under two names
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=g).bfloat16()),
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(8, 16, generator=g).t()),
        ("model.norm.weight", torch.randn(8, generator=g)),
        ("model.layers.0.input_layernorm.weight", flat[:8]),  # overlapping views of one
        ("model.layers.0.post_attention_layernorm.weight", flat[4:]),  # storage
        ("model.layers.1.input_layernorm.weight", flat2[:8]),  # disjoint views: kept as views
        ("model.layers.1.post_attention_layernorm.weight", flat2[8:]),
    ]


def test_file_push_loads_every_tensor_and_cleans_up(fake: tuple[str, Path]) -> None:
    url, log = fake
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    root = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    orphan = Path(root) / f"rl-sglang-push-{int(dead.stdout)}-x"  # a killed run's leftover
    orphan.mkdir()
    (orphan / "model.safetensors").write_bytes(b"0")
    gen = SGLangGenerator(SGLangGenerator.Config(server_urls=(url,), health_interval_s=0))
    staged = []
    try:
        assert gen._weights.pushes_by_file()  # a loopback server: auto -> file
        for version in (1, 2):
            named = _weights(seed=version)
            gen.load_weights(named, version=version)
            assert gen.weight_version == version
            assert _posts(log, "/update_weights_from_tensor") == []
            body = _posts(log, "/update_weights_from_disk")[-1]
            assert body["weight_version"] == str(version) and body["flush_cache"] is True
            got = load_file(os.path.join(body["model_path"], "model.safetensors"))
            assert sorted(got) == sorted(n for n, _ in named)
            for name, tensor in named:
                assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
            staged.append(body["model_path"])
            assert not orphan.exists(), "a dead process's staging directory is left"
        assert not os.path.exists(staged[0]), "the previous version's file is left behind"
        assert os.path.isdir(staged[1]), "the served version's file is the re-sync source"
    finally:
        asyncio.run(gen.close())
    assert not os.path.exists(os.path.dirname(staged[1])), "staging directory left after close"


def test_inline_push_and_the_auto_choice(fake: tuple[str, Path]) -> None:
    url, log = fake
    gen = SGLangGenerator(
        SGLangGenerator.Config(server_urls=(url,), health_interval_s=0, tensor_push="inline")
    )
    try:
        assert not gen._weights.pushes_by_file()
        gen.load_weights(_weights(seed=1), version=1)
        assert _posts(log, "/update_weights_from_disk") == []
        (body,) = _posts(log, "/update_weights_from_tensor")
        assert body["weight_version"] == "1" and len(body["serialized_named_tensors"]) == 1
    finally:
        asyncio.run(gen.close())
    assert _is_loopback("http://127.0.0.1:30000") and _is_loopback("http://localhost:1")
    assert _is_loopback("http://[::1]:30000")
    assert not _is_loopback("http://10.0.0.5:30000") and not _is_loopback("http://node7:30000")
    with pytest.raises(ConfigError, match="tensor_push"):
        SGLangGenerator.Config(server_urls=(url,), tensor_push="shm")


@pytest.mark.parametrize("fake", ["/update_weights_from_disk"], indirect=True)
def test_failed_file_load_keeps_the_version_and_says_how_to_fix(fake: tuple[str, Path]) -> None:
    """A server that cannot load the file (e.g. it does not see this host's /dev/shm): the
    error names tensor_push inline, the generator stays on its version, no file is left."""
    url, log = fake
    gen = SGLangGenerator(SGLangGenerator.Config(server_urls=(url,), health_interval_s=0))
    try:
        with pytest.raises(WeightSyncError, match="tensor_push: inline") as err:
            gen.load_weights(_weights(seed=1), version=1)
        assert gen.weight_version == 0
        (body,) = _posts(log, "/update_weights_from_disk")
        assert not os.path.exists(body["model_path"]), "the failed version's file is left"
        assert "Failed to get weights iterator" in str(err.value)
    finally:
        asyncio.run(gen.close())
