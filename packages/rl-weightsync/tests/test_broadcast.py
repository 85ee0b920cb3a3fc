"""BroadcastTransport: conformance (sender and receiver ranks in one process, two threads) and a
real two-process run on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    WeightTransportConformance,
    next_weights,
    sample_weights,
)
from rl_weightsync.broadcast import BroadcastTransport


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connected_pair(bucket_bytes: int = 1 << 20) -> tuple[BroadcastTransport, BroadcastTransport]:
    port = free_port()
    ts = [
        BroadcastTransport(
            BroadcastTransport.Config(
                rank=r, world_size=2, port=port, bucket_bytes=bucket_bytes, timeout_s=60
            )
        )
        for r in (0, 1)
    ]
    threads = [threading.Thread(target=t.connect) for t in ts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return ts[0], ts[1]


class TestBroadcastConformance(WeightTransportConformance):
    @pytest.fixture
    def pair(self) -> Iterator[tuple[BroadcastTransport, BroadcastTransport]]:
        sender, receiver = connected_pair(bucket_bytes=300)  # several buckets
        yield sender, receiver
        sender.close()
        receiver.close()

    @pytest.fixture
    def transport(self, pair: tuple[BroadcastTransport, BroadcastTransport]) -> BroadcastTransport:
        return pair[0]

    @pytest.fixture
    def receiver(self, pair: tuple[BroadcastTransport, BroadcastTransport]) -> BroadcastTransport:
        return pair[1]


def test_superseded_version_refused_and_buffers_reused() -> None:
    sender, receiver = connected_pair()
    try:
        w1 = sample_weights()
        w2 = next_weights(w1, 2)
        target = DictTarget()
        u1 = sender.publish(1, w1.items())
        receiver.apply(u1, target)
        ptrs = {i: b.data_ptr() for i, b in receiver._recv_buffers.items()}
        u2 = sender.publish(2, w2.items())
        u3 = sender.publish(3, next_weights(w2, 3).items())
        with pytest.raises(WeightSyncError, match="weight version 2: superseded by version 3"):
            receiver.apply(u2, target)
        receiver.apply(u3, target)
        assert target.weight_version == 3
        assert {i: b.data_ptr() for i, b in receiver._recv_buffers.items()} == ptrs
        with pytest.raises(WeightSyncError, match="only rank 0 publishes"):
            receiver.publish(9, w1.items())
    finally:
        sender.close()
        receiver.close()


def test_two_processes_on_loopback() -> None:
    """A sender and a receiver started as separate processes exchange two versions exactly."""
    port = free_port()
    peer = str(Path(__file__).with_name("broadcast_peer.py"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, peer, str(rank), str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in (0, 1)
    ]
    send, recv = procs
    got = []
    try:
        for v in (1, 2):
            assert send.stdout.readline().strip() == f"published {v}"
            recv.stdin.write(f"{v}\n")
            recv.stdin.flush()
            got.append(recv.stdout.readline().strip())
            send.stdin.write("next\n")
            send.stdin.flush()
        recv.stdin.close()
        send.stdin.close()
        codes = [p.wait(timeout=20) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert got == ["ok 1", "ok 2"], [p.stderr.read() for p in procs]
    assert codes == [0, 0], [p.stderr.read() for p in procs]
