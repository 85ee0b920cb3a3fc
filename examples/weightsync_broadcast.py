"""rl-weightsync between two processes over a gloo broadcast: the trainer (rank 0) publishes,
a rollout engine (rank 1) receives each version straight into its weights.

The group is the transport's own (a ``TCPStore`` hosted by rank 0 plus a gloo group on it), so
neither process's default ``torch.distributed`` group is touched. The handle is JSON like every
``WeightUpdate``; for a broadcast it only names the version (the header with names, dtypes and
shapes travels through the store).

    OMP_NUM_THREADS=1 python examples/weightsync_broadcast.py
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
from collections.abc import Iterable

import torch

from rl_core.types import WeightUpdate
from rl_weightsync import BroadcastTransport


def weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's named weights (what a policy's ``named_weights()`` yields)."""
    return [(n, p.detach()) for n, p in model.state_dict().items()]


class Engine:
    """A stand-in rollout engine: any object with ``weight_version`` and ``load_weights``."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        # the yielded tensors are views into reused receive buffers: copy them
        self.weights.update({n: t.clone() for n, t in named_tensors})
        self.weight_version = version


def engine_process(port: int) -> None:
    """Rank 1: applies one JSON handle per stdin line, prints a checksum of what it holds."""
    receiver = BroadcastTransport(
        BroadcastTransport.Config(rank=1, world_size=2, port=port, timeout_s=60)
    )
    engine = Engine()
    try:
        for line in sys.stdin:
            receiver.apply(WeightUpdate(**json.loads(line)), engine)
            total = sum(float(t.double().sum()) for t in engine.weights.values())
            print(f"{engine.weight_version} {total!r}", flush=True)
    finally:
        receiver.close()


def main() -> None:
    """Rank 0: three optimizer steps, each published (cast to bf16) and checked on the engine."""
    with socket.socket() as s:  # a free port for the transport's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    engine = subprocess.Popen(
        [sys.executable, __file__, "engine", str(port)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    sender = BroadcastTransport(
        BroadcastTransport.Config(
            rank=0, world_size=2, port=port, serve_dtype="bfloat16", timeout_s=60
        )
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for version in (1, 2, 3):
            model(torch.randn(8, 32)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            update = sender.publish(version, weights(model))  # returns at once
            engine.stdin.write(json.dumps(dataclasses.asdict(update)) + "\n")
            engine.stdin.flush()
            got_version, got_total = engine.stdout.readline().split()
            want = sum(float(t.to(torch.bfloat16).double().sum()) for _, t in weights(model))
            assert int(got_version) == version and float(got_total) == want
            print(f"v{version}: engine holds the trainer's weights in bf16 (sum {want:.6f})")
        engine.stdin.close()
        assert engine.wait(timeout=60) == 0
    finally:
        sender.close()
        if engine.poll() is None:
            engine.kill()


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        engine_process(int(sys.argv[2]))
    else:
        main()
