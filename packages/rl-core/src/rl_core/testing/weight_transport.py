"""Conformance suite for :class:`~rl_core.interfaces.WeightTransport`, and a fake target.

Subclass the suite in your transport's tests and provide the sender and, when it differs, the
receiver side::

    class TestMyTransport(WeightTransportConformance):
        @pytest.fixture
        def transport(self, tmp_path):
            return MyTransport(MyTransport.Config(directory=tmp_path / "sync"))

Delta transports set ``supports_delta = True`` (skipped versions must then be refused). Set
``supports_corruption_injection = True`` and implement :meth:`WeightTransportConformance.corrupt`
to run the corrupt-payload tests.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import pytest
import torch

from rl_core.errors import WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.testing._base import ConformanceSuite
from rl_core.types import WeightUpdate

__all__ = [
    "DictTarget",
    "WeightTransportConformance",
    "assert_bitwise_equal",
    "next_weights",
    "sample_weights",
]


class DictTarget:
    """In-memory :class:`~rl_core.interfaces.WeightTarget`: a dict of tensors and a version.

    ``load_weights`` materialises every tensor first and only then replaces the dict, so a failure
    while iterating leaves the target unchanged.
    """

    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, *, version: int = 0) -> None:
        """Start on ``version`` with copies of ``tensors`` (empty by default)."""
        self.tensors: dict[str, torch.Tensor] = {
            k: v.detach().clone() for k, v in (tensors or {}).items()
        }
        """The loaded weights by Hugging Face name."""
        self.load_calls = 0
        """Number of completed ``load_weights`` calls."""
        self._version = version

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""
        return self._version

    @property
    def weight_names(self) -> frozenset[str]:
        """Names of the tensors held; receivers that check name sets compare updates to it."""
        return frozenset(self.tensors)

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Replace the named tensors (copied) and set ``version``."""
        new = {name: t.detach().clone() for name, t in named_tensors}
        self.tensors.update(new)
        self._version = version
        self.load_calls += 1


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bitwise_equal(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]
) -> None:
    """Same names, dtypes, shapes and raw bytes (so ``-0.0`` vs ``0.0`` and NaN payloads count)."""
    assert sorted(actual) == sorted(expected), (
        f"names differ: {sorted(actual)} vs {sorted(expected)}"
    )
    for name, exp in expected.items():
        got = actual[name]
        assert got.dtype == exp.dtype, f"{name}: dtype {got.dtype} != {exp.dtype}"
        assert tuple(got.shape) == tuple(exp.shape), (
            f"{name}: shape {tuple(got.shape)} != {tuple(exp.shape)}"
        )
        assert _raw(got) == _raw(exp), f"{name}: bytes differ"


def sample_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Small weights in Hugging Face names: fp32 and bf16, 2-d, 1-d, 0-d and empty, with NaN,
    infinities and negative zero in one tensor so only a bitwise-exact transport passes."""
    g = torch.Generator().manual_seed(seed)
    special = torch.randn(7, generator=g)
    special[0], special[1], special[2], special[3] = -0.0, float("inf"), float("-inf"), float("nan")
    return {
        "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8, generator=g),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.special": special,
        "model.scalar": torch.randn((), generator=g),
        "model.empty_bf16": torch.empty(0, 3, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(16, 8, generator=g),
    }


def next_weights(prev: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A training step's worth of change: small updates to some tensors, others left unchanged."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {k: v.clone() for k, v in prev.items()}
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.scalar",
    ):
        t = out[name]
        out[name] = (t.float() + 1e-2 * torch.randn(t.shape, generator=g)).to(t.dtype)
    return out


class WeightTransportConformance(ConformanceSuite):
    """Standard tests every :class:`~rl_core.interfaces.WeightTransport` must pass.

    Fixtures to provide: ``transport`` (the sender side) and, if receivers use a separate object
    (a different host-local directory, another rank), ``receiver``; it defaults to ``transport``.
    """

    __test__ = False

    supports_delta: ClassVar[bool] = False
    """Updates may be deltas on a base version: skipped versions must be refused."""
    supports_corruption_injection: ClassVar[bool] = False
    """:meth:`corrupt` can damage a published payload (runs the corruption tests)."""

    @pytest.fixture
    def transport(self) -> WeightTransport:
        """The sender side under test; override in your subclass."""
        raise NotImplementedError("override the `transport` fixture in your conformance subclass")

    @pytest.fixture
    def receiver(self, transport: WeightTransport) -> WeightTransport:
        """The receiver side; the same object as ``transport`` unless overridden."""
        return transport

    def corrupt(self, transport: WeightTransport, update: WeightUpdate) -> str:
        """Flip one bit of one tensor's payload of ``update``; return the tensor's name."""
        raise NotImplementedError("set supports_corruption_injection and implement corrupt()")

    # -- helpers --------------------------------------------------------------------------------

    @staticmethod
    def _publish(
        transport: WeightTransport, version: int, weights: dict[str, torch.Tensor]
    ) -> WeightUpdate:
        return transport.publish(version, iter(list(weights.items())))

    @staticmethod
    def _refused(
        receiver: WeightTransport, update: WeightUpdate, target: DictTarget
    ) -> WeightSyncError:
        before = {k: v.clone() for k, v in target.tensors.items()}
        version, calls = target.weight_version, target.load_calls
        with pytest.raises(WeightSyncError) as info:
            receiver.apply(update, target)
        assert target.weight_version == version, "a refused update changed the target's version"
        assert target.load_calls == calls, "a refused update called load_weights"
        assert_bitwise_equal(target.tensors, before)
        return info.value

    # -- tests ----------------------------------------------------------------------------------

    def test_name_and_update_fields(self, transport: WeightTransport) -> None:
        """``publish`` returns a WeightUpdate carrying the version and the transport's name.

        Troubleshooting: set the class attribute ``name`` to your entry-point name and copy it into
        ``WeightUpdate.transport``; ``version`` must be the one passed to ``publish``.
        """
        update = self._publish(transport, 1, sample_weights())
        assert type(transport).name, "WeightTransport.name is empty"
        assert update.transport == type(transport).name
        assert update.version == 1

    def test_round_trip_bitwise_equal(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """Published weights arrive with the same names, dtypes, shapes and bytes.

        Troubleshooting: the sample holds bf16, fp32, 0-d and empty tensors and NaN/inf/-0.0
        values; compare raw bytes, keep dtypes (no upcast), keep 0-d shapes ``()``.
        """
        weights = sample_weights()
        update = self._publish(transport, 1, weights)
        target = DictTarget()
        receiver.apply(update, target)
        assert target.weight_version == 1
        assert_bitwise_equal(target.tensors, weights)

    def test_consecutive_versions_round_trip(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """Three versions applied in order each arrive bitwise equal.

        Troubleshooting: delta transports must advance their snapshot (sender) and local copy
        (receiver) after each version; a stale snapshot shows up here as wrong bytes in v2 or v3.
        """
        target = DictTarget()
        weights = sample_weights()
        for version in (1, 2, 3):
            if version > 1:
                weights = next_weights(weights, version)
            receiver.apply(self._publish(transport, version, weights), target)
            assert target.weight_version == version
            assert_bitwise_equal(target.tensors, weights)

    def test_publish_copies_the_weights(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """Changing the trainer's tensors after ``publish`` does not change the published version.

        Troubleshooting: ``publish`` must copy (or serialise) the tensors before returning; the
        trainer keeps training the originals in place.
        """
        weights = sample_weights()
        expected = {k: v.clone() for k, v in weights.items()}
        update = self._publish(transport, 1, weights)
        for t in weights.values():
            t.add_(1)
        target = DictTarget()
        receiver.apply(update, target)
        assert_bitwise_equal(target.tensors, expected)

    def test_publish_versions_must_increase(self, transport: WeightTransport) -> None:
        """Publishing a version not above the last published one raises WeightSyncError.

        Troubleshooting: keep the last published version and refuse ``version <= last`` before
        writing anything; name both versions in the message.
        """
        self._publish(transport, 2, sample_weights())
        for bad in (2, 1):
            with pytest.raises(WeightSyncError, match=str(bad)):
                self._publish(transport, bad, sample_weights())

    def test_replayed_version_refused(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """Applying the same update twice is refused and the target stays as it is.

        Troubleshooting: compare ``update.version`` with the receiver's ``current_version`` before
        reading the payload and raise WeightSyncError naming the version.
        """
        weights = sample_weights()
        update = self._publish(transport, 1, weights)
        target = DictTarget()
        receiver.apply(update, target)
        err = self._refused(receiver, update, target)
        assert "1" in str(err)
        assert_bitwise_equal(target.tensors, weights)

    def test_out_of_order_refused(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """An older update arriving after a newer one is refused; the target keeps the newer one.

        Troubleshooting: ``receive`` must refuse ``update.version <= current_version``.
        """
        w1 = sample_weights()
        w2 = next_weights(w1, 2)
        u1 = self._publish(transport, 1, w1)
        target = DictTarget()
        receiver.apply(u1, target)
        u2 = self._publish(transport, 2, w2)
        receiver.apply(u2, target)
        err = self._refused(receiver, u1, target)
        assert "1" in str(err)
        assert target.weight_version == 2
        assert_bitwise_equal(target.tensors, w2)

    def test_unknown_version_refused(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """A handle for a version that was never published is refused, target intact.

        Troubleshooting: look the version up in what the sender actually wrote (index, manifest,
        store) and raise WeightSyncError naming it when absent, instead of loading nothing.
        """
        update = self._publish(transport, 1, sample_weights())
        target = DictTarget()
        receiver.apply(update, target)
        ghost = WeightUpdate(
            version=7,
            base_version=None,
            transport=update.transport,
            location=update.location,
            metadata=update.metadata,
        )
        err = self._refused(receiver, ghost, target)
        assert "7" in str(err)

    def test_skipped_version(self, transport: WeightTransport, receiver: WeightTransport) -> None:
        """A receiver on v1 given v3: refused by delta transports, loaded by full ones.

        Troubleshooting: a delta names its base; refuse it unless ``base_version`` equals the
        receiver's current version. A full update is self-contained and may skip versions.
        """
        w1 = sample_weights()
        w2 = next_weights(w1, 2)
        w3 = next_weights(w2, 3)
        target = DictTarget()
        receiver.apply(self._publish(transport, 1, w1), target)
        self._publish(transport, 2, w2)
        u3 = self._publish(transport, 3, w3)
        if self.supports_delta:
            err = self._refused(receiver, u3, target)
            assert "3" in str(err)
            assert_bitwise_equal(target.tensors, w1)
        else:
            receiver.apply(u3, target)
            assert target.weight_version == 3
            assert_bitwise_equal(target.tensors, w3)

    def test_corrupt_payload_refused(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """A flipped bit in a payload raises WeightSyncError naming tensor and version; the target
        stays on its previous version with its previous bytes.

        Troubleshooting: verify every checksum before calling ``load_weights`` (and, for disk
        transports, before touching the receiver's local copy, or restore it on failure).
        """
        if not self.supports_corruption_injection:
            pytest.skip("transport does not support corruption injection")
        w1 = sample_weights()
        target = DictTarget()
        receiver.apply(self._publish(transport, 1, w1), target)
        update = self._publish(transport, 2, next_weights(w1, 2))
        name = self.corrupt(transport, update)
        err = self._refused(receiver, update, target)
        assert name in str(err) and "2" in str(err), f"error must name tensor and version: {err}"
        assert_bitwise_equal(target.tensors, w1)

    def test_receiver_recovers_after_refusal(
        self, transport: WeightTransport, receiver: WeightTransport
    ) -> None:
        """After refused updates (unknown version, replay) the next good one applies bitwise equal.

        Troubleshooting: a refused update must not leave half-applied state (a partially patched
        local checkpoint, a consumed channel message, an advanced version counter) behind.
        """
        w1 = sample_weights()
        w2 = next_weights(w1, 2)
        target = DictTarget()
        u1 = self._publish(transport, 1, w1)
        receiver.apply(u1, target)
        u2 = self._publish(transport, 2, w2)
        ghost = WeightUpdate(
            version=9,
            base_version=u2.base_version,
            transport=u2.transport,
            location=u2.location,
            metadata=u2.metadata,
        )
        self._refused(receiver, ghost, target)
        self._refused(receiver, u1, target)
        receiver.apply(u2, target)
        assert target.weight_version == 2
        assert_bitwise_equal(target.tensors, w2)
