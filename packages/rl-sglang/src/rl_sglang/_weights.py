"""Weight updates and memory release of :class:`~rl_sglang.generator.SGLangGenerator`."""

from __future__ import annotations

import asyncio
import base64
import logging
import pickle
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import torch

from rl_core.errors import GenerationError, WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.lora import adapter_of
from rl_core.moe_weights import has_fused_experts, is_fused_expert_name, unfuse_expert_tensors
from rl_core.types import WeightUpdate
from rl_sglang._state import _GeneratorState, _Server

log = logging.getLogger("rl_sglang.generator")  # the generator's logger, as before the split


class _WeightsMixin(_GeneratorState):
    """Load new weights on every server (disk, tensors or a collective), stamp versions, re-sync."""

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load ``update`` through ``transport`` on every server; on failure keep the old ones.

        An adapter-only update (:func:`rl_core.lora.adapter_of`) is loaded as a LoRA adapter
        (:mod:`rl_sglang._lora`; the servers must run with ``enable_lora``, else
        :class:`~rl_core.errors.ConfigError`). A collective transport (:class:`~rl_sglang.collective.SGLangCollectiveTransport`)
        broadcasts into the servers; disk transports hand the verified checkpoint directory to
        ``/update_weights_from_disk``; any other transport's tensors are pushed with
        ``/update_weights_from_tensor``.
        """
        from rl_sglang.collective import SGLangCollectiveTransport

        if self._closed:
            raise GenerationError("SGLangGenerator.update_weights: the generator is closed.")
        if adapter_of(update) is not None:
            if isinstance(transport, SGLangCollectiveTransport):
                raise WeightSyncError(
                    "SGLangGenerator.update_weights: adapter-only updates do not go through "
                    "sglang_collective (it writes model weights into the servers); send them "
                    "with disk_full, disk_delta, broadcast or inprocess."
                )
            await self._update_adapter(update, transport)  # type: ignore[attr-defined]
            return
        if isinstance(transport, SGLangCollectiveTransport):
            await self._io.run(self._distributed_update(update, transport))
            return
        await asyncio.to_thread(transport.apply, update, self)

    def load_weights_from_disk(self, path: str, *, version: int) -> None:
        """Point every server at the Hugging Face checkpoint ``path`` and set ``version``.

        Called by disk transports after they verified the checkpoint (``DiskWeightTarget``).

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

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Push Hugging Face-named tensors to every server and set ``version``. transformers'
        fused MoE expert tensors are sent as one tensor per expert, the names SGLang loads
        (:mod:`rl_core.moe_weights`; SGLang skips fused names with a warning)."""
        tensors = [
            (n, t.detach().to("cpu").contiguous().clone())
            for n, t in unfuse_expert_tensors(named_tensors)
        ]
        self._io.call(self._update_all("tensors", tensors, int(version)))

    async def _update_all(self, kind: str, payload: Any, version: int) -> None:
        async with self._weights_lock():
            self._updating = True
            try:
                up = [s for s in self._servers if s.up]
                one = self._disk_one if kind == "disk" else self._tensors_one
                results = await asyncio.gather(
                    *(one(s, payload, version) for s in up), return_exceptions=True
                )
                errors = []
                for s, r in zip(up, results):
                    if isinstance(r, aiohttp.ClientError | asyncio.TimeoutError | OSError):
                        self._mark_down(s, f"weight update failed: {r!r}")  # resyncs later
                    elif isinstance(r, BaseException):
                        errors.append((s, r))
                if errors:
                    if len(errors) < len(up):
                        for s, _ in errors:
                            self._mark_down(s, "weight update failed")
                    raise WeightSyncError(
                        f"SGLangGenerator: weight version {version} ({kind}) failed on "
                        f"{[s.url for s, _ in errors]}: {errors[0][1]}; the generator stays on "
                        f"version {self._version}."
                    ) from errors[0][1]
                self._version = version
                self._source = (kind, payload)
            finally:
                self._updating = False

    async def _disk_one(self, s: _Server, path: str, version: int) -> None:
        await self._control(
            s,
            "/update_weights_from_disk",
            {
                "model_path": path,
                "weight_version": str(version),
                "flush_cache": True,
                "abort_all_requests": False,
                "keep_pause": self._paused is not None,
            },
        )

    async def _tensors_one(
        self, s: _Server, tensors: list[tuple[str, torch.Tensor]], version: int
    ) -> None:
        # Plain pickle, base64: SGLang's SafeUnpickler rebuilds the inlined storages. (The
        # default ForkingPickler payload shares CPU storages by fd and crashes a CPU server.)
        blob = await asyncio.to_thread(
            lambda: base64.b64encode(pickle.dumps(tensors, protocol=4)).decode()
        )
        await self._control(s, "/begin_weight_update", {})
        try:
            await self._control(
                s,
                "/update_weights_from_tensor",
                {
                    "serialized_named_tensors": [blob] * s.tp_size,
                    "weight_version": str(version),
                    "flush_cache": True,
                },
            )
        finally:
            await self._control(s, "/end_weight_update", {})

    async def _distributed_update(self, update: WeightUpdate, transport: Any) -> None:
        async with self._weights_lock():
            if update.version <= self._version:
                raise WeightSyncError(
                    f"SGLangGenerator: weight version {update.version} refused: already on "
                    f"{self._version} (replayed or out-of-order update)."
                )
            up = [s for s in self._servers if s.up]
            if not up:
                raise WeightSyncError("SGLangGenerator: no server in rotation to update.")
            self._updating = True
            try:
                await transport.push(update, up, self)
                self._version = update.version
                self._source = ("tensors", transport.staged(update.version))
            finally:
                self._updating = False

    # ------------------------------------------------------------------ memory (GPU only)

    async def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Free GPU memory on every server for a colocated trainer: ``tags`` among
        :data:`MEMORY_TAGS` (``None``: all of them). New requests wait until
        :meth:`resume_memory`.

        Needs servers on CUDA launched with ``enable_memory_saver`` (``supports_memory_release``);
        refused otherwise (on CPU SGLang's handler calls ``torch.cuda.synchronize`` and the
        server dies)."""
        await self._memory("/release_memory_occupation", _memory_tags(tags))

    async def resume_memory(
        self, tags: Sequence[str] | None = None, *, reload_weights: bool = True
    ) -> None:
        """Undo :meth:`release_memory` for ``tags`` (``None``: all). When ``weights`` come back
        and ``reload_weights`` is true, every server reloads the current weights and version
        (the last update's source, or the checkpoint it was launched with): released weight
        memory comes back uninitialised. Pass ``reload_weights=False`` when an update follows
        at once (the colocated loop pushes new weights right after)."""
        want = _memory_tags(tags)
        await self._memory("/resume_memory_occupation", want)
        if reload_weights and (want is None or "weights" in want):

            async def reload() -> None:
                async with self._weights_lock():
                    up = [s for s in self._servers if s.up]
                    await asyncio.gather(*(self._reload_one(s) for s in up))

            await self._io.run(reload())

    async def _reload_one(self, s: _Server) -> None:
        if self._source is not None:
            await self._resync(s)
            return
        path = self.config.model_path or str(getattr(self, "_server_info", {}).get("model_path"))
        await self._disk_one(s, path, self._version)

    async def _memory(self, path: str, tags: list[str] | None) -> None:
        if not self.supports_memory_release:
            raise GenerationError(
                f"SGLangGenerator{path}: the servers cannot release memory (they need "
                "device='cuda' and SGLangGenerator.Config.enable_memory_saver=true; on CPU the "
                "call kills the server). Check generator.supports_memory_release first."
            )

        async def go() -> None:
            body = {"tags": tags}
            await asyncio.gather(*(self._control(s, path, body) for s in self._servers if s.up))

        await self._io.run(go())


MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
"""What SGLang 0.5.23 can release: model weights, the KV cache, captured CUDA graphs."""


def _memory_tags(tags: Sequence[str] | None) -> list[str] | None:
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
