"""The code-execution sandbox: normal code runs; runaway, memory-hungry, escaping and networking
code is stopped. Each limit is tested in both isolation modes where the mode matters."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from rl_agents.tools import Sandbox, namespaces_available
from rl_agents.tools.sandbox import isolation_modes
from rl_core.errors import ConfigError, DataError

MODES = isolation_modes()


@pytest.fixture(params=MODES)
def box(request) -> Sandbox:
    return Sandbox(
        Sandbox.Config(
            accept_weak_isolation=True, isolation=request.param, timeout_s=20, cpu_time_s=5
        )
    )


def test_normal_code_returns_stdout_exit_code_and_files(box):
    res = box.run(
        "import sys, helper\n"
        "print(helper.VALUE * 2, sys.stdin.read())\n"
        "open('out.txt', 'w').write('ok')\n"
        "print(open('out.txt').read())\n"
        "sys.exit(3)\n",
        stdin="in",
        files={"helper.py": "VALUE = 21\n"},
    )
    assert res.stdout == "42 in\nok\n"
    assert res.exit_code == 3 and not res.ok and res.signal is None and not res.timed_out
    ok = box.run("print('hi')")
    assert ok.ok and ok.stdout == "hi\n" and ok.isolation == box.isolation


def test_exception_gives_traceback_and_status_1(box):
    res = box.run("raise ValueError('boom')")
    assert res.exit_code == 1 and "ValueError: boom" in res.stderr


def test_runaway_cpu_loop_is_killed_by_the_cpu_limit():
    box = Sandbox(Sandbox.Config(accept_weak_isolation=True, timeout_s=60, cpu_time_s=1))
    res = box.run("while True:\n    pass\n")
    assert res.signal in ("SIGXCPU", "SIGKILL") and not res.timed_out
    assert res.duration_s < 30


def test_sleeping_script_is_killed_at_the_wall_time_limit():
    box = Sandbox(Sandbox.Config(accept_weak_isolation=True, timeout_s=3, cpu_time_s=60))
    res = box.run("import time\nprint('start', flush=True)\ntime.sleep(120)\n")
    assert res.timed_out and res.signal == "SIGKILL" and not res.ok
    assert res.stdout == "start\n"
    assert 3 <= res.duration_s < 15


def test_memory_hog_dies(box):
    small = Sandbox(
        Sandbox.Config(
            accept_weak_isolation=True, isolation=box.isolation, memory_mb=200, timeout_s=20
        )
    )
    res = small.run("x = bytearray(1024 * 1024 * 1024)\nprint('allocated')\n")
    assert not res.ok and "allocated" not in res.stdout
    assert "MemoryError" in res.stderr


def test_file_size_limit(box):
    small = Sandbox(
        Sandbox.Config(
            accept_weak_isolation=True, isolation=box.isolation, file_size_mb=1, timeout_s=20
        )
    )
    res = small.run("open('big', 'wb').write(b'x' * (4 * 1024 * 1024))\nprint('wrote')\n")
    assert not res.ok and "wrote" not in res.stdout  # EFBIG / SIGXFSZ


def test_runaway_printer_output_is_capped(box):
    small = Sandbox(
        Sandbox.Config(
            accept_weak_isolation=True,
            isolation=box.isolation,
            file_size_mb=1,
            max_output_bytes=1000,
        )
    )
    res = small.run("while True:\n    print('x' * 1000)\n")
    assert not res.ok and res.truncated and len(res.stdout) == 1000


def test_cannot_write_outside_its_directory(box, tmp_path: Path):
    target = tmp_path / "escape.txt"
    res = box.run(
        f"import os\nT = {str(target)!r}\n"
        "for attempt in (lambda: open(T, 'w'), lambda: os.open(T, os.O_WRONLY | os.O_CREAT),\n"
        "                lambda: open('../escape.txt', 'w'), lambda: os.mkdir(T + '.d')):\n"
        "    try:\n"
        "        attempt()\n"
        "        print('escaped')\n"
        "    except OSError as e:\n"
        "        print('blocked', type(e).__name__)\n"
    )
    assert res.ok, res.stderr
    assert res.stdout.count("blocked") == 4 and "escaped" not in res.stdout
    assert not target.exists() and not Path(str(target) + ".d").exists()


def test_socket_connect_fails(box):
    # A listener the sandbox would reach if it had this machine's network.
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    t = threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True)
    t.start()
    try:
        res = box.run(
            "import socket\n"
            "s = socket.socket()\n"
            "try:\n"
            f"    s.connect(('127.0.0.1', {port}))\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e)\n"
        )
    finally:
        srv.close()
    assert res.ok, res.stderr
    assert res.stdout.startswith("refused") and not accepted


@pytest.mark.skipif(not namespaces_available(), reason="needs user namespaces")
def test_namespace_blocks_network_below_the_audit_hook():
    """In namespace mode the network is gone at the kernel level, not only refused by Python's
    audit hook (which native code could bypass): the only interface is the loopback, and it is
    down, so even a raw send fails."""
    box = Sandbox(Sandbox.Config(accept_weak_isolation=True, isolation="namespace"))
    res = box.run(
        "import socket\n"
        "print([name for _, name in socket.if_nameindex()])\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "try:\n"
        "    s.sendto(b'x', ('1.1.1.1', 53))\n"
        "except OSError as e:\n"
        "    print(type(e).__name__)\n"
    )
    assert res.ok, res.stderr
    assert res.stdout.splitlines() == ["['lo']", "PermissionError"]


def test_subprocesses_are_refused(box):
    res = box.run(
        "import subprocess\n"
        "try:\n"
        "    subprocess.run(['true'])\n"
        "    print('spawned')\n"
        "except PermissionError as e:\n"
        "    print('refused')\n"
    )
    assert res.stdout == "refused\n"


def test_environment_is_minimal(box, monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "x")
    res = box.run(
        "import os\nprint('SECRET_TOKEN' in os.environ, os.getcwd() == os.environ['HOME'])"
    )
    assert res.stdout == "False True\n"


def test_config_and_file_errors():
    with pytest.raises(ConfigError, match="memory_mb"):
        Sandbox.Config(memory_mb=0)
    with pytest.raises(DataError, match="relative path"):
        Sandbox(Sandbox.Config(accept_weak_isolation=True)).run("pass", files={"../x.py": ""})
