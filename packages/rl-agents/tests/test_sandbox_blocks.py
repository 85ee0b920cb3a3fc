"""What the hardened sandbox blocks for *shell commands* (an agent's shell tool, where no
Python audit hook helps): network, writes outside the root, fork bombs, memory, time and file
size, in every isolation mode that runs on this machine (``bwrap``, ``namespace``,
``rlimits``). A check is skipped only for a mode that cannot enforce it, with the reason."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from rl_agents.tools import Sandbox
from rl_agents.tools.sandbox import NOBODY, isolation_modes

MODES = isolation_modes()


def _tasks_of(uid: int) -> tuple[int, int]:
    """The tasks (threads) ``uid`` runs, and how many of its processes are zombies."""
    tasks = zombies = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                tasks += len(os.listdir(f"/proc/{pid}/task"))
                with open(f"/proc/{pid}/stat") as f:
                    zombies += f.read().rpartition(")")[2].split()[0] == "Z"
        except OSError:
            pass
    return tasks, zombies


def _settle_tasks(uid: int, timeout_s: float = 20.0) -> None:
    """Wait until ``uid``'s tasks are all reaped and their count held still for a second.
    Without a user namespace of its own, the sandbox's ``RLIMIT_NPROC`` is the tasks the
    user already runs plus ``max_processes``; the killed children of the previous bomb stay
    zombies until init reaps them (~2 s here), and each one reaped during the next bomb lets
    it fork once more (CI saw 18 forks for 16)."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        tasks, zombies = _tasks_of(uid)
        if tasks == 0:
            return
        if (tasks, zombies) != last:
            last, since = (tasks, zombies), time.monotonic()
        elif zombies == 0 and time.monotonic() - since >= 1.0:
            return
        time.sleep(0.1)


def _box(mode: str, **kw) -> Sandbox:
    return Sandbox(
        Sandbox.Config(
            accept_weak_isolation=True, isolation=mode, timeout_s=20, cpu_time_s=10, **kw
        )
    )


@pytest.mark.parametrize("mode", MODES)
def test_shell_network_is_blocked(mode):
    if mode == "rlimits":
        pytest.skip(
            "rlimits mode has no network namespace: a shell command's sockets cannot be "
            "stopped (Python code run with Sandbox.run is covered by its audit hook, "
            "test_sandbox.py::test_socket_connect_fails)"
        )
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port = srv.getsockname()[1]
    accepted = []
    threading.Thread(target=lambda: accepted.append(srv.accept()), daemon=True).start()
    code = (
        "import socket\ntry:\n"
        f"    socket.create_connection(('127.0.0.1', {port}), timeout=3); print('connected')\n"
        "except OSError as e:\n    print('blocked', type(e).__name__)\n"
    )
    try:
        with _box(mode).episode({"net.py": code}) as ep:
            res = ep.shell("python3 net.py")
    finally:
        srv.close()
    assert res.isolation == mode
    assert res.stdout.startswith("blocked"), res.stdout + res.stderr
    assert not accepted


@pytest.mark.parametrize("mode", MODES)
def test_shell_writes_outside_the_root_fail(mode, tmp_path: Path):
    box = _box(mode)
    if mode == "rlimits" and not box.drops_root:
        pytest.skip(
            "rlimits mode without dropping root (not root, or nobody cannot run Python): a "
            "shell command may write wherever this user may"
        )
    target = tmp_path / "escape.txt"
    with box.episode() as ep:
        res = ep.shell(f"echo x > {target}; touch {target}.2; mkdir {target}.d; echo done")
        inside = ep.shell("echo ok > mine.txt && cat mine.txt")
    assert res.stdout == "done\n" and res.stderr.count("\n") >= 3, res.stderr
    assert not target.exists() and not Path(f"{target}.2").exists()
    assert not Path(f"{target}.d").exists()
    assert inside.stdout == "ok\n"  # the root itself is writable


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_stopped_by_the_process_limit(mode):
    box = _box(mode, max_processes=16)
    if os.geteuid() == 0 and not box.drops_root:
        pytest.skip("running as root and nobody cannot run Python: root ignores RLIMIT_NPROC")
    # A bounded fork bomb (so a broken limit cannot take the machine down): children sleep.
    bomb = (
        "import os, time\nn = 0\nwhile n < 400:\n    try:\n        pid = os.fork()\n"
        "    except OSError as e:\n        print('blocked after', n, e.errno); break\n"
        "    if pid == 0:\n        time.sleep(30); os._exit(0)\n    n += 1\nelse:\n"
        "    print('forked', n)\n"
    )
    _settle_tasks(NOBODY if box.drops_root else os.getuid())
    with box.episode({"bomb.py": bomb}) as ep:
        res = ep.shell("python3 bomb.py")
    words = res.stdout.split()
    assert words[:2] == ["blocked", "after"], res.stdout + res.stderr
    assert int(words[2]) <= 16
    assert res.duration_s < 15  # the sleeping children died with the run


@pytest.mark.parametrize("mode", MODES)
def test_memory_hog_dies(mode):
    with _box(mode, memory_mb=200).episode() as ep:
        res = ep.shell("python3 -c 'x = bytearray(1 << 30); print(\"allocated\")'")
    assert not res.ok and "allocated" not in res.stdout
    assert "MemoryError" in res.stderr


@pytest.mark.parametrize("mode", MODES)
def test_sleeper_is_killed_at_the_time_limit(mode):
    box = Sandbox(Sandbox.Config(accept_weak_isolation=True, isolation=mode, timeout_s=2))
    with box.episode() as ep:
        res = ep.shell("echo start; sleep 60 & sleep 60")
    assert res.timed_out and res.signal == "SIGKILL" and res.stdout == "start\n"
    assert res.duration_s < 10


@pytest.mark.parametrize("mode", MODES)
def test_file_size_limit(mode):
    with _box(mode, file_size_mb=1).episode() as ep:
        res = ep.shell("head -c 4194304 /dev/zero > big; echo rc=$?")
        size = (ep.root / "big").stat().st_size
    assert res.stdout != "rc=0\n" and size <= 1024 * 1024


@pytest.mark.parametrize("mode", MODES)
def test_episode_root_is_private_and_persists_between_commands(mode):
    box = _box(mode)
    with box.episode() as a, box.episode() as b:
        a.write_file("sol.py", "print(6 * 7)")
        assert a.shell("python3 sol.py > out.txt").ok
        assert a.read_file("out.txt") == "42\n"
        assert b.read_file("out.txt") is None
        env = b.shell("echo $HOME $TMPDIR; pwd").stdout.split()
        assert env == [str(b.root)] * 3
        if mode == "bwrap":  # the host's /tmp (other episodes' roots) is hidden
            assert b.shell("ls /tmp").stdout.split() == [b.root.name]
        root = a.root
    assert not root.exists()  # deleted with the episode


def test_command_line_runs_one_command():
    tmp_path = Path(tempfile.mkdtemp())  # reachable by nobody (a root trainer drops to it)
    cmd = [sys.executable, "-m", "rl_agents.tools", "--root", str(tmp_path)]
    cmd += [
        "--config",
        '{"timeout_s": 5, "accept_weak_isolation": true}',
        "--",
        "sh",
        "-c",
        "echo hi > f; cat f; exit 3",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3 and proc.stdout == "hi\n", proc.stderr
    assert (tmp_path / "f").read_text() == "hi\n" and tmp_path.exists()  # kept
    shutil.rmtree(tmp_path)
