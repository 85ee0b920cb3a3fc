"""DiskDeltaTransport with an fp32 base checkpoint served in bf16 (the README recipe), the newest
complete version lookup, and an update's handle crossing a process boundary as JSON."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import DictTarget, assert_bitwise_equal
from rl_core.types import WeightUpdate
from rl_weightsync import DiskDeltaTransport, DiskFullTransport

NAMES = ("model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight")


def _fp32_base(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """An fp32 Hugging Face checkpoint (what an fp32 trainer starts from) plus an int buffer."""
    g = torch.Generator().manual_seed(0)
    w0 = {n: torch.randn(16, 8, generator=g) for n in NAMES[:2]}
    w0[NAMES[2]] = torch.randn(8, generator=g)
    w0["model.position_ids"] = torch.arange(6)  # not floating: never cast
    base = tmp_path / "base"
    base.mkdir()
    save_file(w0, str(base / "model.safetensors"))
    (base / "config.json").write_text("{}")
    return base, w0


def _step(w: dict[str, torch.Tensor], v: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(v)
    out = {k: t.clone() for k, t in w.items()}
    for n in NAMES[:2]:  # the norm weight stays: an unchanged tensor is not in the delta
        out[n] = out[n] + 0.05 * torch.randn(out[n].shape, generator=g)
    return out


def _served(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.to(torch.bfloat16) if t.is_floating_point() else t for k, t in w.items()}


@pytest.mark.parametrize("receiver_serve_dtype", [None, "bfloat16"])
def test_fp32_base_served_bf16_several_versions(
    tmp_path: Path, receiver_serve_dtype: str | None
) -> None:
    """The README recipe: the receiver (with or without serve_dtype in its own config) seeds its
    local checkpoint from the fp32 base cast to the sender's serve dtype, so every delta applies
    and the local checkpoint and target hold exactly the bf16 cast of the trainer's weights.
    Before the fix the first delta failed ("needs the tensor as bfloat16 ... has float32")."""
    base, w = _fp32_base(tmp_path)
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync", base_checkpoint=base, serve_dtype="bfloat16"
        )
    )
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync",
            local_dir=tmp_path / "local",
            base_checkpoint=base,
            serve_dtype=receiver_serve_dtype,
        )
    )
    target = DictTarget(_served(w), version=0)
    for v in (1, 2, 3, 4):
        w = _step(w, v)
        update = sender.publish(v, w.items())
        assert update.metadata["kind"] == "delta" and update.base_version == v - 1
        receiver.apply(update, target)
        assert target.weight_version == v
        assert_bitwise_equal(target.tensors, _served(w))
        assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), _served(w))
    assert receiver.local_version() == 4


def test_local_seeded_before_the_first_delta_is_recast(tmp_path: Path) -> None:
    """A receiver without serve_dtype that already seeded its local checkpoint in fp32
    (``local_version()`` before any update, or an older rl-weightsync) recasts it from the base
    when the first delta says the sender serves bf16."""
    base, w0 = _fp32_base(tmp_path)
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync", base_checkpoint=base, serve_dtype="bfloat16"
        )
    )
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync", local_dir=tmp_path / "local", base_checkpoint=base
        )
    )
    assert receiver.local_version() == 0
    assert load_file(str(tmp_path / "local" / "model.safetensors"))[NAMES[0]].dtype == torch.float32
    w = _step(w0, 1)
    target = DictTarget(_served(w0), version=0)
    receiver.apply(sender.publish(1, w.items()), target)
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), _served(w))


def test_receiver_serve_dtype_disagreeing_with_sender_refused(tmp_path: Path) -> None:
    base, w = _fp32_base(tmp_path)
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync", base_checkpoint=base, serve_dtype="bfloat16"
        )
    )
    receiver = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync",
            local_dir=tmp_path / "local",
            base_checkpoint=base,
            serve_dtype="float16",
        )
    )
    target = DictTarget(_served(w), version=0)
    with pytest.raises(WeightSyncError, match="serve_dtype.*float16.*bfloat16"):
        receiver.apply(sender.publish(1, _step(w, 1).items()), target)
    assert target.weight_version == 0 and target.load_calls == 0


_OTHER_PROCESS = """
import json, sys
import torch
from safetensors.torch import load_file
from rl_core.testing.weight_transport import DictTarget
from rl_core.types import WeightUpdate
from rl_weightsync import DiskDeltaTransport
sync, local, base = sys.argv[1:4]
receiver = DiskDeltaTransport(DiskDeltaTransport.Config(
    directory=sync, local_dir=local, base_checkpoint=base))
w0 = load_file(base + "/model.safetensors")  # the engine starts on the base, served in bf16
target = DictTarget(
    {k: v.bfloat16() if v.is_floating_point() else v for k, v in w0.items()}, version=0)
for line in sys.stdin:
    update = WeightUpdate(**json.loads(line))
    receiver.apply(update, target)
print(json.dumps({"version": target.weight_version, "newest": receiver.newest_version()}))
"""


def test_other_process_receives_json_handles(tmp_path: Path) -> None:
    """The receiver in another process gets each update as one JSON line
    (``dataclasses.asdict(update)``) and ends with the local checkpoint equal to the bf16 cast."""
    base, w = _fp32_base(tmp_path)
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(
            directory=tmp_path / "sync", base_checkpoint=base, serve_dtype="bfloat16"
        )
    )
    lines = []
    for v in (1, 2, 3):
        w = _step(w, v)
        lines.append(json.dumps(dataclasses.asdict(sender.publish(v, w.items()))))
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _OTHER_PROCESS,
            str(tmp_path / "sync"),
            str(tmp_path / "local"),
            str(base),
        ],
        input="\n".join(lines),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"version": 3, "newest": 3}
    assert_bitwise_equal(load_file(str(tmp_path / "local" / "model.safetensors")), _served(w))


@pytest.mark.parametrize("cls", [DiskDeltaTransport, DiskFullTransport])
def test_newest_version_and_update_for(tmp_path: Path, cls: type) -> None:
    """``versions`` / ``newest_version()`` list complete versions only (a staged or markerless
    directory is not one); ``update_for(v)`` rebuilds the handle a receiver applies, equal to
    the one ``publish`` returned in everything a receiver reads."""
    transport = cls(cls.Config(directory=tmp_path / "sync", keep_versions=3))
    assert transport.versions == [] and transport.newest_version() is None
    g = torch.Generator().manual_seed(1)
    w = {"a": torch.randn(4, 4, generator=g), "b": torch.randn(4, generator=g)}
    published = {}
    for v in (1, 2, 3, 5):
        w = {k: t + 0.01 * v for k, t in w.items()}
        published[v] = transport.publish(v, w.items())
    (tmp_path / "sync" / "weight_v000009").mkdir()  # no COMPLETE marker: not a version
    kept = [1, 2, 3, 5] if cls is DiskDeltaTransport else [2, 3, 5]  # delta: newest full too
    assert transport.versions == kept and transport.newest_version() == 5
    assert transport.version_dir(5) == Path(published[5].location)
    late = cls(
        cls.Config(directory=tmp_path / "sync")
        if cls is DiskFullTransport
        else cls.Config(directory=tmp_path / "sync", local_dir=tmp_path / "local")
    )
    rebuilt = late.update_for(5)
    assert rebuilt == published[5]
    with pytest.raises(WeightSyncError, match="weight version 4: no complete.*newest_version"):
        late.update_for(4)  # never published


def test_update_for_lets_a_late_receiver_follow_the_chain(tmp_path: Path) -> None:
    """A receiver that only sees the sync directory walks from the newest full version to the
    newest version with ``update_for`` and ends bitwise on the trainer's weights."""
    sender = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=tmp_path / "sync", full_every=3, keep_versions=3)
    )
    w = {"a": torch.randn(8, 8), "b": torch.randn(8)}
    for v in range(1, 6):
        w = {k: t + 0.01 for k, t in w.items()}
        sender.publish(v, w.items())
    late = DiskDeltaTransport(
        DiskDeltaTransport.Config(directory=tmp_path / "sync", local_dir=tmp_path / "late")
    )
    target = DictTarget()
    for v in late.versions:
        late.apply(late.update_for(v), target)
    assert target.weight_version == late.newest_version() == 5
    assert_bitwise_equal(target.tensors, w)


def test_update_handle_is_plain_json(tmp_path: Path) -> None:
    transport = DiskDeltaTransport(DiskDeltaTransport.Config(directory=tmp_path / "sync"))
    update = transport.publish(1, {"a": torch.ones(3)}.items())
    assert WeightUpdate(**json.loads(json.dumps(dataclasses.asdict(update)))) == update
