"""Adapter-only updates: what every transport checks when the tensors are a LoRA adapter.

An adapter-only :class:`~rl_core.types.WeightUpdate` carries the adapter's tensors in peft
naming (``base_model.model.<module>.lora_A.weight`` ...) and the marker of
:func:`rl_core.lora.with_adapter` in its ``metadata``. The transports move it like any other
version (full, delta, broadcast) and record its *payload kind* where the receiver can check it:
the manifest's ``extra`` on disk, the stored copy in process, the header of a broadcast. The kind
is read from the tensor names, so both ways of marking an update work::

    update = transport.publish(v, adapter_tensors, metadata=with_adapter(..).metadata)  # or
    update = with_adapter(transport.publish(v, adapter_tensors), lora, base_model)

A receiver refuses an update whose marker and payload disagree (a marked update holding full
weights, or adapter tensors without the marker, which a target would load as model weights) and
a delta whose base holds the other kind (an adapter delta on a full-weights version, or the
reverse) with :class:`MixedUpdateError`.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from typing import Any

from rl_core.errors import WeightSyncError
from rl_core.lora import ADAPTER_KEY, adapter_of, module_of
from rl_core.types import WeightUpdate

__all__ = [
    "ADAPTER",
    "WEIGHTS",
    "MixedUpdateError",
    "check_delta_base",
    "check_update_kind",
    "is_adapter_name",
    "payload_kind",
    "publish_extra",
]

ADAPTER = "adapter"
"""Payload kind of an adapter-only version (peft-named LoRA tensors)."""
WEIGHTS = "weights"
"""Payload kind of a full-weights version (model tensors)."""


class MixedUpdateError(WeightSyncError):
    """An update mixes adapter-only and full-weights versions: its marker disagrees with its
    tensors, its tensors mix both kinds, or it is a delta on a version of the other kind."""


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a LoRA adapter tensor name (``...lora_A.weight``/``lora_B.weight``)."""
    try:
        module_of(name)
    except WeightSyncError:
        return False
    return True


def payload_kind(names: Collection[str], *, version: int) -> str:
    """:data:`ADAPTER` if every name is an adapter tensor's, else :data:`WEIGHTS`.

    Raises:
        MixedUpdateError: some names are adapter tensors and others are not.
    """
    adapter = [n for n in names if is_adapter_name(n)]
    if not adapter:
        return WEIGHTS
    if len(adapter) == len(names):
        return ADAPTER
    other = sorted(set(names) - set(adapter))
    raise MixedUpdateError(
        f"weight version {version}: {len(adapter)} adapter tensors ({adapter[0]!r}, ...) and "
        f"{len(other)} model tensors ({other[0]!r}, ...) in one update; publish the adapter "
        "(Policy.named_adapter_weights) and full weights as separate versions"
    )


def _marker(metadata: Mapping[str, Any], version: int) -> dict[str, Any] | None:
    info = adapter_of(
        WeightUpdate(version=version, base_version=None, transport="", metadata=metadata)
    )
    return None if info is None else info.to_dict()


def publish_extra(
    names: Collection[str], metadata: Mapping[str, Any] | None, *, version: int
) -> dict[str, Any]:
    """What a sender records with ``version`` (manifest ``extra``, header): the payload kind and,
    when ``metadata`` carries the adapter marker, the marker itself.

    Raises:
        MixedUpdateError: the names mix kinds, or ``metadata`` marks an adapter while the
            tensors are model weights.
    """
    kind = payload_kind(names, version=version)
    marker = _marker(metadata or {}, version)
    if marker is not None and kind != ADAPTER:
        raise MixedUpdateError(
            f"publish of weight version {version}: metadata[{ADAPTER_KEY!r}] marks an adapter, "
            "but the tensors are model weights (no '<module>.lora_A.weight' names); publish the "
            "adapter's tensors (Policy.named_adapter_weights) or drop the marker"
        )
    out: dict[str, Any] = {"payload": kind}
    if marker is not None:
        out[ADAPTER_KEY] = marker
    return out


def check_update_kind(
    update: WeightUpdate, names: Collection[str], recorded: Mapping[str, Any] | None = None
) -> str:
    """The payload kind of ``update`` after checking that its marker agrees with its tensors
    (``names``, all of the version) and with the marker the sender recorded (``recorded``: the
    manifest's ``extra`` or the header).

    Raises:
        MixedUpdateError: they disagree.
    """
    version = update.version
    recorded = recorded or {}
    kind = str(recorded.get("payload") or payload_kind(names, version=version))
    marker = _marker(update.metadata, version)
    if kind == ADAPTER and marker is None:
        raise MixedUpdateError(
            f"weight version {version} holds adapter tensors, but the update is not marked as "
            f"adapter-only (metadata[{ADAPTER_KEY!r}]); a target would load them as model "
            "weights. Mark it with rl_core.lora.with_adapter(update, lora) or publish with "
            "metadata=with_adapter(...).metadata"
        )
    if kind != ADAPTER and marker is not None:
        raise MixedUpdateError(
            f"weight version {version} is marked as adapter-only (metadata[{ADAPTER_KEY!r}]), but "
            "holds full model weights; mark only updates of the adapter's tensors"
        )
    stored = recorded.get(ADAPTER_KEY)
    if stored is not None and marker is not None and _canonical(stored) != _canonical(marker):
        raise MixedUpdateError(
            f"weight version {version}: the update's adapter {marker['name']!r} differs from the "
            f"one published ({stored.get('name')!r}, its config); pass the update publish returned"
        )
    return kind


def _canonical(marker: Mapping[str, Any]) -> str:
    """``marker`` as sorted JSON (a recorded marker went through JSON: tuples became lists)."""
    return json.dumps(marker, sort_keys=True, default=str)


def check_delta_base(version: int, kind: str, base_version: int, base_kind: str) -> None:
    """Refuse a delta of one payload kind on a base of the other.

    Raises:
        MixedUpdateError: ``kind`` differs from ``base_kind``.
    """
    if kind == base_kind:
        return
    what = {ADAPTER: "an adapter-only", WEIGHTS: "a full-weights"}
    raise MixedUpdateError(
        f"weight version {version} is {what.get(kind, kind)} delta on version {base_version}, "
        f"which holds {'full weights' if base_kind == WEIGHTS else 'an adapter'}; a delta applies "
        "only to a version of its own kind. Apply a full version of this kind first (publish "
        "adapters and full weights through separate transports/directories)"
    )
