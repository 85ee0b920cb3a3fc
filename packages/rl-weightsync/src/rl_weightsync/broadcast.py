"""Collective broadcast from the trainer's source rank to every generator rank.

The sender (rank 0) and the receivers (ranks 1..N) form a dedicated process group built directly
on a ``TCPStore`` (hosted by rank 0), so it never touches either side's default group: gloo on
CPU, NCCL when ``device`` is CUDA. The store is also the control plane: the sender posts each
version's header (names, dtypes, shapes, bucket layout), every receiver acknowledges it (or
refuses it), and only when all accepted does the sender broadcast the buckets. The collective
group itself forms at the first accepted version, once every member has acknowledged it, so a
missing member is caught by the handshake (``timeout_s``; a closed receiver stops waiting at
once) rather than inside the collective's initialisation::

    # trainer, rank 0 of the weight-sync group
    sender = BroadcastTransport(BroadcastTransport.Config(port=29600, world_size=2, rank=0))
    update = sender.publish(8, policy.named_weights())   # stages a copy, returns at once
    # generator process, rank 1
    receiver = BroadcastTransport(BroadcastTransport.Config(port=29600, world_size=2, rank=1))
    receiver.apply(update, generator)

``publish`` copies the weights into reused, bucketed staging buffers and returns; a background
thread performs the handshake and the broadcast. A newer ``publish`` supersedes a version that
receivers have not joined yet (full weights: receivers may skip versions). Receivers refuse a
replayed or older version locally, and a version the sender never posted, before joining any
collective.

A group is one fixed world. When a member must be replaced (a restarted rollout engine), the
owner forms a new group (a fresh ``group_name`` and port) and hands the old sender to the new
one with :meth:`BroadcastTransport.take_over`: the newest published version is posted again on
the new group, pinned (a later ``publish`` does not supersede it), so the new member can be
re-synced while the others join and discard it::

    new_sender = BroadcastTransport(new_config)         # rank 0 of the re-formed world
    update = new_sender.take_over(old_sender)            # closes the old one; None if nothing sent

``serve_dtype`` casts floating tensors before staging (``"bfloat16"`` halves the bytes of an fp32
trainer's weights); the header carries the dtypes, so receivers need not be told.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any, ClassVar

import torch
import torch.distributed as dist

from rl_core.config import NonNegInt, Port, PositiveFloat, PositiveInt, Range
from rl_core.errors import WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.lora import ADAPTER_KEY
from rl_core.types import WeightUpdate
from rl_weightsync.adapter import MixedUpdateError, check_update_kind, publish_extra
from rl_weightsync.bucketing import iter_buckets, tensor_nbytes
from rl_weightsync.manifest import dtype_from_name, dtype_name

__all__ = ["BroadcastTransport"]

_ALIGN = 64


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class BroadcastTransport(WeightTransport):
    """Bucketed broadcast over a dedicated gloo/NCCL group with a store-based version handshake.

    Tensors yielded by ``receive`` are views into receive buffers that are reused by the next
    ``receive``: a target must copy them (``load_weights`` normally does).
    """

    name: ClassVar[str] = "broadcast"

    @dataclass(kw_only=True, slots=True)
    class Config:
        """Settings of :class:`BroadcastTransport`."""

        rank: NonNegInt
        """0 for the sender (trainer source rank), 1..world_size-1 for receivers."""
        world_size: Annotated[int, Range(ge=2)]
        """Sender plus receivers (>= 2)."""
        host: str = "127.0.0.1"
        """Address of the sender's TCP store."""
        port: Port = 29600
        """Port of the sender's TCP store."""
        group_name: str = "rl_weightsync"
        """Key prefix in the store (several transports can share one store)."""
        device: str = "cpu"
        """Device of the broadcast buffers; ``cuda`` selects NCCL, ``cpu`` gloo."""
        bucket_bytes: PositiveInt = 256 << 20
        """Bytes per broadcast bucket (a larger tensor travels alone)."""
        serve_dtype: str | None = None
        """Cast floating tensors to this dtype (``"bfloat16"``) before sending; ``None`` keeps
        them (sender side only)."""
        timeout_s: PositiveFloat = 300.0
        """Connection, handshake and collective timeout in seconds (forming the group waits
        this long for every rank, a receiver this long for the sender's go)."""

    def __init__(self, config: Config) -> None:
        """Build from ``config``; the group connects on first use (or :meth:`connect`)."""
        c = config
        if c.world_size < 2 or not 0 <= c.rank < c.world_size:
            raise WeightSyncError(
                f"BroadcastTransport.Config: need world_size >= 2 and 0 <= rank < world_size, got "
                f"rank={c.rank}, world_size={c.world_size}"
            )
        if c.bucket_bytes < 1:
            raise WeightSyncError(
                f"BroadcastTransport.Config.bucket_bytes: expected >= 1, got {c.bucket_bytes}"
            )
        if c.serve_dtype is not None:
            try:
                dtype_from_name(c.serve_dtype)
            except WeightSyncError as exc:
                raise WeightSyncError(f"BroadcastTransport.Config.serve_dtype: {exc}") from None
        self.config = c
        self._store: dist.Store | None = None
        self._pg: dist.ProcessGroup | None = None
        self._connect_lock = threading.Lock()
        self._pg_lock = threading.Lock()
        # sender state
        self._last_published: int | None = None
        self._pending: dict[int, tuple[dict, list[torch.Tensor], tuple]] = {}
        self._cv = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._staging: dict[tuple, list[torch.Tensor]] = {}
        self._last: tuple[int, dict, list[torch.Tensor], tuple] | None = None
        self._pinned: set[int] = set()
        self._closed = False
        # receiver state
        self._recv_buffers: dict[int, torch.Tensor] = {}

    # -- channel --------------------------------------------------------------------------------

    def connect(self) -> None:
        """Open the store and build the process group (blocks until every rank joins)."""
        self._connect_store()
        with self._pg_lock:  # not the store's lock: a publish must not wait for the group
            if self._pg is not None:
                return
            c = self.config
            assert self._store is not None
            try:
                pg_store = dist.PrefixStore("pg", self._store)
                if torch.device(c.device).type == "cuda":
                    pg = dist.ProcessGroupNCCL(pg_store, c.rank, c.world_size)
                else:
                    timeout = timedelta(seconds=c.timeout_s)
                    pg = dist.ProcessGroupGloo(pg_store, c.rank, c.world_size, timeout)
            except Exception as exc:
                raise WeightSyncError(
                    f"broadcast transport rank {c.rank}: cannot form the weight-sync group at "
                    f"{c.host}:{c.port} with {c.world_size} ranks ({exc}); check that every rank "
                    "uses the same host, port and world_size"
                ) from exc
            self._pg = pg

    def _connect_store(self) -> None:
        with self._connect_lock:
            if self._store is not None:
                return
            c = self.config
            try:
                store = dist.TCPStore(
                    c.host,
                    c.port,
                    c.world_size,
                    c.rank == 0,
                    timeout=timedelta(seconds=c.timeout_s),
                    wait_for_workers=False,
                )
            except Exception as exc:
                raise WeightSyncError(
                    f"broadcast transport rank {c.rank}: cannot open the TCP store at "
                    f"{c.host}:{c.port} ({exc}); check host and port, and that rank 0 is up "
                    "(its port must be free)"
                ) from exc
            self._store = dist.PrefixStore(c.group_name, store)

    def _broadcast(self, buf: torch.Tensor) -> None:
        assert self._pg is not None
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._pg.broadcast([buf], opts).wait()

    # -- sender ---------------------------------------------------------------------------------

    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Stage ``version`` in bucket buffers and hand it to the broadcast thread.

        ``metadata`` goes into the returned update; an adapter marker
        (:func:`rl_core.lora.with_adapter`) is also posted in the header receivers check."""
        c = self.config
        if c.rank != 0:
            raise WeightSyncError(
                f"publish of weight version {version}: only rank 0 publishes (this is rank {c.rank})"
            )
        self._raise_background_error(version)
        if self._last_published is not None and version <= self._last_published:
            raise WeightSyncError(
                f"publish of weight version {version} refused: version {self._last_published} was "
                f"already published and versions must increase. Publish a version above {self._last_published}"
            )
        cast = dtype_from_name(c.serve_dtype) if c.serve_dtype is not None else None
        items = [
            (n, t.detach().to(cast) if cast is not None and t.is_floating_point() else t.detach())
            for n, t in named_tensors
        ]
        names = [n for n, _ in items]
        if len(set(names)) != len(names):
            raise WeightSyncError(
                f"publish of weight version {version}: a tensor name appears twice"
            )
        extra = publish_extra(names, metadata, version=version)
        layout, buckets = [], []
        for bucket in iter_buckets(items, c.bucket_bytes):
            offset, rows = 0, []
            for name, t in bucket:
                rows.append([name, dtype_name(t.dtype), list(t.shape), offset])
                offset = _align(offset + tensor_nbytes(t))
            layout.append({"bytes": offset, "tensors": rows})
            buckets.append(bucket)
        key = tuple(
            (b["bytes"], tuple((r[0], r[1], tuple(r[2])) for r in b["tensors"])) for b in layout
        )
        with self._cv:
            # Reuse the staging buffers of the same layout unless a pending version still holds them.
            bufs = self._staging.pop(key, None)
        if bufs is None:
            bufs = [torch.empty(b["bytes"], dtype=torch.uint8, device=c.device) for b in layout]
        for buf, b, bucket in zip(bufs, layout, buckets):
            for (_name, t), row in zip(bucket, b["tensors"]):
                n = tensor_nbytes(t)
                if n:
                    buf[row[3] : row[3] + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
        header = {"version": version, "buckets": layout, **extra}
        self._post(version, header, bufs, key, pinned=False)
        return self._update(version, header, metadata)

    def _post(
        self, version: int, header: dict, bufs: list[torch.Tensor], key: tuple, *, pinned: bool
    ) -> None:
        """Post ``version``'s header and hand its buffers to the broadcast thread."""
        self._connect_store()
        assert self._store is not None
        self._store.set(f"header/{version}", json.dumps(header))
        # TCPStore's set does not wait for the server; a check on the same connection does, so
        # the header is stored before the update is returned (a receiver on another connection
        # could otherwise look for it first and call the version never published).
        self._store.check([f"header/{version}"])
        with self._cv:
            for old in [v for v in self._pending if v < version and v not in self._pinned]:
                _, obufs, okey = self._pending.pop(old)
                self._store.set(f"go/{old}", f"superseded by version {version}")
                self._staging.setdefault(okey, obufs)
            self._pending[version] = (header, bufs, key)
            if pinned:
                self._pinned.add(version)
            self._last = (version, header, bufs, key)
            self._last_published = version
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="rl-weightsync-broadcast", daemon=True
                )
                self._thread.start()
            self._cv.notify_all()

    def _update(
        self, version: int, header: dict, metadata: Mapping[str, Any] | None = None
    ) -> WeightUpdate:
        c = self.config
        layout = header["buckets"]
        return WeightUpdate(
            version=version,
            base_version=None,
            transport=self.name,
            location=f"tcp://{c.host}:{c.port}/{c.group_name}",
            metadata={
                **(metadata or {}),
                "payload": header["payload"],
                "num_tensors": sum(len(b["tensors"]) for b in layout),
                "bytes": sum(b["bytes"] for b in layout),
                "buckets": len(layout),
            },
        )

    def take_over(self, previous: BroadcastTransport) -> WeightUpdate | None:
        """Replace ``previous`` (the sender of an earlier group): close it and post its newest
        published version again on this group, pinned so a later :meth:`publish` cannot
        supersede it. Returns that version's update for every member of this group to receive
        (members already on it receive and discard it), or ``None`` when ``previous`` never
        published."""
        if self.config.rank != 0 or previous.config.rank != 0:
            raise WeightSyncError(
                "BroadcastTransport.take_over: both transports must be senders (rank 0)"
            )
        if self._last_published is not None:
            raise WeightSyncError(
                "BroadcastTransport.take_over: this sender already published; take over a "
                "previous sender before the first publish"
            )
        previous.close()
        last = previous._last
        if last is None:
            return None
        version, header, bufs, key = last
        if bufs and bufs[0].device != torch.device(self.config.device):
            bufs = [b.to(self.config.device) for b in bufs]
        self._post(version, header, bufs, key, pinned=True)
        marker = {ADAPTER_KEY: header[ADAPTER_KEY]} if ADAPTER_KEY in header else None
        return self._update(version, header, marker)

    def _raise_background_error(self, version: int) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise WeightSyncError(
                f"publish of weight version {version}: the broadcast thread failed earlier ({err})"
            ) from err

    def _run(self) -> None:
        try:
            self._connect_store()
            c = self.config
            # Own client connection: a blocking store call on the caller's thread must not stall
            # the handshake.
            client = dist.TCPStore(
                c.host, c.port, c.world_size, False, timeout=timedelta(seconds=c.timeout_s)
            )
            store = dist.PrefixStore(c.group_name, client)
        except Exception as exc:
            self._error = exc
            return
        receivers = range(1, self.config.world_size)
        while True:
            with self._cv:
                while not self._pending and not self._stop:
                    self._cv.wait(0.1)
                if self._stop:
                    return
                # A pinned (re-sync) version goes first; else the newest supersedes the rest.
                pinned = self._pinned & self._pending.keys()
                version = min(pinned) if pinned else max(self._pending)
                _header, bufs, key = self._pending[version]
            # Handshake: wait until every receiver acknowledged or a newer version arrives.
            ack_keys = [f"ack/{version}/{r}" for r in receivers]
            superseded = False
            while not store.check(ack_keys):
                with self._cv:
                    if self._stop:
                        return
                    if version not in self._pending:
                        superseded = True
                        break
                time.sleep(0.002)
            answers = [store.get(k).decode() for k in ack_keys] if not superseded else []
            refused = [a for a in answers if a != "ok"]
            with self._cv:  # publish() may supersede this version up to here, not after
                if superseded or self._pending.pop(version, None) is None:
                    continue
                self._pinned.discard(version)
                go = f"refused by a receiver: {refused[0]}" if refused else "go"
                store.set(f"go/{version}", go)
            if not refused:
                try:
                    self.connect()  # first version: every member acknowledged, so all join now
                    for buf in bufs:
                        if buf.numel():
                            self._broadcast(buf)
                except Exception as exc:  # surfaced on the next publish
                    self._error = exc
            with self._cv:
                self._staging[key] = bufs

    # -- receiver -------------------------------------------------------------------------------

    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Join the broadcast of ``update`` after the version handshake; all buckets are received
        before the first tensor is yielded."""
        return iter(self._receive(update, current_version))

    def _receive(
        self, update: WeightUpdate, current_version: int
    ) -> list[tuple[str, torch.Tensor]]:
        c = self.config
        version = update.version
        if update.transport != self.name:
            raise WeightSyncError(
                f"weight version {version}: update made by transport {update.transport!r}, not "
                f"{self.name!r}; pass it to the transport that published it"
            )
        if c.rank == 0:
            raise WeightSyncError(
                f"weight version {version}: rank 0 is the sender and cannot receive"
            )
        if version <= current_version:
            raise WeightSyncError(
                f"weight version {version} refused: the receiver is already on version "
                f"{current_version} (replayed or out-of-order update). Apply only newer updates"
            )
        self._connect_store()
        store = self._store
        assert store is not None
        if not store.check([f"header/{version}"]):
            raise WeightSyncError(
                f"weight version {version} was never published on {update.location or 'this channel'}; "
                "apply the update the sender returned for its latest publish"
            )
        if store.check([f"go/{version}"]):
            raise WeightSyncError(
                f"weight version {version}: {store.get(f'go/{version}').decode()}; apply the newest update"
            )
        header = json.loads(store.get(f"header/{version}"))
        try:
            names = [row[0] for b in header["buckets"] for row in b["tensors"]]
            check_update_kind(update, names, header)
        except MixedUpdateError as exc:
            store.set(f"ack/{version}/{c.rank}", f"refused: {exc}")
            raise
        store.set(f"ack/{version}/{c.rank}", "ok")
        deadline = time.monotonic() + c.timeout_s
        while not store.check([f"go/{version}"]):
            if self._closed:
                raise WeightSyncError(
                    f"weight version {version}: this receiver was closed while it waited for the "
                    "sender (its group was re-formed); apply the update of the new group"
                )
            if time.monotonic() > deadline:
                raise WeightSyncError(
                    f"weight version {version}: the sender did not start the broadcast within "
                    f"{c.timeout_s} s (a member of the group never acknowledged it); check that "
                    "the trainer and every receiver are alive"
                )
            time.sleep(0.002)
        go = store.get(f"go/{version}").decode()
        if go != "go":
            raise WeightSyncError(f"weight version {version}: {go}; apply the newest update")
        # The group forms on the first go: every member has acknowledged, so none is missing.
        self.connect()
        out: list[tuple[str, torch.Tensor]] = []
        for i, b in enumerate(header["buckets"]):
            buf = self._recv_buffers.get(i)
            if buf is None or buf.numel() < b["bytes"]:
                buf = torch.empty(b["bytes"], dtype=torch.uint8, device=c.device)
                self._recv_buffers[i] = buf
            view = buf[: b["bytes"]]
            try:
                if b["bytes"]:
                    self._broadcast(view)
            except Exception as exc:
                raise WeightSyncError(
                    f"tensor {b['tensors'][0][0]!r} of weight version {version}: broadcast of bucket "
                    f"{i} failed ({exc}); the receiver keeps its previous weights"
                ) from exc
            for name, dt, shape, offset in b["tensors"]:
                dtype = dtype_from_name(dt)
                n = 1
                for d in shape:
                    n *= d
                nbytes = n * dtype.itemsize
                out.append((name, view[offset : offset + nbytes].view(dtype).reshape(shape)))
        return out

    def close(self) -> None:
        """Stop the broadcast thread (after its current collective) and drop the group."""
        self._closed = True
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._pg = None
        self._store = None
