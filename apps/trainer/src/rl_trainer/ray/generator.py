"""The generators on the ``ray`` runtime: :class:`GeneratorEngine` actors and the driver-side
:class:`RayGeneratorPool` that splits requests over them, retries failed chunks and restarts
failed engines.
"""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import GenerationError, RLError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import (
    GenerationRequest,
    GenerationResult,
    WeightUpdate,
)
from rl_trainer.ray.collective import CollectiveGroup
from rl_trainer.ray.colocation import Colocation
from rl_trainer.ray.config import setup_process, spec_with


class EngineHost(Protocol):
    """What a :class:`RayGeneratorPool` needs of its runtime
    (:class:`~rl_trainer.ray.runtime.RayRuntime`, which builds the pool: a protocol here, so
    the runtime imports this module and not the reverse)."""

    config: Any
    """The ``runtime`` section (timeouts, restart budget)."""
    colocation: Colocation
    """The colocated hand-over of the engines' memory."""

    def take_engines(self) -> list[Any]:
        """The engines started with the runtime (handed out once)."""
        ...

    def start_engine(self, slot: int) -> Any:
        """Start the engine of bundle ``slot``."""
        ...

    def current_checkpoint(
        self, version: int, receiver_spec: ComponentSpec | None
    ) -> tuple[int, str | None]:
        """A directory holding weight ``version`` for a restarted engine."""
        ...


__all__ = ["EngineHost", "GeneratorEngine", "RayGeneratorPool", "await_ref"]

logger = logging.getLogger(__name__)


class GeneratorEngine:
    """One generator engine (an async Ray actor) with the receiver side of the transport.

    The process starts (and imports the generator backend) as soon as the runtime starts, in
    parallel with the SFT warm-up; :meth:`build` loads the model when the RL phase begins.
    """

    def __init__(self, generator_type: str, threads: int, env: dict[str, str]) -> None:
        setup_process(threads, env)
        registry.resolve(registry.GROUPS["generator"], generator_type, field="generator.type")
        self.generator: Any = None
        self.receiver: WeightTransport | None = None
        self.collective = False
        """The receiver is a member of a collective group (``broadcast``)."""

    async def build(self, spec: ComponentSpec) -> tuple[int, bool, bool, bool]:
        """Build the generator; returns the served version and whether the backend can release
        memory, abort requests and return MoE routing (``supports_routing`` as the built engine
        reports it: an SGLang server knows only once it runs)."""
        self.generator = registry.build("generator", spec, field="generator")
        cls = type(self.generator)
        routing = bool(getattr(self.generator, "supports_routing", False))
        return (
            self.generator.weight_version,
            cls.supports_memory_release,
            cls.supports_abort,
            routing,
        )

    async def set_receiver(self, spec: ComponentSpec, collective: bool = False) -> None:
        """Build the receiver side of the weight transport (``collective``: this engine's rank
        in a new generation of the broadcast group; closing the old receiver ends a transfer
        that still waits on the old group)."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = registry.build("weight_transport", spec, field="weight_transport")
        self.collective = collective

    async def resync(self, update: WeightUpdate) -> int:
        """Join the re-sync broadcast of ``update`` on a re-formed collective group: apply it
        when behind, else receive it and discard it (every member of the group must join the
        broadcast). Returns the served version."""
        if self.receiver is None:
            raise RLError("generator engine has no weight transport; set_receiver was not called.")
        if self.generator.weight_version < update.version:
            await self.generator.update_weights(update, self.receiver)
        else:
            receiver = self.receiver  # already serving it: take part, keep the weights
            await asyncio.to_thread(
                lambda: list(receiver.receive(update, current_version=update.version - 1))
            )
        return self.generator.weight_version

    async def weight_checksums(self) -> dict[str, str]:
        """Checksums of the served weights by name, for backends that hold a torch ``model``
        (empty otherwise): lets a test or an operator check that every engine serves the
        trainer's weights."""
        from rl_weightsync.checksum import tensor_checksum

        model = getattr(self.generator, "model", None)
        if model is None or not hasattr(model, "state_dict"):
            return {}
        return {n: tensor_checksum(t) for n, t in model.state_dict().items()}

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``Generator.generate``."""
        return await self.generator.generate(requests)

    async def update_weights(self, update: WeightUpdate) -> int:
        """Apply ``update`` with this engine's receiver; returns the served version."""
        if self.receiver is None:
            raise RLError("generator engine has no weight transport; set_receiver was not called.")
        if self.collective and self.generator.weight_version >= update.version:
            return self.generator.weight_version  # a re-formed group's re-sync delivered it
        await self.generator.update_weights(update, self.receiver)
        return self.generator.weight_version

    async def health(self) -> bool:
        """``Generator.health``."""
        return await self.generator.health()

    async def abort(self) -> None:
        """``Generator.abort`` of every queued and running request."""
        await self.generator.abort()

    async def pause(self) -> None:
        """``Generator.pause``: new requests wait until :meth:`resume`."""
        await self.generator.pause()

    async def resume(self) -> None:
        """``Generator.resume``."""
        await self.generator.resume()

    async def release_memory(self) -> None:
        """``Generator.release_memory``."""
        await self.generator.release_memory()

    async def resume_memory(self) -> None:
        """``Generator.resume_memory``."""
        await self.generator.resume_memory()

    async def close(self) -> None:
        """Close the generator and the receiver."""
        await self.generator.close()
        if self.receiver is not None:
            self.receiver.close()


# --------------------------------------------------------------------------------------------
# Driver-side proxies
# --------------------------------------------------------------------------------------------


class RayGeneratorPool(Generator):
    """A :class:`~rl_core.interfaces.Generator` over generator engines (Ray actors).

    Each :meth:`generate` call splits its requests into one contiguous chunk per engine (a
    fixed split, so runs are reproducible) and returns the results in request order. A failed
    or hung engine is replaced: its chunk runs on another engine, and it restarts in its bundle
    serving the current weights (``restarts`` counts them).
    """

    def __init__(self, runtime: EngineHost, spec: ComponentSpec) -> None:
        self.runtime = runtime
        self.spec = spec
        self.receiver_spec: ComponentSpec | None = None
        self.engines: list[Any] = runtime.take_engines()
        import ray

        ready = ray.get([e.build.remote(spec) for e in self.engines])
        self._version = min(r[0] for r in ready)
        self.supports_release = all(r[1] for r in ready)
        self.supports_abort = all(r[2] for r in ready)
        """Every engine's backend can abort requests (``rl.partial_rollouts`` needs it)."""
        self.supports_routing = all(r[3] for r in ready)
        """Every engine returns MoE routing (``rollout.routing_replay`` needs it)."""
        self.last_update: WeightUpdate | None = None
        self.restarts = 0
        """Engines restarted so far (died or hung)."""
        self.events: list[str] = []
        """What happened to each failed engine, oldest first."""
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self._lock: asyncio.Lock | None = None
        self.group: CollectiveGroup | None = None
        """The broadcast group of the engines and policy rank 0 (collective transport only);
        re-formed after every restart."""

    @property
    def weight_version(self) -> int:
        """The version every engine serves."""
        return self._version

    async def _whole(self) -> None:
        """Wait for restarting engines."""
        while self._restarting:
            await asyncio.gather(*list(self._restarting.values()))

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve ``requests`` across the engines; results in request order."""
        await self._whole()
        await self.runtime.colocation.before_generate()
        n = len(self.engines)
        size, rest = divmod(len(requests), n)
        chunks, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < rest else 0)
            chunks.append((i, list(requests[start:end])))
            start = end
        parts = await asyncio.gather(*(self._serve(i, c) for i, c in chunks if c))
        return [r for part in parts for r in part]

    async def _serve(self, slot: int, chunk: list[GenerationRequest]) -> list[GenerationResult]:
        import ray

        timeout = self.runtime.config.generate_timeout_s
        tried: set[int] = set()
        while True:
            if slot in self._restarting:
                await self._restarting[slot]
            engine = self.engines[slot]
            try:
                return await asyncio.wait_for(await_ref(engine.generate.remote(chunk)), timeout)
            except (ray.exceptions.RayActorError, TimeoutError) as e:
                what = "died" if isinstance(e, ray.exceptions.RayActorError) else "hung"
                self._fail(slot, engine, f"{what} serving {len(chunk)} requests")
                tried.add(slot)
                healthy = [i for i in range(len(self.engines)) if i not in self._restarting]
                others = [i for i in healthy if i not in tried]
                slot = others[0] if others else slot  # else wait for this slot's restart

    def _fail(self, slot: int, engine: Any, what: str) -> None:
        """Kill ``engine`` and restart its slot in the background (once per failure)."""
        import ray

        if slot in self._restarting or self.engines[slot] is not engine:
            return  # already being replaced
        self.restarts += 1
        self.events.append(f"engine {slot} {what}")
        warnings.warn(f"ray runtime: generator engine {slot} {what}; restarting it", stacklevel=2)
        if self.restarts > self.runtime.config.max_generator_restarts:
            raise GenerationError(
                f"generator engines failed {self.restarts} times (runtime.max_generator_restarts="
                f"{self.runtime.config.max_generator_restarts}): {self.events}. Check the engine "
                "logs (memory, timeouts) or raise runtime.generate_timeout_s."
            )
        ray.kill(engine, no_restart=True)
        self._restarting[slot] = asyncio.get_running_loop().create_task(self._restart(slot))

    async def _restart(self, slot: int) -> None:
        """Start a new engine in ``slot``'s bundle from the newest checkpoint and sync it."""
        target = self.last_update.version if self.last_update is not None else self._version
        try:
            version, path = self.runtime.current_checkpoint(target, self.receiver_spec)
            spec = self.spec
            if path is not None:
                spec = spec_with("generator", spec, model_path=path, initial_version=version)
            engine = self.runtime.start_engine(slot)
            served = (await await_ref(engine.build.remote(spec)))[0]
            if self.group is not None:  # a new world with the new engine, re-synced
                self.engines[slot] = engine
                served = (await self._reform(include=slot)).get(slot, served)
                # The re-sync delivers the newest published version, which may be newer than
                # the target when a publish overtook this restart (its update then is a no-op).
                target = max(target, served)
            elif self.receiver_spec is not None:
                await await_ref(engine.set_receiver.remote(self.receiver_spec))
            if served != target and self.last_update is not None:
                served = await await_ref(engine.update_weights.remote(self.last_update))
            if served != target:
                raise RLError(
                    f"generator engine {slot} restarted on version {served}, not the current "
                    f"{target}; the weight transport cannot re-sync it."
                )
            self.engines[slot] = engine
        finally:
            self._restarting.pop(slot, None)

    async def update_weights(self, update: WeightUpdate, transport: WeightTransport | None) -> None:
        """Every engine applies ``update`` with its own receiver (``transport`` is unused)."""
        import ray

        await self._whole()
        await self.runtime.colocation.before_generate()
        self.last_update = update

        async def one(slot: int, engine: Any) -> tuple[int, Any, Any, BaseException | None]:
            try:
                return slot, engine, await await_ref(engine.update_weights.remote(update)), None
            except Exception as e:
                return slot, engine, None, e

        versions: dict[int, int] = {}
        resync = False
        # As each engine finishes: a dead one is restarted at once (with a collective transport
        # its restart re-forms the group, which releases the members still waiting on it).
        for done in asyncio.as_completed([one(i, e) for i, e in enumerate(list(self.engines))]):
            slot, engine, served, err = await done
            if isinstance(err, ray.exceptions.RayActorError):
                self._fail(slot, engine, "died applying a weight update")
                served = update.version  # its restart syncs to the new version
            elif err is not None:
                if self.group is None:
                    raise err
                resync = True  # a member failed the transfer: re-form and re-sync below
            versions[slot] = served
        await self._whole()  # engines that died restart on this update
        if resync:
            versions = await self._reform()
        if all(v == update.version for v in versions.values()):
            self._version = update.version  # else the loop reports the mismatch

    async def _reform(self, include: int | None = None, attempts: int = 3) -> dict[int, int]:
        """Form a new generation of the collective group over the engines that are not
        restarting (and ``include``) and re-sync them; returns each member's served version.
        A member that died is restarted (which re-forms again); a failed transfer is retried."""
        import ray

        assert self.group is not None
        for attempt in range(attempts):
            slots = [
                i for i in range(len(self.engines)) if i == include or i not in self._restarting
            ]
            engines = [self.engines[i] for i in slots]
            results = await self.group.form(engines)
            served, failed = {}, []
            for slot, engine, r in zip(slots, engines, results, strict=True):
                if isinstance(r, ray.exceptions.RayActorError) and slot != include:
                    self._fail(slot, engine, "died in a weight re-sync")
                elif isinstance(r, BaseException):
                    failed.append(f"engine {slot}: {r}")
                elif r is not None:
                    served[slot] = r
            if not failed:
                return served
            logger.warning("ray runtime: weight re-sync attempt %d failed: %s", attempt + 1, failed)
        raise GenerationError(
            f"ray runtime: the broadcast group could not re-sync the engines after {attempts} "
            f"attempts ({failed}); check the engine logs and weight_transport.timeout_s."
        )

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort every in-flight request on every live engine (they return their partial
        tokens); only abort-all is supported across engines."""
        if request_ids is not None:
            raise GenerationError(
                "ray runtime: the generator pool aborts all requests only; call abort() "
                "without request ids."
            )
        live = [e for i, e in enumerate(self.engines) if i not in self._restarting]
        await asyncio.gather(*(await_ref(e.abort.remote()) for e in live), return_exceptions=True)

    async def set_receiver(self, spec: ComponentSpec) -> None:
        """Build the receiver side of the weight transport on every engine (with a collective
        transport: form the first generation of the group)."""
        self.receiver_spec = spec
        if self.group is not None:
            await self._reform()
            return
        await asyncio.gather(*(await_ref(e.set_receiver.remote(spec)) for e in self.engines))

    async def health(self) -> bool:
        """True when every engine answers its health check."""
        import ray

        try:
            return all(await asyncio.gather(*(await_ref(e.health.remote()) for e in self.engines)))
        except ray.exceptions.RayError as e:  # a dead or failing engine: unhealthy, and logged
            logger.warning("ray runtime: a generator engine failed its health check: %s", e)
            return False

    async def close(self) -> None:
        """Stop restarts and kill the engines."""
        import ray

        for task in self._restarting.values():
            task.cancel()
        for e in self.engines:
            ray.kill(e, no_restart=True)
        self.engines = []


async def await_ref(ref: Any) -> Any:
    """Await a Ray object ref (a coroutine, so ``asyncio.wait_for``/``gather`` take it)."""
    return await ref
