"""The Ray runtime: starts or joins the cluster, reserves the run's placement group and creates
the policy ranks and generator engines in its bundles (see :mod:`rl_trainer.ray`).
"""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError, RLError
from rl_core.interfaces import Generator, WeightTransport
from rl_core.types import (
    WeightUpdate,
)
from rl_trainer.ray.collective import CollectiveGroup, is_collective
from rl_trainer.ray.colocation import Colocation
from rl_trainer.ray.generator import GeneratorEngine, RayGeneratorPool
from rl_trainer.ray.policy import PolicyRank, RayCritic, RayPolicy, RemoteWeights

__all__ = ["RayRuntime"]


class RayRuntime:
    """Starts (or joins) a Ray cluster, reserves one placement group for the run and creates
    the policy ranks and generator engines in its bundles.

    Build it with the root :class:`~rl_trainer.config.TrainerConfig`; the trainer asks it for
    the policy of each role (:meth:`build_policy`), the generator pool
    (:meth:`build_generator`), the weight transport (:meth:`build_transport`) and to publish
    weights (:meth:`publish`); :meth:`shutdown` removes everything it created.
    """

    def __init__(self, config: Any) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self.trainer_config = config
        self.config = rc = config.runtime
        self.run_dir = Path(config.run_dir).resolve()
        self.async_generation = bool(config.rl.async_generation)
        self.n_policy, self.n_gen = rc.policy.count, rc.generator.count
        self.colocated = rc.layout == "colocated"
        self.env = {
            "OMP_NUM_THREADS": str(config.threads),
            "TOKENIZERS_PARALLELISM": "false",
            "RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1",
            **rc.env,
        }
        bundles = self._bundles()
        self._started = False
        if not ray.is_initialized():
            os.environ.setdefault("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS", "1")
            if rc.address:
                ray.init(address=rc.address, log_to_driver=False)
            else:
                need = sum(b.get("CPU", 0.0) for b in bundles)
                ray.init(
                    num_cpus=rc.num_cpus or max(int(need + 0.999), 1),
                    include_dashboard=False,
                    log_to_driver=False,
                )
                self._started = True
        self.tag = f"rl-{uuid.uuid4().hex[:8]}"
        self.pg = placement_group(bundles, strategy=rc.placement_strategy, name=self.tag)
        try:
            ray.get(self.pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError as e:
            have = ray.cluster_resources()
            self.shutdown()
            raise ConfigError(
                f"runtime: the placement group {bundles} ({rc.placement_strategy}) cannot be "
                f"placed on this cluster (resources {have}). Lower runtime.policy / "
                "runtime.generator count or cpus, or raise runtime.num_cpus."
            ) from e
        self.colocation = Colocation(self.colocated and not self.async_generation)
        self.ranks: list[Any] = []
        self.pool: RayGeneratorPool | None = None
        self.driver_generator: Generator | None = None
        """The generator built in the driver when ``runtime.generator.count`` is 0."""
        self.receiver: WeightTransport | None = None
        """The driver-side receiver of the weight transport (driver generator only)."""
        self._policies: dict[str, RayPolicy] = {}
        policy_actor = ray.remote(PolicyRank)
        for i in range(self.n_policy):
            self.ranks.append(
                policy_actor.options(
                    num_cpus=rc.policy.cpus,
                    num_gpus=rc.policy.gpus,
                    max_concurrency=2,  # publish a kept copy while the next step trains
                    scheduling_strategy=self._bundle(i),
                    name=f"{self.tag}-policy-{i}",
                ).remote(i, self.n_policy, config.threads, self.env)
            )
        self._engines = [self.start_engine(i) for i in range(self.n_gen)]
        master_addr, master_port = ray.get(self.ranks[0].address.remote())
        ray.get([r.init_world.remote(master_addr, master_port) for r in self.ranks])

    # ----------------------------------------------------------------------------- placement
    def _bundles(self) -> list[dict[str, float]]:
        rc = self.config

        def bundle(*roles: Any) -> dict[str, float]:
            out = {"CPU": float(sum(r.cpus for r in roles))}
            gpus = float(sum(r.gpus for r in roles))
            if gpus:
                out["GPU"] = gpus
            return out

        if self.colocated:
            return [
                bundle(rc.policy, rc.generator) if i < self.n_gen else bundle(rc.policy)
                for i in range(self.n_policy)
            ]
        return [bundle(rc.policy)] * self.n_policy + [bundle(rc.generator)] * self.n_gen

    def _bundle(self, index: int) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=index
        )

    def generator_bundle(self, slot: int) -> int:
        """The bundle of generator ``slot`` (shared with policy rank ``slot`` when colocated)."""
        return slot if self.colocated else self.n_policy + slot

    def take_engines(self) -> list[Any]:
        """The generator engines started with the runtime (handed out once)."""
        engines, self._engines = self._engines, []
        if not engines:
            raise RLError("ray runtime: the generator engines were already handed out.")
        return engines

    def start_engine(self, slot: int) -> Any:
        """Start the generator engine actor of bundle ``slot`` (at start-up, and to replace a
        failed one)."""
        import ray

        rc = self.config
        return (
            ray.remote(GeneratorEngine)
            .options(
                num_cpus=rc.generator.cpus,
                num_gpus=rc.generator.gpus,
                scheduling_strategy=self._bundle(self.generator_bundle(slot)),
                name=f"{self.tag}-generator-{slot}-{uuid.uuid4().hex[:4]}",
            )
            .remote(self.trainer_config.generator.type, self.trainer_config.threads, self.env)
        )

    # ----------------------------------------------------------------------------- components
    def build_policy(self, spec: ComponentSpec, *, role: str = "policy") -> RayPolicy:
        """Build ``role``'s model on every policy rank; returns its proxy."""
        import ray

        try:
            built = ray.get([r.build.remote(role, spec) for r in self.ranks])
        except ray.exceptions.RayActorError as e:
            raise RLError(f"policy ({role}): a policy rank died while building ({e}).") from e
        version, shape, _, shares = built[0]
        proxy = RayPolicy(
            self.ranks,
            role=role,
            version=version,
            shape=shape,
            timeout_s=self.config.policy_timeout_s,
            colocation=self.colocation,
            dp_ranks=[dp for _, _, dp, _ in built],
        )
        cls = registry.resolve(registry.GROUPS["policy"], spec.type, field=f"{role}.type")
        proxy.supports_routing_replay = bool(getattr(cls, "supports_routing_replay", False))
        proxy._shares_prefixes = shares
        self._policies[role] = proxy
        return proxy

    def build_critic(self, spec: ComponentSpec) -> RayCritic:
        """Build the critic on every policy rank (role ``critic``); returns its proxy."""
        import ray

        try:
            built = ray.get([r.build.remote("critic", spec, "critic") for r in self.ranks])
        except ray.exceptions.RayActorError as e:
            raise RLError(f"critic: a policy rank died while building ({e}).") from e
        return RayCritic(
            self.ranks,
            role="critic",
            version=built[0][0],
            shape=None,
            timeout_s=self.config.policy_timeout_s,
            colocation=self.colocation,
            dp_ranks=[dp for _, _, dp, _ in built],
        )

    def build_generator(self, spec: ComponentSpec) -> Generator:
        """Start the generator engines and return their pool; with ``runtime.generator.count``
        0, build the generator in the driver instead (typically a client of servers managed
        outside Ray, e.g. ``generator: {type: sglang, url: ...}``)."""
        if self.pool is not None or self.driver_generator is not None:
            raise RLError("ray runtime: the generator was already built.")
        if self.n_gen == 0:
            self.driver_generator = registry.build("generator", spec, field="generator")
            return self.driver_generator
        self.pool = RayGeneratorPool(self, spec)
        if self.colocation.enabled and not self.pool.supports_release:
            self.colocation.enabled = False  # the backend keeps its memory (e.g. HFGenerator)
        elif self.colocation.enabled and not self.config.release_generator_memory:
            self.colocation.enabled = False
        self.colocation.engines = self.pool.engines
        return self.pool

    async def build_transport(self, spec: ComponentSpec) -> None:
        """Sender on policy rank 0, a receiver on every engine. The sync directories under the
        run directory are cleared first: they are transient (a resumed run republishes)."""
        import ray

        for key in ("directory", "local_dir"):
            path = spec.options.get(key)
            if path and Path(path).resolve().is_relative_to(self.run_dir):
                shutil.rmtree(path, ignore_errors=True)
        if self.pool is not None and is_collective(spec):
            # Policy rank 0 and the engines form the broadcast group (address from Ray).
            self.pool.group = CollectiveGroup(self.ranks[0], spec, self.tag)
        else:
            ray.get([r.build_sender.remote(spec) for r in self.ranks])
        if self.pool is not None:
            await self.pool.set_receiver(spec)
        if self.driver_generator is not None:
            if self.receiver is not None:
                self.receiver.close()
            self.receiver = registry.build("weight_transport", spec, field="weight_transport")

    def publish(self, version: int, weights: Any) -> WeightUpdate:
        """Have policy rank 0 publish ``weights`` (live or a kept copy) as ``version``."""
        if not isinstance(weights, RemoteWeights):
            raise RLError(
                "ray runtime: weights to publish must come from the policy ranks "
                "(RayPolicy.named_weights or keep_copy)."
            )
        if weights.from_copy:
            import ray

            return ray.get(self.ranks[0].publish.remote(version, True))
        return weights.policy._call("publish", version, False)[0]

    def current_checkpoint(
        self, version: int, receiver_spec: ComponentSpec | None
    ) -> tuple[int, str | None]:
        """A Hugging Face directory holding weight ``version`` for a restarted engine: the
        published full checkpoint (disk_full) or the host-local patched one (disk_delta); or
        ``(0, None)`` when no update was published yet (the engine starts from its spec)."""
        if receiver_spec is None or version == 0:
            return 0, None
        transport = registry.build("weight_transport", receiver_spec, field="weight_transport")
        try:
            if type(transport).__module__ == "rl_weightsync.disk_full":
                path = transport.version_dir(version)
            elif type(transport).__module__ == "rl_weightsync.disk_delta":
                path = Path(receiver_spec.options["local_dir"])
                if transport.local_version() != version:
                    return 0, None  # the restart applies the last update (or fails, clearly)
            else:
                return 0, None
        finally:
            transport.close()
        return version, str(path)

    def shutdown(self) -> None:
        """Kill the actors, remove the placement group, and stop Ray if this runtime started
        it."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if getattr(self, "receiver", None) is not None:
            self.receiver.close()
            self.receiver = None
        if not ray.is_initialized():
            return
        for r in getattr(self, "ranks", []):
            ray.kill(r, no_restart=True)
        self.ranks = []
        engines = list(getattr(self, "_engines", []))
        if getattr(self, "pool", None) is not None:
            engines += self.pool.engines
            self.pool.engines = []
        for e in engines:
            ray.kill(e, no_restart=True)
        self._engines = []
        if getattr(self, "pg", None) is not None:
            remove_placement_group(self.pg)
            self.pg = None
        if self._started:
            ray.shutdown()
            self._started = False
        time.sleep(0)  # let Ray's background threads run their clean-up
