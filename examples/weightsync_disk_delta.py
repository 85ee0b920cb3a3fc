"""rl-weightsync between two processes: an fp32 trainer publishes ``disk_delta`` versions served
in bf16; a receiver process (a rollout engine) applies them from update handles sent as JSON.

The handle (``rl_core.types.WeightUpdate``) is a small frozen dataclass of plain values:
``json.dumps(dataclasses.asdict(update))`` on the trainer, ``WeightUpdate(**json.loads(line))``
on the engine. An engine that sees only the shared directory can instead poll
``transport.newest_version()`` and apply ``transport.update_for(v)``.

    OMP_NUM_THREADS=1 python examples/weightsync_disk_delta.py
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rl_core.types import WeightUpdate
from rl_weightsync import DiskDeltaTransport


class Engine:
    """A stand-in rollout engine: any object with ``weight_version`` and ``load_weights``."""

    def __init__(self) -> None:
        self.weight_version = 0
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        self.weights.update({n: t.clone() for n, t in named_tensors})
        self.weight_version = version


def engine_process(sync_dir: str, local_dir: str, base: str) -> None:
    """The receiver: one JSON handle per stdin line; prints the version it is on."""
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=sync_dir, local_dir=local_dir, base_checkpoint=base)
    )  # no serve_dtype needed: the receiver follows the sender's (recorded in each manifest)
    engine = Engine()
    for line in sys.stdin:
        update = WeightUpdate(**json.loads(line))
        receiver.apply(update, engine)  # verify every checksum, patch local_dir, then load
        print(f"engine on version {engine.weight_version}", flush=True)


def main(root: Path) -> None:
    """Trainer: fp32 weights, three optimizer steps, each published as a bf16 delta."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))  # fp32
    base = root / "base"  # the checkpoint the engines start from (fp32 on disk)
    base.mkdir(parents=True)
    save_file(
        {n: p.detach().contiguous() for n, p in model.state_dict().items()},
        str(base / "model.safetensors"),
    )
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=root / "sync", base_checkpoint=base, serve_dtype="bfloat16"
        )
    )
    engine = subprocess.Popen(
        [sys.executable, __file__, "engine", str(root / "sync"), str(root / "local"), str(base)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    for version in (1, 2, 3):
        loss = model(torch.randn(16, 64)).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        update = sender.publish(version, model.state_dict().items())
        engine.stdin.write(json.dumps(dataclasses.asdict(update)) + "\n")
        engine.stdin.flush()
        print(
            f"published v{version} ({update.metadata['kind']}, {update.metadata['bytes']} of "
            f"{update.metadata['full_bytes']} bytes); {engine.stdout.readline().strip()}"
        )
    engine.stdin.close()
    assert engine.wait(timeout=60) == 0
    served = load_file(str(root / "local" / "model.safetensors"))
    for name, p in model.state_dict().items():
        assert torch.equal(served[name], p.to(torch.bfloat16)), name
    print(
        f"engine's local checkpoint == the trainer's weights cast to bf16 ({len(served)} tensors)"
    )
    print(f"newest complete version in {root / 'sync'}: {sender.newest_version()}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["engine"]:
        engine_process(*sys.argv[2:5])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
