"""InProcessTransport: conformance plus its own behaviour (pruning, copies, config checks)."""

from __future__ import annotations

import pytest
import torch

from rl_core.errors import WeightSyncError
from rl_core.testing.weight_transport import (
    DictTarget,
    WeightTransportConformance,
    assert_bitwise_equal,
    sample_weights,
)
from rl_core.types import WeightUpdate
from rl_weightsync.inprocess import InProcessTransport


class TestInProcessConformance(WeightTransportConformance):
    supports_corruption_injection = True

    @pytest.fixture
    def transport(self) -> InProcessTransport:
        return InProcessTransport(InProcessTransport.Config(keep_versions=3))

    def corrupt(self, transport: InProcessTransport, update: WeightUpdate) -> str:
        name, tensor = transport._versions[update.version].tensors[0]
        tensor.reshape(-1).view(torch.uint8)[0] ^= 1
        return name


def test_keeps_only_latest_versions() -> None:
    transport = InProcessTransport(InProcessTransport.Config(keep_versions=2))
    updates = [transport.publish(v, sample_weights(v).items()) for v in (1, 2, 3)]
    assert transport.versions == (2, 3)
    with pytest.raises(WeightSyncError, match="version 1 is not held"):
        transport.apply(updates[0], DictTarget())
    target = DictTarget()
    transport.apply(updates[2], target)
    assert_bitwise_equal(target.tensors, sample_weights(3))


def test_copies_leave_the_source_device_and_storage() -> None:
    weights = sample_weights()
    transport = InProcessTransport()
    update = transport.publish(1, weights.items())
    received = dict(transport.receive(update, current_version=0))
    for name, t in weights.items():
        if t.numel():
            assert received[name].data_ptr() != t.data_ptr(), name
    assert update.metadata["num_tensors"] == len(weights)
    assert update.metadata["bytes"] == sum(t.numel() * t.element_size() for t in weights.values())


def test_refuses_duplicate_names_and_foreign_updates() -> None:
    transport = InProcessTransport()
    with pytest.raises(WeightSyncError, match="appears twice"):
        transport.publish(1, [("a", torch.ones(2)), ("a", torch.ones(2))])
    foreign = WeightUpdate(version=1, base_version=None, transport="disk_full")
    with pytest.raises(WeightSyncError, match="disk_full"):
        transport.receive(foreign, current_version=0)


def test_bad_config_names_field() -> None:
    with pytest.raises(WeightSyncError, match="keep_versions"):
        InProcessTransport(InProcessTransport.Config(keep_versions=0))
    with pytest.raises(WeightSyncError, match="checksum"):
        InProcessTransport(InProcessTransport.Config(checksum="md5"))


def test_without_verify_still_round_trips() -> None:
    transport = InProcessTransport(InProcessTransport.Config(verify=False, device=None))
    weights = sample_weights()
    target = DictTarget()
    transport.apply(transport.publish(5, weights.items()), target)
    assert target.weight_version == 5
    assert_bitwise_equal(target.tensors, weights)
