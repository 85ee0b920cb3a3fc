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
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from rl_core.errors import GenerationError
from rl_core.types import GenerationRequest
from rl_sglang._state import _GeneratorState, _Server


class _LoRAMixin(_GeneratorState):
    """Load, replace and unload named adapters on every server; pick one per request."""

    @property
    def lora_adapters(self) -> dict[str, str]:
        """Loaded adapters: name -> path (as loaded by this generator)."""
        return dict(self._lora)

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
            await asyncio.gather(*(self._unload_one(s, name) for s in self._servers if s.up))
            self._lora.pop(name, None)
            if self._default_lora == name:
                self._default_lora = None

        await self._io.run(go())

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
        if name not in self._lora:
            raise GenerationError(
                f"SGLangGenerator.{what}: no LoRA adapter named {name!r} is loaded (loaded: "
                f"{sorted(self._lora)}); call load_lora_adapter({name!r}, path) first."
            )

    def _adapters_for(
        self, requests: Sequence[GenerationRequest], lora_adapter: str | Sequence[str | None] | None
    ) -> list[str | None]:
        """The adapter name of each request (``None``: the base model)."""
        if lora_adapter is None or isinstance(lora_adapter, str):
            names: list[str | None] = [lora_adapter or self._default_lora] * len(requests)
        else:
            names = list(lora_adapter)
            if len(names) != len(requests):
                raise GenerationError(
                    f"SGLangGenerator.generate: lora_adapter has {len(names)} names for "
                    f"{len(requests)} requests; give one per request, or one name for all."
                )
        for name in {n for n in names if n is not None}:
            self._check_adapter(name, "generate")
        return names
