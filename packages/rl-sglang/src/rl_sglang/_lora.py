"""LoRA adapters of :class:`~rl_sglang.generator.SGLangGenerator` (SGLang's multi-LoRA serving).

Verified on the CPU engine (SGLang 0.5.23, ``--lora-backend torch_native``, the pinning patch of
``cpu_site/sitecustomize.py``): a peft-format adapter (``adapter_config.json`` +
``adapter_model.safetensors``) loaded with ``/load_lora_adapter`` gives teacher-forced
log-probs equal to transformers with the adapter merged (5 decimals), several adapters serve side
by side, ``/unload_lora_adapter`` drops one. Requests pick their adapter by name (``lora_path``
in ``/generate``); a request without one runs the base model::

    await gen.load_lora_adapter("task-a", "runs/adapters/step-10")
    results = await gen.generate(requests, lora_adapter="task-a")       # or one name per request
    gen.default_lora_adapter = "task-a"                                 # for callers that pass none
    await gen.load_lora_adapter("task-a", "runs/adapters/step-20")      # replace: new weights
    await gen.unload_lora_adapter("task-a")

Adapter-only weight updates (an update marked by :func:`rl_core.lora.with_adapter`, from any
rl-weightsync transport) go through :meth:`~rl_sglang.SGLangGenerator.update_weights` like full
weights: the verified adapter tensors are written as a peft directory under ``<log_dir>/adapters/``
and loaded under a versioned name (``task-v7``); the adapter's own name (``task``) then resolves to
it, requests that name none use it (when the default was unset or the previous version), the
servers' weight version is stamped, and the previous version is unloaded. SGLang's unload waits for
the requests still running on it, so in-flight requests finish on the old adapter.

Multi-LoRA: a request's own ``adapter`` (:attr:`~rl_core.types.GenerationRequest.adapter`)
picks its adapter by name (resolved to the current version), and a multi-adapter update
(``AdapterInfo.names``) loads each adapter it carries under ``<name>-v<version>``, the default
one first (it becomes the default of requests that name none).
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import torch

from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.lora import AdapterInfo, adapter_of, save_adapter, split_adapters
from rl_core.types import GenerationRequest, WeightUpdate
from rl_sglang._state import _GeneratorState, _Server


class _AdapterSink:
    """The target a transport loads an adapter-only update into: it keeps the tensors (every
    transport hands an adapter over whole) for the generator to write as a peft directory."""

    def __init__(self, version: int) -> None:
        self._version = version
        self.tensors: list[tuple[str, torch.Tensor]] | None = None

    @property
    def weight_version(self) -> int:
        """The generator's version (the base a delta must apply to)."""
        return self._version

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Keep CPU copies of the (verified) adapter tensors."""
        self.tensors = [(n, t.detach().to("cpu").clone()) for n, t in named_tensors]
        self._version = version


class _LoRAMixin(_GeneratorState):
    """Load, replace and unload named adapters on every server; pick one per request."""

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path (as loaded by this generator; adapter updates appear
        under their versioned names, e.g. ``task-v7``)."""
        return dict(self._lora)

    @property
    def lora_versions(self) -> dict[str, str]:
        """Adapters loaded by adapter-only weight updates: adapter name -> the versioned name it
        serves under now (requests may use either)."""
        return dict(self._lora_alias)

    @property
    def default_lora_adapter(self) -> str | None:
        """Adapter of requests that name none (``None``: the base model)."""
        return self._default_lora

    @default_lora_adapter.setter
    def default_lora_adapter(self, name: str | None) -> None:
        if name is not None:
            self._check_adapter(name, "default_lora_adapter")
        self._default_lora = name

    async def load_lora_adapter(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load the peft-format adapter at ``path`` under ``name`` on every server; a name that
        is already loaded is replaced (unloaded, then loaded: the way to publish new adapter
        weights). ``pinned`` keeps it from being evicted when more adapters are loaded than
        ``max_loaded_loras``."""
        self._require_lora("load_lora_adapter")
        if not (Path(path) / "adapter_config.json").is_file():
            raise GenerationError(
                f"SGLangGenerator.load_lora_adapter({name!r}): {path}/adapter_config.json does "
                "not exist; give the directory of a peft-format adapter (adapter_config.json + "
                "adapter_model.safetensors)."
            )

        async def go() -> None:
            up = [s for s in self._servers if s.up]
            if name in self._lora:
                await asyncio.gather(*(self._unload_one(s, name) for s in up))
                self._lora.pop(name)
            await asyncio.gather(*(self._load_one(s, name, path, pinned) for s in up))
            self._lora[name] = path

        await self._io.run(go())

    async def unload_lora_adapter(self, name: str) -> None:
        """Unload adapter ``name`` from every server; requests naming it are refused after."""
        self._check_adapter(name, "unload_lora_adapter")

        async def go() -> None:
            served = self._lora_alias.pop(name, name)
            await asyncio.gather(*(self._unload_one(s, served) for s in self._servers if s.up))
            self._lora.pop(served, None)
            if self._default_lora in (name, served):
                self._default_lora = None

        await self._io.run(go())

    async def _update_adapter(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load the adapter-only ``update`` (see the module doc); on failure the generator keeps
        its previous adapter and version."""
        info = adapter_of(update)
        assert info is not None
        self._check_adapter_serving(update, info)
        if update.version <= self._version:
            raise WeightSyncError(
                f"SGLangGenerator: weight version {update.version} refused: already on "
                f"{self._version} (replayed or out-of-order update)."
            )
        sink = _AdapterSink(self._version)
        await asyncio.to_thread(transport.apply, update, sink)
        if not sink.tensors:
            raise WeightSyncError(
                f"SGLangGenerator: adapter update v{update.version} ({info.name!r}) delivered no "
                f"tensors through transport {update.transport!r}."
            )
        # multi-LoRA: every adapter the update carries, the default one first
        if info.names:
            parts = split_adapters(sink.tensors, info.names)
            order = [info.name, *(n for n in info.names if n != info.name)]
            adapters = [(n, list(parts[n].items())) for n in order]
        else:
            adapters = [(info.name, sink.tensors)]
        base = str(info.config.get("base_model_name_or_path") or "")
        loaded = []
        for name, tensors in adapters:
            served = f"{name}-v{update.version}"
            directory = Path(self.log_dir) / "adapters" / served  # type: ignore[attr-defined]
            lora = dataclasses.replace(info.lora, name=name)
            await asyncio.to_thread(save_adapter, directory, tensors, lora, base_model=base)
            loaded.append((name, served, str(directory)))
        for name, served, directory in loaded:
            await self._io.run(self._swap_adapter(name, served, directory, update.version))

    async def _swap_adapter(self, name: str, served: str, path: str, version: int) -> None:
        async with self._weights_lock():  # type: ignore[attr-defined]
            up = [s for s in self._servers if s.up]
            if not up:
                raise WeightSyncError("SGLangGenerator: no server in rotation to update.")
            old = self._lora_alias.get(name)
            self._updating = True
            try:
                results = await asyncio.gather(
                    *(self._load_one(s, served, path) for s in up), return_exceptions=True
                )
                failed = [(s, r) for s, r in zip(up, results) if isinstance(r, BaseException)]
                if failed:
                    for s, r in failed:
                        if isinstance(r, aiohttp.ClientError | asyncio.TimeoutError | OSError):
                            self._mark_down(s, f"adapter load failed: {r!r}")  # type: ignore[attr-defined]
                    loaded = [s for s in up if all(s is not f for f, _ in failed)]
                    await asyncio.gather(
                        *(self._unload_one(s, served) for s in loaded), return_exceptions=True
                    )
                    raise WeightSyncError(
                        f"SGLangGenerator: adapter {name!r} version {version} failed to load on "
                        f"{[s.url for s, _ in failed]}: {failed[0][1]}; the generator stays on "
                        f"version {self._version}."
                    ) from failed[0][1]
                self._lora[served] = path
                self._lora_alias[name] = served
                if self._default_lora is None or self._default_lora in (old, name):
                    self._default_lora = served
                await asyncio.gather(*(self._set_version(s, version) for s in up))  # type: ignore[attr-defined]
                self._version = version
            finally:
                self._updating = False
            if old is not None and old != served:
                # SGLang waits for the requests still running on ``old`` before it drops it.
                await asyncio.gather(
                    *(self._unload_one(s, old) for s in up), return_exceptions=True
                )
                old_path = self._lora.pop(old, None)
                if old_path is not None:
                    shutil.rmtree(old_path, ignore_errors=True)

    def _check_adapter_serving(self, update: WeightUpdate, info: AdapterInfo) -> None:
        """Refuse an adapter the servers cannot serve, naming the generator options to set."""
        lora = info.lora
        want = (
            f"set SGLangGenerator.Config.enable_lora=true, max_lora_rank>={lora.rank} and "
            f"lora_target_modules={sorted(lora.target_modules)} (generator.enable_lora, "
            "generator.max_lora_rank, generator.lora_target_modules in a recipe)"
        )
        what = (
            f"SGLangGenerator.update_weights: weight version {update.version} is an adapter-only "
            f"update (LoRA {info.name!r}, rank {lora.rank}, targets {sorted(lora.target_modules)})"
        )
        if not self.supports_lora:
            raise ConfigError(f"{what}, but the servers were launched without LoRA; {want}.")
        info_args: dict[str, Any] = getattr(self, "_server_info", {}) or {}
        max_rank = info_args.get("max_lora_rank") or self.config.max_lora_rank
        targets = info_args.get("lora_target_modules") or self.config.lora_target_modules
        if max_rank is not None and lora.rank > int(max_rank):
            raise ConfigError(f"{what}, but the servers take ranks up to {max_rank}; {want}.")
        if targets and "all" not in targets:
            missing = sorted(set(lora.target_modules) - set(targets))
            if missing:
                raise ConfigError(
                    f"{what}, but the servers were launched for {sorted(targets)} (missing "
                    f"{missing}); {want}."
                )

    async def _load_one(self, s: _Server, name: str, path: str, pinned: bool = False) -> None:
        body = {"lora_name": name, "lora_path": str(path), "pinned": pinned}
        await self._control(s, "/load_lora_adapter", body)

    async def _unload_one(self, s: _Server, name: str) -> None:
        await self._control(s, "/unload_lora_adapter", {"lora_name": name})

    async def _reload_adapters(self, s: _Server) -> None:
        """Load every adapter on a restarted server."""
        for name, path in self._lora.items():
            await self._load_one(s, name, path)

    def _require_lora(self, what: str) -> None:
        if not self.supports_lora:
            raise GenerationError(
                f"SGLangGenerator.{what}: the servers were launched without LoRA; set "
                "SGLangGenerator.Config.enable_lora=true with max_lora_rank and "
                "lora_target_modules."
            )

    def _check_adapter(self, name: str, what: str) -> None:
        self._require_lora(what)
        if name not in self._lora and name not in self._lora_alias:
            raise GenerationError(
                f"SGLangGenerator.{what}: no LoRA adapter named {name!r} is loaded (loaded: "
                f"{sorted(self._lora)}); call load_lora_adapter({name!r}, path) first."
            )

    def _adapters_for(
        self, requests: Sequence[GenerationRequest], lora_adapter: str | Sequence[str | None] | None
    ) -> list[str | None]:
        """The adapter name of each request (``None``: the base model): ``lora_adapter``, else
        the request's own ``adapter``, else the default."""
        if lora_adapter is None:
            names: list[str | None] = [r.adapter or self._default_lora for r in requests]
        elif isinstance(lora_adapter, str):
            names = [lora_adapter] * len(requests)
        else:
            names = list(lora_adapter)
            if len(names) != len(requests):
                raise GenerationError(
                    f"SGLangGenerator.generate: lora_adapter has {len(names)} names for "
                    f"{len(requests)} requests; give one per request, or one name for all."
                )
        for name in {n for n in names if n is not None}:
            self._check_adapter(name, "generate")
        return [self._lora_alias.get(n, n) if n is not None else None for n in names]
