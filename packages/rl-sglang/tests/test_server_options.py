"""GPU launch options of SGLangGenerator (tensor/data parallel, memory fraction, CUDA graphs,
memory saver, GPU placement): the command lines built from the typed config, checked against
SGLang's own parser, and the refusal of contradictory settings. No server is started."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from rl_core.config import from_dict
from rl_core.errors import ConfigError
from rl_sglang import ServerArgs, SGLangGenerator, server_argv
from rl_sglang._launch import check_gpu_budget, typed_server_args, visible_gpus
from rl_sglang.server import _write_atomic


def _cfg(**kw: Any) -> SGLangGenerator.Config:
    return SGLangGenerator.Config(model_path="/models/m", **kw)


def _argv(config: SGLangGenerator.Config, index: int) -> list[str]:
    return server_argv(
        model_path=config.model_path,
        python="/venv/bin/python",
        port=30000 + index,
        server_args={**config.server_args, **typed_server_args(config, index)},
        device=config.device,
        host="10.0.0.5",
        nccl_port=40000,
    )


def test_gpu_command_lines_of_two_tp2_dp2_servers() -> None:
    """Two servers of TP=2 x DP=2 on one node get disjoint GPU blocks (base 0 and 4) and every
    typed option as its SGLang 0.5.23 flag."""
    c = _cfg(
        device="cuda",
        num_servers=2,
        tp_size=2,
        dp_size=2,
        mem_fraction_static=0.55,
        cuda_graph_max_bs=64,
        enable_memory_saver=True,
        server_args={"max_running_requests": 128},
    )
    first, second = _argv(c, 0), _argv(c, 1)
    assert first[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    tail = " ".join(second)
    for flag in (
        "--model-path /models/m",
        "--host 10.0.0.5",
        "--port 30001",
        "--device cuda",
        "--skip-tokenizer-init",
        "--tp-size 2",
        "--dp-size 2",
        "--mem-fraction-static 0.55",
        "--cuda-graph-max-bs-decode 64",
        "--enable-memory-saver",
        "--max-running-requests 128",
        "--base-gpu-id 4",
    ):
        assert flag in tail, flag
    assert "--base-gpu-id" not in first  # server 0 starts at GPU 0
    off = " ".join(_argv(_cfg(device="cuda", disable_cuda_graph=True, base_gpu_id=2), 0))
    assert "--disable-decode-cuda-graph --disable-prefill-cuda-graph" in off
    assert "--base-gpu-id 2" in off


def test_typed_options_are_real_sglang_flags(sglang_python: str) -> None:
    """Every server argument the typed fields produce passes SGLang's own parser (the flag
    names are read from the installed SGLang, not guessed)."""
    c = _cfg(
        device="cuda",
        tp_size=2,
        dp_size=2,
        base_gpu_id=1,
        mem_fraction_static=0.5,
        cuda_graph_max_bs=32,
        enable_memory_saver=True,
        capture_routing=True,
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules=("q_proj", "o_proj"),
        max_loras_per_batch=4,
    )
    args = typed_server_args(c, 1)
    assert set(args) == {
        "tp_size",
        "dp_size",
        "base_gpu_id",
        "mem_fraction_static",
        "cuda_graph_max_bs_decode",
        "enable_memory_saver",
        "enable_return_routed_experts",
        "enable_lora",
        "max_lora_rank",
        "lora_target_modules",
        "max_loras_per_batch",
    }
    ServerArgs.validate(args, python=sglang_python)
    off = typed_server_args(_cfg(device="cuda", disable_cuda_graph=True), 0)
    ServerArgs.validate(off, python=sglang_python)
    opts = ServerArgs.options(sglang_python)
    assert opts["disable_decode_cuda_graph"].store_true
    assert opts["disable_prefill_cuda_graph"].store_true


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"tp_size": 2}, "tp_size"),
        ({"dp_size": 2}, "dp_size"),
        ({"disable_cuda_graph": True}, "disable_cuda_graph"),
        ({"cuda_graph_max_bs": 8}, "cuda_graph_max_bs"),
        ({"enable_memory_saver": True}, "enable_memory_saver"),
        ({"base_gpu_id": 1}, "base_gpu_id"),
    ],
)
def test_cuda_options_refused_on_cpu(kw: dict[str, Any], field: str) -> None:
    """CUDA-only options with device='cpu' are a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=rf"Config\.{field}: a CUDA option"):
        _cfg(device="cpu", **kw)


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, -0.1, float("nan")])
def test_mem_fraction_outside_open_unit_interval_refused(value: float) -> None:
    """``mem_fraction_static`` must be in (0, 1), built in Python or loaded from a dict."""
    with pytest.raises(ConfigError, match="mem_fraction_static: must be in \\(0, 1\\)"):
        _cfg(device="cuda", mem_fraction_static=value)
    with pytest.raises(ConfigError, match="mem_fraction_static"):
        from_dict(
            SGLangGenerator.Config,
            {"model_path": "m", "device": "cuda", "mem_fraction_static": value},
        )


def test_contradictory_settings_refused() -> None:
    """Disabled CUDA graphs with a graph batch size, a typed option repeated in server_args,
    launch options while attaching, and a zero tp_size are refused naming the fields."""
    with pytest.raises(ConfigError, match="cuda_graph_max_bs.*disable_cuda_graph"):
        _cfg(device="cuda", disable_cuda_graph=True, cuda_graph_max_bs=16)
    with pytest.raises(ConfigError, match=r"server_args\.tp_size: set by the typed field"):
        _cfg(device="cuda", server_args={"tp_size": 2})
    with pytest.raises(ConfigError, match=r"server-args|server_args\.mem-fraction-static"):
        _cfg(device="cuda", server_args={"mem-fraction-static": 0.5})
    with pytest.raises(ConfigError, match="launch options, but server_urls"):
        SGLangGenerator.Config(server_urls=("http://h:1",), device="cuda", tp_size=2)
    with pytest.raises(ConfigError, match="tp_size: must be >= 1"):
        _cfg(device="cuda", tp_size=0)


def test_gpu_budget() -> None:
    """More GPUs than visible (when known) is refused naming num_servers, tp_size and dp_size;
    an unknown count (no CUDA here, no CUDA_VISIBLE_DEVICES) is not checked."""
    c = _cfg(device="cuda", num_servers=2, tp_size=2, dp_size=2)
    check_gpu_budget(c, 8)
    check_gpu_budget(c, None)
    with pytest.raises(ConfigError, match=r"num_servers \(2\) x tp_size \(2\) x dp_size \(2\)"):
        check_gpu_budget(c, 7)
    with pytest.raises(ConfigError, match="base_gpu_id"):
        check_gpu_budget(_cfg(device="cuda", tp_size=4, base_gpu_id=5), 8)
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "0,1,3"}) == 3
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_generator_refuses_gpu_budget_before_launching(
    sglang_python: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLangGenerator checks the budget against CUDA_VISIBLE_DEVICES before starting anything."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match="4 GPUs, but 2 are visible"):
        SGLangGenerator(_cfg(device="cuda", python=sglang_python, num_servers=2, tp_size=2))


def test_lora_options() -> None:
    """LoRA flags come from the typed fields (torch_native backend added on CPU), enable_lora
    needs a rank and target modules, and LoRA options without enable_lora are refused."""
    from rl_sglang._cpu_support import cpu_server_args

    c = _cfg(enable_lora=True, max_lora_rank=16, lora_target_modules=("q_proj", "v_proj"))
    args = typed_server_args(c, 0)
    assert args == {
        "enable_lora": True,
        "max_lora_rank": 16,
        "lora_target_modules": ["q_proj", "v_proj"],
    }
    line = " ".join(_argv(c, 0))
    assert "--enable-lora --max-lora-rank 16 --lora-target-modules q_proj v_proj" in line
    assert cpu_server_args(args)["lora_backend"] == "torch_native"
    with pytest.raises(ConfigError, match="enable_lora: needs max_lora_rank"):
        _cfg(enable_lora=True, max_lora_rank=8)
    with pytest.raises(ConfigError, match="max_lora_rank: a LoRA option"):
        _cfg(max_lora_rank=8)
    with pytest.raises(ConfigError, match=r"server_args\.enable_lora: set by the typed field"):
        _cfg(server_args={"enable_lora": True})


def test_options_cache_is_written_atomically(tmp_path: Path) -> None:
    """Threads writing the options cache at once (each with its own content) never leave a
    reader a partial file, nor a temp file behind; an unwritable folder is not an error."""
    path = tmp_path / ".rl-sglang-server-args.json"
    texts = [json.dumps({"writer": i, "pad": "x" * (200_000 + i)}) for i in range(6)]
    stop, bad = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            try:
                raw = path.read_text()
            except FileNotFoundError:
                continue
            if raw not in texts:
                bad.append(len(raw))

    def write(text: str) -> None:
        for _ in range(30):
            _write_atomic(path, text)

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=write, args=(t,)) for t in texts]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    assert not bad, f"{len(bad)} partial reads, e.g. {bad[:3]} bytes"
    assert path.read_text() in texts
    assert os.listdir(tmp_path) == [path.name]

    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    if os.geteuid() != 0:  # root writes anyway
        _write_atomic(ro / "cache.json", "{}")
        assert os.listdir(ro) == []


def test_launched_servers_stop_without_sglang_crash_diagnostics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang takes every SIGTERM for a possible crash and, by default, sleeps 5 s before
    py-spying its schedulers (and on CUDA waits for core dumps): launch_server turns both off in
    the server's environment unless the caller's environment sets them."""
    from rl_sglang import server

    seen: list[dict[str, str]] = []
    monkeypatch.setattr(server, "ManagedProcess", lambda argv, *, env, **kw: seen.append(env))
    monkeypatch.setattr(server, "server_argv", lambda **kw: ["python", "-m", "sglang"])
    common = {"model_path": "/m", "python": "/py", "port": 1, "server_args": {}, "device": "cuda"}
    server.launch_server(**common, log_dir=tmp_path, env={"PATH": "/bin"})
    assert seen[-1]["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "0"
    assert seen[-1]["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
    server.launch_server(**common, log_dir=tmp_path, env={"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})
    assert seen[-1]["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"  # the user's setting wins
    assert seen[-1]["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0"
