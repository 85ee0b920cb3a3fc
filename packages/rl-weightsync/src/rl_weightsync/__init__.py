"""rl-weightsync: move trained weights from the trainer into rollout engines, verified.

Transports (entry-point group ``rl.weight_transports``), each built from its nested ``Config``:

- ``inprocess``: :class:`InProcessTransport`, trainer and generator in one process.
- ``disk_full``: :class:`DiskFullTransport`, a complete Hugging Face checkpoint per version.
- ``disk_delta``: :class:`DiskDeltaTransport`, lossless XOR/overwrite deltas, zstd, checksummed.
- ``broadcast``: :class:`BroadcastTransport`, bucketed gloo/NCCL broadcast on a dedicated group.

Every transport also carries adapter-only updates (LoRA tensors in peft naming, marked with
:func:`rl_core.lora.with_adapter`): see :mod:`rl_weightsync.adapter`; a receiver refuses an update
that mixes adapters and full weights with :class:`MixedUpdateError`.

Shared pieces: :func:`iter_buckets`, :class:`Manifest`, :func:`safe_join`, checksums.
"""

from rl_weightsync.adapter import MixedUpdateError
from rl_weightsync.broadcast import BroadcastTransport
from rl_weightsync.bucketing import iter_buckets
from rl_weightsync.checksum import tensor_checksum, verify_checksum
from rl_weightsync.disk_delta import DiskDeltaTransport, decode_delta, encode_delta
from rl_weightsync.disk_full import DiskFullTransport, DiskWeightTarget
from rl_weightsync.inprocess import InProcessTransport
from rl_weightsync.manifest import Manifest, TensorEntry, safe_join
from rl_weightsync.version import __version__

__all__ = [
    "BroadcastTransport",
    "DiskDeltaTransport",
    "DiskFullTransport",
    "DiskWeightTarget",
    "InProcessTransport",
    "Manifest",
    "MixedUpdateError",
    "TensorEntry",
    "__version__",
    "decode_delta",
    "encode_delta",
    "iter_buckets",
    "safe_join",
    "tensor_checksum",
    "verify_checksum",
]
