"""One rank of the two-process broadcast test; driven line by line over stdin/stdout.

Sender (rank 0): publishes versions 1 and 2, printing ``published <v>`` and waiting for a line on
stdin before the next. Receiver (rank 1): reads a version per stdin line, applies it and prints
``ok <v>`` (bitwise equal) or ``bad <v>: <why>``.
"""

from __future__ import annotations

import sys

import torch

from rl_core.testing.weight_transport import DictTarget, assert_bitwise_equal
from rl_core.types import WeightUpdate
from rl_weightsync.broadcast import BroadcastTransport


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    w = {f"model.layers.{i}.weight": torch.randn(64, 33, generator=g) for i in range(6)}
    w["model.norm.weight"] = torch.randn(64, generator=g).to(torch.bfloat16)
    return w


def main(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    cfg = BroadcastTransport.Config(
        rank=rank, world_size=2, port=port, bucket_bytes=4096, timeout_s=20
    )
    t = BroadcastTransport(cfg)
    try:
        if rank == 0:
            for v in (1, 2):
                t.publish(v, weights(v).items())
                print(f"published {v}", flush=True)
                sys.stdin.readline()
        else:
            target = DictTarget()
            for line in sys.stdin:
                v = int(line)
                t.apply(WeightUpdate(version=v, base_version=None, transport="broadcast"), target)
                try:
                    assert target.weight_version == v
                    assert_bitwise_equal(target.tensors, weights(v))
                    print(f"ok {v}", flush=True)
                except AssertionError as e:
                    print(f"bad {v}: {e}", flush=True)
    finally:
        t.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
