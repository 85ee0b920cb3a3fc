"""Process ownership (no orphans) and server-argument validation; no SGLang server needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rl_core.errors import ConfigError
from rl_sglang import ManagedProcess, ServerArgs, SGLangGenerator
from rl_sglang.server import free_port


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_stop_kills_the_whole_process_group(tmp_path: Path) -> None:
    """stop() ends the launcher and everything it forked (SGLang forks scheduler/detokenizer)."""
    proc = ManagedProcess(
        ["bash", "-c", "sleep 300 & sleep 300 & wait"],
        env=os.environ,
        log_path=tmp_path / "p.log",
        cwd=tmp_path,
        port=0,
        name="dummy",
    )
    deadline = time.monotonic() + 10
    while len(proc.group_pids()) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = proc.group_pids()
    assert len(pids) == 3 and proc.alive()
    proc.stop(timeout_s=5)
    assert _wait_gone(pids) == []
    assert not proc.alive()


_CHILD = """
import sys, time
from pathlib import Path
from rl_sglang import ManagedProcess
p = ManagedProcess(["bash", "-c", "sleep 300 & sleep 300 & wait"], env={"PATH": "/usr/bin:/bin"},
                   log_path=Path(sys.argv[1]) / "c.log", cwd=Path(sys.argv[1]), port=0, name="c")
while len(p.group_pids()) < 3:
    time.sleep(0.05)
print(" ".join(map(str, [p.pid] + p.group_pids())), flush=True)
if sys.argv[2] == "raise":
    raise SystemExit("the test run failed")
time.sleep(300)
"""


@pytest.mark.parametrize("how", ["raise", "sigkill"])
def test_no_orphans_when_the_owner_dies(how: str, tmp_path: Path) -> None:
    """An owner that exits with an error stops the whole group (atexit); an owner killed with
    SIGKILL takes its launcher down with it (PR_SET_PDEATHSIG)."""
    owner = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(tmp_path), how], stdout=subprocess.PIPE, text=True
    )
    assert owner.stdout is not None
    launcher, *group = (int(x) for x in owner.stdout.readline().split())
    if how == "sigkill":
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        assert _wait_gone([launcher]) == []
        for pid in group:  # what the launcher forked is the launcher's job (SGLang's is)
            with __import__("contextlib").suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    else:
        owner.wait(30)
        assert owner.returncode != 0
        assert _wait_gone(group) == []


def test_server_args_keys_are_checked() -> None:
    """Generator-owned and malformed keys are refused with the field named."""
    with pytest.raises(ConfigError, match=r"server_args\.port"):
        ServerArgs.check_keys({"port": 1})
    with pytest.raises(ConfigError, match="not a ServerArgs field name"):
        ServerArgs.check_keys({"Max Tokens": 1})
    assert ServerArgs.check_keys({"max-total-tokens": 8, "json_model_override_args": {"a": 1}}) == {
        "max_total_tokens": 8,
        "json_model_override_args": '{"a": 1}',
    }
    argv = ServerArgs.to_argv({"max_total_tokens": 8, "enable_metrics": True, "x": False})
    assert argv == ["--max-total-tokens", "8", "--enable-metrics"]


def test_server_args_validated_against_sglangs_parser(sglang_python: str) -> None:
    """Unknown names (with a suggestion), wrong switch values and bad choices are refused."""
    ok = ServerArgs.validate(
        {"max_total_tokens": 4096, "log_level": "warning"}, python=sglang_python
    )
    assert ok == {"max_total_tokens": 4096, "log_level": "warning"}
    with pytest.raises(ConfigError, match="max_total_tokens"):
        ServerArgs.validate({"max_total_token": 1}, python=sglang_python)
    with pytest.raises(ConfigError, match="a switch"):
        ServerArgs.validate({"enable_metrics": "yes"}, python=sglang_python)
    with pytest.raises(ConfigError, match="not one of"):
        ServerArgs.validate({"attention_backend": "no-such-backend"}, python=sglang_python)


def test_config_errors_name_the_field() -> None:
    """Bad generator settings fail at construction with the field and the fix."""
    with pytest.raises(ConfigError, match="model_path"):
        SGLangGenerator.Config()
    with pytest.raises(ConfigError, match="pause_mode"):
        SGLangGenerator.Config(model_path="m", pause_mode="later")
    with pytest.raises(ConfigError, match="router_url"):
        SGLangGenerator.Config(model_path="m", use_router=True, router_url="http://x:1")
    with pytest.raises(ConfigError, match="python"):
        SGLangGenerator(SGLangGenerator.Config(model_path="m", python="/nonexistent/python"))


def test_free_ports_are_distinct() -> None:
    """Ports handed out in one process never repeat (servers launched together do not collide)."""
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
