"""BroadcastTransport: conformance (sender and receiver ranks in one process, two threads) and a
real two-process run on 127.0.0.1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


def _receive_async(receiver: BroadcastTransport, update, current: int) -> list:
    """Receive ``update`` in a thread (every member must join the broadcast at once)."""
    out: list = []

    def run() -> None:
        try:
            out.append({n: t.clone() for n, t in receiver.receive(update, current_version=current)})
        except Exception as exc:  # surfaced by the caller's assert
            out.append(exc)

    th = threading.Thread(target=run)
    th.start()
    out.append(th)
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal (NaN included), same dtype and shape."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


def _joined(*pending: list) -> list:
    for p in pending:
        p[0].join(30)
    return [p[1] for p in pending]


def test_take_over_resyncs_a_new_member_on_a_re_formed_group() -> None:
    """A receiver joins late (a restarted engine): a new, larger group takes over the old
    sender, re-posts its newest version pinned (a later publish does not supersede it), the new
    member gets it, the old member discards it, and both then receive the next version."""
    old_sender, old_recv = connected_pair()
    w1 = sample_weights()
    w2 = next_weights(w1, 2)
    keep = DictTarget()
    old_recv.apply(old_sender.publish(1, w1.items()), keep)
    port = free_port()

    def cfg(rank: int) -> BroadcastTransport.Config:
        return BroadcastTransport.Config(
            rank=rank, world_size=3, port=port, group_name="g1", timeout_s=30
        )

    sender, member, fresh = (BroadcastTransport(cfg(r)) for r in (0, 1, 2))
    try:
        again = sender.take_over(old_sender)
        assert again is not None and again.version == 1 and "g1" in again.location
        u2 = sender.publish(2, w2.items())  # pinned version 1 is not superseded
        got = _joined(_receive_async(member, again, 0), _receive_async(fresh, again, 0))
        for g in got:
            assert isinstance(g, dict), g
            assert g.keys() == w1.keys() and all(_same(g[k], w1[k]) for k in w1)
        got = _joined(_receive_async(member, u2, 1), _receive_async(fresh, u2, 1))
        for g in got:
            assert isinstance(g, dict), g
            assert g.keys() == w2.keys() and all(_same(g[k], w2[k]) for k in w2)
        with pytest.raises(WeightSyncError, match="already published"):
            sender.take_over(old_sender)
    finally:
        for t in (sender, member, fresh, old_recv):
            t.close()


def test_take_over_of_a_silent_sender_returns_none_and_closed_receiver_stops_waiting() -> None:
    port = free_port()
    quiet = BroadcastTransport(BroadcastTransport.Config(rank=0, world_size=2, port=free_port()))
    sender = BroadcastTransport(BroadcastTransport.Config(rank=0, world_size=3, port=port))
    assert sender.take_over(quiet) is None
    receivers = [
        BroadcastTransport(BroadcastTransport.Config(rank=r, world_size=3, port=port, timeout_s=30))
        for r in (1, 2)
    ]
    try:
        update = sender.publish(1, sample_weights().items())
        # Only receiver 1 joins: rank 2 never acknowledges, so receiver 1 waits for the go ...
        pending = _receive_async(receivers[0], update, 0)
        time.sleep(0.5)
        receivers[0].close()  # ... until its group is re-formed (closed): it stops at once
        (err,) = _joined(pending)
        assert isinstance(err, WeightSyncError) and "was closed" in str(err), err
    finally:
        sender.close()
        receivers[1].close()


def test_serve_dtype_casts_floating_tensors_only() -> None:
    port = free_port()
    ts = [
        BroadcastTransport(
            BroadcastTransport.Config(
                rank=r, world_size=2, port=port, serve_dtype="bfloat16", timeout_s=30
            )
        )
        for r in (0, 1)
    ]
    w = {**sample_weights(), "ids": torch.arange(5)}
    try:
        update = ts[0].publish(1, w.items())
        (got,) = _joined(_receive_async(ts[1], update, 0))
        assert isinstance(got, dict), got
        assert _same(got["ids"], w["ids"])
        for k, t in w.items():
            if t.is_floating_point():
                assert _same(got[k], t.to(torch.bfloat16)), k
    finally:
        for t in ts:
            t.close()
    with pytest.raises(WeightSyncError, match="serve_dtype"):
        BroadcastTransport(BroadcastTransport.Config(rank=0, world_size=2, serve_dtype="fp7"))


def test_published_header_is_visible_to_another_connection_at_once() -> None:
    """``publish`` returns only once the server stored the header: TCPStore's ``set`` does not
    wait for it, and a receiver on its own connection that looked first called the version never
    published (a CI flake, ~0.2% per publish before the fix; 1500 publishes here)."""
    sender, receiver = connected_pair()
    try:
        receiver._connect_store()
        store = receiver._store
        weights = {"w": torch.zeros(4)}
        missing = [
            v
            for v in range(1, 1501)
            if sender.publish(v, weights.items()) and not store.check([f"header/{v}"])
        ]
        assert missing == []
    finally:
        sender.close()
        receiver.close()
