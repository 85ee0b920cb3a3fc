"""Weight updates and memory release of :class:`~rl_sglang.generator.SGLangGenerator`: the
servers' weight version, loading new weights (a checkpoint directory, tensors, a collective
broadcast) on every server in rotation, re-syncing a server that comes back
(:class:`WeightUpdater`).

Tensors reach servers on this host as one safetensors file in a private staging directory
(``/dev/shm`` when writable) that each server loads with ``/update_weights_from_disk``: SmolLM2-135M
(538 MB fp32) takes about a second, against 24-32 s for the same tensors inlined in the HTTP body
(pickled, base64 in JSON, parsed and copied again by the server; ``benchmarks/sglang_push.py``).
Nothing is pickled on that path. Servers elsewhere get the inline payload
(:data:`TENSOR_PUSH_MODES`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ipaddress
import logging
import os
import pickle
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import torch

from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.moe_weights import has_fused_experts, is_fused_expert_name, unfuse_expert_tensors
from rl_core.types import WeightUpdate
from rl_sglang._fleet import ServerFleet
from rl_sglang._http import Server, ServerClient
from rl_sglang._io import IOLoop

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What SGLang 0.5.23 can release: model weights, the KV cache, captured CUDA graphs."""

TENSOR_PUSH_MODES = ("auto", "file", "inline")
"""How :meth:`WeightUpdater.load_tensors` sends tensors: ``file`` writes them as one safetensors
file the servers load from disk (they must see this host's filesystem), ``inline`` pickles them
into the HTTP body of ``/update_weights_from_tensor`` (works across hosts; ~25x slower on
SmolLM2), ``auto`` is ``file`` when every server's URL is a loopback address, else ``inline``."""


class WeightUpdater:
    """The weight version the servers serve and every change to it.

    One lock (:meth:`lock`) serialises updates with the re-sync of a server coming back; while an
    update runs, :attr:`updating` is true (responses may mix versions; no health probes).
    """

    def __init__(
        self,
        *,
        io: IOLoop,
        client: ServerClient,
        fleet: ServerFleet,
        version: int,
        base_model: str,
        tensor_push: str = "auto",
    ) -> None:
        """Start at ``version``; ``base_model``: the checkpoint the servers were launched with
        (reloaded after a memory release when no update happened yet); ``tensor_push``: one of
        :data:`TENSOR_PUSH_MODES`."""
        if tensor_push not in TENSOR_PUSH_MODES:
            raise ConfigError(
                f"SGLangGenerator.Config.tensor_push: {tensor_push!r} is not one of "
                f"{TENSOR_PUSH_MODES}."
            )
        self._tensor_push = tensor_push
        self._staging: str | None = None  # private directory of pushed safetensors files
        self._staged: str | None = None  # the directory the servers serve now (resync source)
        self._staging_cleanup: weakref.finalize | None = None
        self._io = io
        self._client = client
        self._fleet = fleet
        self._version = version
        self._updating = False
        self._source: tuple[str, Any] | None = None  # how to re-sync a restarted server
        self._base_model = base_model
        self._lock: asyncio.Lock | None = None

    @property
    def version(self) -> int:
        """Version of the weights the servers serve."""
        return self._version

    @property
    def updating(self) -> bool:
        """True while an update runs."""
        return self._updating

    def lock(self) -> asyncio.Lock:
        """The lock of weight changes (created on the IO loop at first use)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    @contextlib.contextmanager
    def in_update(self) -> Iterator[None]:
        """Mark an update as running for the body (hold :meth:`lock` around it)."""
        self._updating = True
        try:
            yield
        finally:
            self._updating = False

    def adopt(self, version: int) -> None:
        """Record that the servers now serve ``version`` without new base weights (an adapter
        update): a restarted server still re-syncs from the last base update."""
        self._version = version

    # ------------------------------------------------------------------ full updates

    def load_from_disk(self, path: str, version: int) -> None:
        """Point every server at the Hugging Face checkpoint ``path`` and set ``version``
        (blocks; not from the IO loop).

        Raises:
            WeightSyncError: the checkpoint holds transformers' fused MoE expert tensors, which
                SGLang's loaders skip with a warning (the experts would stay stale).
        """
        fused = _fused_expert_names(Path(path))
        if fused:
            raise WeightSyncError(
                f"SGLangGenerator.load_weights_from_disk: {path} holds fused MoE expert tensors "
                f"({fused[0]}, ...), which SGLang does not load (it expects one tensor per "
                "expert): the served experts would stay at their old weights. Use an in-memory "
                "weight transport (weight_transport.type: inprocess), which splits them, or "
                "write the checkpoint with per-expert names."
            )
        self._io.call(self._update_all("disk", str(path), int(version)))
        self._drop_staged()

    def load_tensors(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push Hugging Face-named tensors to every server and set ``version`` (blocks; fused
        MoE expert tensors are sent as one tensor per expert, the names SGLang loads).

        Servers that share this host's filesystem (:data:`TENSOR_PUSH_MODES`) load one
        safetensors file written for this version; it stays staged (replacing the previous
        version's) so a restarted server re-syncs from it.
        """
        if self.pushes_by_file():
            self._load_by_file(unfuse_expert_tensors(named_tensors), int(version))
            return
        tensors = [
            (n, t.detach().to("cpu").contiguous().clone())
            for n, t in unfuse_expert_tensors(named_tensors)
        ]
        self._io.call(self._update_all("tensors", tensors, int(version)))

    def pushes_by_file(self) -> bool:
        """Whether :meth:`load_tensors` writes a safetensors file the servers load (``file``, or
        ``auto`` with every server on a loopback address) rather than an inline payload."""
        if self._tensor_push != "auto":
            return self._tensor_push == "file"
        return bool(self._fleet.servers) and all(_is_loopback(s.url) for s in self._fleet.servers)

    def _load_by_file(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        from safetensors.torch import save_file

        directory = tempfile.mkdtemp(prefix=f"v{version}-", dir=self._staging_dir())
        try:
            tensors: dict[str, torch.Tensor] = {}
            spans: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges written
            for name, t in named_tensors:
                if name in tensors:
                    raise WeightSyncError(
                        f"SGLangGenerator.load_weights: tensor {name!r} appears twice; "
                        "named_tensors must yield each name once."
                    )
                t = t.detach().to("cpu").contiguous()
                ptr = t.untyped_storage().data_ptr()
                lo = t.storage_offset() * t.element_size()
                hi = lo + t.numel() * t.element_size()
                if any(a < hi and lo < b for a, b in spans.get(ptr, ())):
                    t = t.clone()  # tied or overlapping views: safetensors refuses shared memory
                else:
                    spans.setdefault(ptr, []).append((lo, hi))
                tensors[name] = t
            save_file(tensors, os.path.join(directory, "model.safetensors"))
            del tensors
            try:
                self._io.call(self._update_all("disk", directory, version))
            except WeightSyncError as e:
                raise WeightSyncError(
                    f"{e} (tensor_push 'file': the servers load {directory}/model.safetensors "
                    "from this host's filesystem; for servers that cannot see it, set "
                    "SGLangGenerator.Config.tensor_push: inline)"
                ) from e
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self._drop_staged()  # the previous version's file
        self._staged = directory

    def _staging_dir(self) -> str:
        """The private staging directory (created at first use in ``/dev/shm`` when it is a
        writable directory, else the system temp directory; removed by :meth:`close`). Staging
        directories of processes that no longer run (killed before they could clean up) are
        removed first."""
        if self._staging is None:
            shm = "/dev/shm"
            root = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
            _remove_orphans(root or tempfile.gettempdir())
            self._staging = tempfile.mkdtemp(prefix=f"{_STAGING_PREFIX}{os.getpid()}-", dir=root)
            self._staging_cleanup = weakref.finalize(
                self, shutil.rmtree, self._staging, ignore_errors=True
            )
        return self._staging

    def _drop_staged(self) -> None:
        """Remove the staged file once the servers serve weights from another source."""
        old, self._staged = self._staged, None
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def close(self) -> None:
        """Remove the staging directory and its files (idempotent)."""
        if self._staging_cleanup is not None:
            self._staging_cleanup()
        self._staging = self._staged = None
        self._staging_cleanup = None

    async def _update_all(self, kind: str, payload: Any, version: int) -> None:
        async with self.lock():
            with self.in_update():
                up = self._fleet.up()
                one = self._disk_one if kind == "disk" else self._tensors_one
                results = await asyncio.gather(
                    *(one(s, payload, version) for s in up), return_exceptions=True
                )
                errors = []
                for s, r in zip(up, results):
                    if isinstance(r, aiohttp.ClientError | asyncio.TimeoutError | OSError):
                        self._fleet.mark_down(s, f"weight update failed: {r!r}")  # resyncs later
                    elif isinstance(r, BaseException):
                        errors.append((s, r))
                if errors:
                    if len(errors) < len(up):
                        for s, _ in errors:
                            self._fleet.mark_down(s, "weight update failed")
                    raise WeightSyncError(
                        f"SGLangGenerator: weight version {version} ({kind}) failed on "
                        f"{[s.url for s, _ in errors]}: {errors[0][1]}; the generator stays on "
                        f"version {self._version}."
                    ) from errors[0][1]
                self._version = version
                self._source = (kind, payload)

    async def _disk_one(self, s: Server, path: str, version: int) -> None:
        await self._client.control(
            s,
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": True,
                "abort_all_requests": False,
                "keep_pause": self._fleet.paused is not None,
            },
        )

    async def _tensors_one(
        self, s: Server, tensors: list[tuple[str, torch.Tensor]], version: int
    ) -> None:
        # Plain pickle, base64: SGLang's SafeUnpickler rebuilds the inlined storages. (The
        # default ForkingPickler payload shares CPU storages by fd and crashes a CPU server.)
        blob = await asyncio.to_thread(
            lambda: base64.b64encode(pickle.dumps(tensors, protocol=4)).decode()
        )
        await self._client.control(s, "/begin_weight_update", {})
        try:
            await self._client.control(
                s,
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [blob] * s.tp_size,
                    "weight_version": str(version),
                    "flush_cache": True,
                },
            )
        finally:
            await self._client.control(s, "/end_weight_update", {})

    async def distributed_update(self, update: WeightUpdate, transport: Any) -> None:
        """Broadcast ``update`` into the servers through the collective ``transport``
        (:class:`~rl_sglang.collective.SGLangCollectiveTransport`; on the IO loop)."""
        async with self.lock():
            if update.version <= self._version:
                raise WeightSyncError(
                    f"SGLangGenerator: weight version {update.version} refused: already on "
                    f"{self._version} (replayed or out-of-order update)."
                )
            up = self._fleet.up()
            if not up:
                raise WeightSyncError("SGLangGenerator: no server in rotation to update.")
            with self.in_update():
                await transport.push(update, up, self._client)
                self._version = update.version
                self._source = ("tensors", transport.staged(update.version))
        self._drop_staged()

    async def resync(self, s: Server) -> None:
        """Bring ``s`` to the current weights and version from the last update's source (hold
        :meth:`lock`)."""
        kind, payload = self._source or ("base", None)
        if kind == "disk":
            await self._disk_one(s, payload, self._version)
        elif kind == "tensors":
            await self._tensors_one(s, payload, self._version)
        else:
            await self._client.set_version(s, self._version)

    # ------------------------------------------------------------------ memory (GPU only)

    async def memory(self, path: str, tags: list[str] | None) -> None:
        """POST the memory call ``path`` (release or resume) with ``tags`` to every server in
        rotation."""

        async def go() -> None:
            body = {"tags": tags}
            await asyncio.gather(
                *(self._client.control(s, path, body) for s in self._fleet.servers if s.up)
            )

        await self._io.run(go())

    async def reload(self) -> None:
        """Reload the current weights and version on every server in rotation (after their
        weight memory came back): the last update's source, or the launch checkpoint."""

        async def go() -> None:
            async with self.lock():
                await asyncio.gather(*(self._reload_one(s) for s in self._fleet.up()))

        await self._io.run(go())

    async def _reload_one(self, s: Server) -> None:
        if self._source is not None:
            await self.resync(s)
            return
        await self._disk_one(s, self._base_model, self._version)


def memory_tags(tags: Sequence[str] | None) -> list[str] | None:
    """``tags`` checked against :data:`MEMORY_TAGS`, deduplicated (``None``: all)."""
    if tags is None:
        return None
    out = list(dict.fromkeys(str(t) for t in tags))
    bad = [t for t in out if t not in MEMORY_TAGS]
    if bad or not out:
        raise GenerationError(
            f"SGLangGenerator.release_memory/resume_memory: tags {list(tags)!r}; give a non-empty "
            f"subset of {MEMORY_TAGS} or None for all."
        )
    return out


_STAGING_PREFIX = "rl-sglang-push-"
"""Staging directories are ``<root>/rl-sglang-push-<pid>-<random>``."""


def _remove_orphans(root: str) -> None:
    """Remove the staging directories under ``root`` whose process no longer runs."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        if not name.startswith(_STAGING_PREFIX):
            continue
        pid = name[len(_STAGING_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # alive under another user (PermissionError): not ours to remove
            continue


def _is_loopback(url: str) -> bool:
    """Whether ``url``'s host is this machine (``localhost`` or a loopback address)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _fused_expert_names(directory: Path) -> list[str]:
    """Names of fused MoE expert tensors in the ``*.safetensors`` files of ``directory``
    (headers only; ``[]`` when there are none or the files cannot be read: the server
    reports those)."""
    from safetensors import safe_open

    names: list[str] = []
    for f in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as h:
                keys = list(h.keys())
        except (OSError, ValueError, RuntimeError):
            continue
        if has_fused_experts(keys):
            names += [k for k in keys if is_fused_expert_name(k)]
    return names
