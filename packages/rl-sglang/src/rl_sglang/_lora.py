"""LoRA adapters of :class:`~rl_sglang.generator.SGLangGenerator` (SGLang's multi-LoRA serving):
the :class:`LoRARegistry` it owns.

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

import aiohttp
import torch

from rl_core.errors import ConfigError, GenerationError, WeightSyncError
from rl_core.interfaces import WeightTransport
from rl_core.lora import AdapterInfo, adapter_of, save_adapter, split_adapters
from rl_core.types import GenerationRequest, WeightUpdate
from rl_sglang._fleet import ServerFleet
from rl_sglang._http import Server, ServerClient
from rl_sglang._io import IOLoop
from rl_sglang._weights import WeightUpdater


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


class LoRARegistry:
    """The adapters loaded on every server: load, replace and unload them by name, load
    adapter-only weight updates under versioned names, pick the adapter of each request."""

    def __init__(
        self,
        *,
        io: IOLoop,
        client: ServerClient,
        fleet: ServerFleet,
        weights: WeightUpdater,
        adapters_dir: Path,
        enabled: bool,
        max_rank: int | None,
        target_modules: Sequence[str],
    ) -> None:
        """``enabled``: the servers were launched with ``enable_lora``, for adapters up to
        ``max_rank`` on ``target_modules`` (``None`` / empty: not known); adapter updates are
        written under ``adapters_dir``."""
        self._io = io
        self._client = client
        self._fleet = fleet
        self._weights = weights
        self._adapters_dir = adapters_dir
        self.enabled = enabled
        """The servers serve LoRA adapters."""
        self._max_rank = max_rank
        self._target_modules = tuple(target_modules)
        self._lora: dict[str, str] = {}
        self._lora_alias: dict[str, str] = {}  # adapter name -> versioned name (adapter updates)
        self._default_lora: str | None = None

    @property
    def adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path."""
        return dict(self._lora)

    @property
    def versions(self) -> dict[str, str]:
        """Adapters of adapter-only updates: name -> the versioned name it serves under."""
        return dict(self._lora_alias)

    @property
    def default(self) -> str | None:
        """Adapter of requests that name none (``None``: the base model)."""
        return self._default_lora

    @default.setter
    def default(self, name: str | None) -> None:
        if name is not None:
            self._check_adapter(name, "default_lora_adapter")
        self._default_lora = name

    async def load(self, name: str, path: str, *, pinned: bool = False) -> None:
        """Load (or replace) adapter ``name`` from the peft directory ``path`` on every server."""
        self._require_lora("load_lora_adapter")
        if not (Path(path) / "adapter_config.json").is_file():
            raise GenerationError(
                f"SGLangGenerator.load_lora_adapter({name!r}): {path}/adapter_config.json does "
                "not exist; give the directory of a peft-format adapter (adapter_config.json + "
                "adapter_model.safetensors)."
            )

        async def go() -> None:
            up = self._fleet.up()
            if name in self._lora:
                await asyncio.gather(*(self._unload_one(s, name) for s in up))
                self._lora.pop(name)
            await asyncio.gather(*(self._load_one(s, name, path, pinned) for s in up))
            self._lora[name] = path

        await self._io.run(go())

    async def unload(self, name: str) -> None:
        """Unload adapter ``name`` (or the version it serves under) from every server."""
        self._check_adapter(name, "unload_lora_adapter")

        async def go() -> None:
            served = self._lora_alias.pop(name, name)
            await asyncio.gather(*(self._unload_one(s, served) for s in self._fleet.up()))
            self._lora.pop(served, None)
            if self._default_lora in (name, served):
                self._default_lora = None

        await self._io.run(go())

    async def update(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Load the adapter-only ``update`` (see the module doc); on failure the generator keeps
        its previous adapter and version."""
        info = adapter_of(update)
        assert info is not None
        self._check_adapter_serving(update, info)
        if update.version <= self._weights.version:
            raise WeightSyncError(
                f"SGLangGenerator: weight version {update.version} refused: already on "
                f"{self._weights.version} (replayed or out-of-order update)."
            )
        sink = _AdapterSink(self._weights.version)
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
            directory = self._adapters_dir / served
            lora = dataclasses.replace(info.lora, name=name)
            await asyncio.to_thread(save_adapter, directory, tensors, lora, base_model=base)
            loaded.append((name, served, str(directory)))
        for name, served, directory in loaded:
            await self._io.run(self._swap_adapter(name, served, directory, update.version))

    async def _swap_adapter(self, name: str, served: str, path: str, version: int) -> None:
        weights = self._weights
        async with weights.lock():
            up = self._fleet.up()
            if not up:
                raise WeightSyncError("SGLangGenerator: no server in rotation to update.")
            old = self._lora_alias.get(name)
            with weights.in_update():
                results = await asyncio.gather(
                    *(self._load_one(s, served, path) for s in up), return_exceptions=True
                )
                failed = [(s, r) for s, r in zip(up, results) if isinstance(r, BaseException)]
                if failed:
                    for s, r in failed:
                        if isinstance(r, aiohttp.ClientError | asyncio.TimeoutError | OSError):
                            self._fleet.mark_down(s, f"adapter load failed: {r!r}")
                    loaded = [s for s in up if all(s is not f for f, _ in failed)]
                    await asyncio.gather(
                        *(self._unload_one(s, served) for s in loaded), return_exceptions=True
                    )
                    raise WeightSyncError(
                        f"SGLangGenerator: adapter {name!r} version {version} failed to load on "
                        f"{[s.url for s, _ in failed]}: {failed[0][1]}; the generator stays on "
                        f"version {weights.version}."
                    ) from failed[0][1]
                self._lora[served] = path
                self._lora_alias[name] = served
                if self._default_lora is None or self._default_lora in (old, name):
                    self._default_lora = served
                await asyncio.gather(*(self._client.set_version(s, version) for s in up))
                weights.adopt(version)
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
        if not self.enabled:
            raise ConfigError(f"{what}, but the servers were launched without LoRA; {want}.")
        max_rank = self._max_rank
        targets = self._target_modules
        if max_rank is not None and lora.rank > int(max_rank):
            raise ConfigError(f"{what}, but the servers take ranks up to {max_rank}; {want}.")
        if targets and "all" not in targets:
            missing = sorted(set(lora.target_modules) - set(targets))
            if missing:
                raise ConfigError(
                    f"{what}, but the servers were launched for {sorted(targets)} (missing "
                    f"{missing}); {want}."
                )

    async def _load_one(self, s: Server, name: str, path: str, pinned: bool = False) -> None:
        body = {"lora_name": name, "lora_path": str(path), "pinned": pinned}
        await self._client.control(s, "/load_lora_adapter", body)

    async def _unload_one(self, s: Server, name: str) -> None:
        await self._client.control(s, "/unload_lora_adapter", {"lora_name": name})

    async def reload(self, s: Server) -> None:
        """Load every adapter on a restarted server."""
        for name, path in self._lora.items():
            await self._load_one(s, name, path)

    def _require_lora(self, what: str) -> None:
        if not self.enabled:
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

    def adapters_for(
        self, requests: Sequence[GenerationRequest], lora_adapter: str | Sequence[str | None] | None
    ) -> list[str | None]:
        """The adapter name of each request (``None``: the base model): ``lora_adapter``, else
        the request's own ``adapter``, else the default; resolved to the served version."""
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
