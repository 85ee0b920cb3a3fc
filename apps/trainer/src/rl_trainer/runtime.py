"""The ``ray`` runtime: policy ranks and generators as Ray actors in a placement group.

The loop (:mod:`rl_trainer.loop`) is the same as on the ``local`` runtime; only where the
components live and how weights move differ. The driver keeps the data, buffer, rewards and the
schedule; the heavy parts run in actors and are reached through proxies that satisfy the same
interfaces::

    driver (Trainer)                          Ray actors (one placement group)
    RayPolicy    (Policy)    ── SPMD calls ──> PolicyRank x N   (policy + reference, sender)
    RayGeneratorPool (Generator) ─ chunks ──> GeneratorEngine x M (generator + receiver)
    weights: rank 0 publishes through a cross-process WeightTransport (disk_full, disk_delta);
             every engine applies the update with its own receiver.

Layouts (``runtime.layout``): ``disaggregated`` gives every actor its own bundle;
``colocated`` puts generator ``i`` into the bundle of policy rank ``i`` and, in the synchronous
loop, releases the generator's memory while the policy trains when the backend supports it.

Failures: a generator engine that dies or runs past ``runtime.generate_timeout_s`` is killed,
its requests are retried on another engine (same weights, same per-request seeds), and it is
restarted in its bundle from the newest published checkpoint, so it serves the current version
before it takes work again. A policy rank that dies or times out stops the run with an
:class:`~rl_core.errors.RLError`; the newest checkpoint resumes it (``--resume``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import os
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import ConfigError, GenerationError, RLError
from rl_core.interfaces import Critic, Generator, LossFn, Policy, ValueLossFn, WeightTransport
from rl_core.types import (
    GenerationRequest,
    GenerationResult,
    LogProbOutput,
    ModelShape,
    TrainBatch,
    WeightUpdate,
)

__all__ = [
    "GeneratorEngine",
    "PolicyRank",
    "RayCritic",
    "RayGeneratorPool",
    "RayPolicy",
    "RayRuntime",
    "RemoteWeights",
    "check_ray_config",
]

_FILE_TRANSPORTS = ("rl_weightsync.disk_full", "rl_weightsync.disk_delta")


def _options(kind: str, spec: ComponentSpec, **values: Any) -> ComponentSpec:
    """``spec`` with ``values`` set for the options its ``Config`` has (others are dropped)."""
    cls = registry.resolve(registry.GROUPS[kind], spec.type, field=f"{kind}.type")
    known = {f.name for f in dataclasses.fields(cls.Config)} if hasattr(cls, "Config") else set()
    extra = {k: v for k, v in values.items() if k in known}
    return ComponentSpec(type=spec.type, options={**spec.options, **extra})


def check_ray_config(config: Any, transport_spec: ComponentSpec) -> None:
    """Refuse settings the ``ray`` runtime cannot run, naming the field and the fix.

    ``config`` is the :class:`~rl_trainer.config.TrainerConfig`; ``transport_spec`` the weight
    transport's spec with its run defaults.
    """
    rc = config.runtime
    for role, least in (("policy", 1), ("generator", 0)):
        res = getattr(rc, role)
        if res.count < least or res.cpus < 0 or res.gpus < 0:
            raise ConfigError(
                f"runtime.{role}: count must be >= {least} and cpus/gpus >= 0, got {res}."
            )
    if rc.generator.count == 0:
        if rc.layout == "colocated":
            raise ConfigError(
                "runtime.generator.count: 0 (the generator runs in the driver) cannot share the "
                "policy ranks' bundles; use runtime.layout=disaggregated."
            )
        cls = registry.resolve(
            registry.GROUPS["weight_transport"], transport_spec.type, field="weight_transport.type"
        )
        if cls.__module__ not in _FILE_TRANSPORTS:
            raise ConfigError(
                f"weight_transport.type: {transport_spec.type!r} with runtime.generator.count=0 "
                "(a generator in the driver, e.g. a client of external SGLang servers); use "
                "weight_transport: {type: disk_full} or {type: disk_delta} on a filesystem the "
                "policy rank and the servers share."
            )
    if rc.layout == "colocated" and rc.generator.count > rc.policy.count:
        raise ConfigError(
            f"runtime.generator.count: {rc.generator.count} generators cannot share the bundles "
            f"of {rc.policy.count} policy ranks (colocated layout); lower it to <= "
            "runtime.policy.count or use runtime.layout=disaggregated."
        )
    if rc.generate_timeout_s <= 0 or rc.max_generator_restarts < 0:
        raise ConfigError(
            "runtime.generate_timeout_s must be > 0 and runtime.max_generator_restarts >= 0."
        )
    cls = registry.resolve(
        registry.GROUPS["weight_transport"], transport_spec.type, field="weight_transport.type"
    )
    if cls.__module__ == "rl_weightsync.inprocess":
        raise ConfigError(
            "weight_transport.type: 'inprocess' moves weights inside one process, but on the ray "
            "runtime the policy and the generators are separate processes. Use "
            "weight_transport: {type: disk_full} or {type: disk_delta} (run_dir on a filesystem "
            "every node sees)."
        )
    if cls.__module__ == "rl_weightsync.broadcast":
        raise ConfigError(
            "weight_transport.type: 'broadcast' is not supported on the ray runtime yet (its "
            "collective world would have to be re-formed when a generator restarts). Use "
            "weight_transport: {type: disk_full} or {type: disk_delta}."
        )
    pol = registry.resolve(registry.GROUPS["policy"], config.policy.type, field="policy.type")
    if rc.policy.count > 1 and pol.__module__.startswith("rl_hf"):
        raise ConfigError(
            f"runtime.policy.count: {rc.policy.count} ranks, but policy.type={config.policy.type!r}"
            " trains in one process (no data or tensor parallelism). Use runtime.policy.count=1, "
            "or a parallel policy such as policy.type=megatron."
        )
    if config.critic is not None and rc.policy.count > 1:
        crit = registry.resolve(registry.GROUPS["critic"], config.critic.type, field="critic.type")
        if crit.__module__.startswith("rl_hf"):
            raise ConfigError(
                f"critic.type: {config.critic.type!r} trains in one process, but the critic runs "
                f"on the {rc.policy.count} policy ranks; use a parallel critic such as "
                "critic.type=megatron, or runtime.policy.count=1."
            )
        copts = config.critic.options
        for key in ("tp_size", "pp_size"):
            if int(copts.get(key, 1)) != int(config.policy.options.get(key, 1)):
                raise ConfigError(
                    f"critic.{key}: {copts.get(key, 1)} differs from policy.{key} "
                    f"{config.policy.options.get(key, 1)}; the critic shares the policy ranks "
                    "and their layout, so set the same value."
                )
    opts = config.policy.options
    model_parallel = int(opts.get("tp_size", 1)) * int(opts.get("pp_size", 1))
    if rc.policy.count % model_parallel:
        raise ConfigError(
            f"runtime.policy.count: {rc.policy.count} ranks is not a multiple of policy tp_size "
            f"x pp_size = {model_parallel}; the ranks form (count / that) data-parallel "
            "replicas."
        )


# --------------------------------------------------------------------------------------------
# Actors (plain classes; the runtime wraps them with ray.remote)
# --------------------------------------------------------------------------------------------


def _setup_process(threads: int, env: dict[str, str]) -> None:
    os.environ.update(env)
    torch.set_num_threads(threads)
    # Import the Hugging Face stack at actor start, not in the first timed call.
    with contextlib.suppress(ImportError):
        from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


class PolicyRank:
    """One SPMD rank of the policy group (a Ray actor).

    Holds the models of each role (``policy``, ``reference``) built from their specs with the
    torch.distributed environment of its rank set (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``), the sender side of the weight transport (rank 0), and CPU copies of
    weights kept for later publication (asynchronous generation). Every method is called on
    every rank in the same order, as SPMD backends such as Megatron require.

    The actor serves two calls at a time (a kept copy is published while the next step
    trains), but every call that touches a model runs on one dedicated thread: backends keep
    thread-local state (Megatron's CPU support is a thread-local torch function mode).
    """

    def __init__(self, rank: int, world_size: int, threads: int, env: dict[str, str]) -> None:
        _setup_process(threads, env)
        self.rank = rank
        self.world_size = world_size
        self.models: dict[str, Any] = {}
        self.sender: WeightTransport | None = None
        self.copies: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._model_thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix="policy-rank",
            initializer=torch.set_num_threads,
            initargs=(threads,),
        )

    def _on_model_thread(self, fn: Any, *args: Any) -> Any:
        return self._model_thread.submit(fn, *args).result()

    def address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port on it (rank 0 hosts the process-group store)."""
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return ip, int(s.getsockname()[1])

    def init_world(self, master_addr: str, master_port: int) -> None:
        """Set the torch.distributed environment of this rank (the policy initialises it)."""
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            LOCAL_RANK="0",
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
        )

    def build(
        self, role: str, spec: ComponentSpec, kind: str = "policy"
    ) -> tuple[int, ModelShape | None, int]:
        """Build the model of ``role`` (replacing an earlier one) from the registry group of
        ``kind`` (``policy`` or ``critic``); returns version, shape (policies only) and this
        rank's data-parallel index (``layout.dp_rank`` of a parallel model, else 0)."""

        def run() -> tuple[int, ModelShape | None, int]:
            self.models.pop(role, None)
            model = registry.build(kind, spec, field=kind)
            self.models[role] = model
            layout = getattr(model, "layout", None)
            shape = model.model_shape if kind == "policy" else None
            return model.version, shape, int(getattr(layout, "dp_rank", 0))

        return self._on_model_thread(run)

    def compute_values(self, batch: TrainBatch, role: str) -> torch.Tensor:
        """``Critic.compute_values`` of ``role`` (on this rank's shard when sharded)."""
        critic = self.models[role]
        return self._on_model_thread(lambda: critic.compute_values(batch))

    def critic_train_step(
        self, batch: TrainBatch, role: str, loss_fn: ValueLossFn
    ) -> tuple[dict[str, float], int]:
        """``Critic.train_step`` of ``role``; returns the metrics and the new version."""
        critic = self.models[role]
        return self._on_model_thread(lambda: (critic.train_step(batch, loss_fn), critic.version))

    def compute_logprobs(self, batch: TrainBatch, role: str, with_entropy: bool) -> LogProbOutput:
        """``Policy.compute_logprobs`` of ``role`` (on this rank's shard when sharded)."""
        model = self.models[role]
        return self._on_model_thread(
            lambda: model.compute_logprobs(batch, with_entropy=with_entropy)
        )

    def train_step(
        self, batch: TrainBatch, role: str, loss_fn: LossFn
    ) -> tuple[dict[str, float], int]:
        """``Policy.train_step`` of ``role``; returns the metrics and the new version."""
        policy = self.models[role]
        return self._on_model_thread(lambda: (policy.train_step(batch, loss_fn), policy.version))

    def save(self, role: str, directory: str, with_optimizer: bool) -> None:
        """``Policy.save`` of ``role``."""
        model = self.models[role]
        self._on_model_thread(lambda: model.save(directory, with_optimizer=with_optimizer))

    def load(self, role: str, directory: str, with_optimizer: bool) -> int:
        """``Policy.load`` of ``role``; returns the loaded version."""
        model = self.models[role]
        self._on_model_thread(lambda: model.load(directory, with_optimizer=with_optimizer))
        return model.version

    def weights(self, role: str) -> list[tuple[str, torch.Tensor]]:
        """Full weights of ``role`` (every rank iterates; rank 0 returns them)."""
        model = self.models[role]
        out = self._on_model_thread(
            lambda: [(n, t.detach().to("cpu", copy=True)) for n, t in model.named_weights()]
        )
        return out if self.rank == 0 else []

    def build_sender(self, spec: ComponentSpec | None) -> None:
        """Build (rank 0) or drop the sender side of the weight transport."""
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if spec is not None and self.rank == 0:
            self.sender = registry.build("weight_transport", spec, field="weight_transport")

    def keep_copy(self) -> int:
        """Keep a CPU copy of the policy's current weights (for a later :meth:`publish`)."""
        policy = self.models["policy"]
        weights, version = self._on_model_thread(
            lambda: (
                [(n, t.detach().to("cpu", copy=True)) for n, t in policy.named_weights()],
                policy.version,
            )
        )
        if self.rank == 0:
            self.copies[version] = weights
        return version

    def publish(self, version: int, from_copy: bool) -> WeightUpdate | None:
        """Publish ``version`` through the sender (rank 0 returns the update): the live weights,
        or the copy kept by :meth:`keep_copy` (runs concurrently with a ``train_step``)."""
        if from_copy:
            if self.rank != 0:
                return None
            weights = self.copies.pop(version)
            for v in [v for v in self.copies if v < version]:
                del self.copies[v]
            return self._send(version, weights)
        policy = self.models["policy"]

        def run() -> WeightUpdate | None:
            live = policy.named_weights()
            if self.rank != 0:
                for _ in live:  # collective backends gather on every rank
                    pass
                return None
            return self._send(version, live)

        return self._on_model_thread(run)

    def _send(self, version: int, weights: Iterable[tuple[str, torch.Tensor]]) -> WeightUpdate:
        if self.sender is None:
            raise RLError("policy rank 0 has no weight transport; build_sender was not called.")
        return self.sender.publish(version, weights)

    def close(self) -> None:
        """Close the sender and drop the models."""
        self.build_sender(None)
        self.models.clear()
        self.copies.clear()
        self._model_thread.shutdown(wait=False)


class GeneratorEngine:
    """One generator engine (an async Ray actor) with the receiver side of the transport.

    The process starts (and imports the generator backend) as soon as the runtime starts, in
    parallel with the SFT warm-up; :meth:`build` loads the model when the RL phase begins.
    """

    def __init__(self, generator_type: str, threads: int, env: dict[str, str]) -> None:
        _setup_process(threads, env)
        registry.resolve(registry.GROUPS["generator"], generator_type, field="generator.type")
        self.generator: Any = None
        self.receiver: WeightTransport | None = None

    async def build(self, spec: ComponentSpec) -> tuple[int, bool, bool]:
        """Build the generator; returns the served version and whether the backend can release
        memory and abort requests."""
        self.generator = registry.build("generator", spec, field="generator")
        cls = type(self.generator)
        return self.generator.weight_version, cls.supports_memory_release, cls.supports_abort

    async def set_receiver(self, spec: ComponentSpec) -> None:
        """Build the receiver side of the weight transport."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = registry.build("weight_transport", spec, field="weight_transport")

    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """``Generator.generate``."""
        return await self.generator.generate(requests)

    async def update_weights(self, update: WeightUpdate) -> int:
        """Apply ``update`` with this engine's receiver; returns the served version."""
        if self.receiver is None:
            raise RLError("generator engine has no weight transport; set_receiver was not called.")
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


@dataclasses.dataclass(slots=True)
class RemoteWeights:
    """Weights held by the policy ranks: the live ones, or a copy kept for ``version``.

    Iterating fetches them into this process (rank 0's tensors); the runtime instead has rank 0
    publish them through the weight transport (:meth:`RayRuntime.publish`).
    """

    policy: RayPolicy
    """The policy group holding them."""
    version: int
    """Their version."""
    from_copy: bool
    """A copy kept by :meth:`RayPolicy.keep_copy` (else the live weights)."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Rank 0's tensors (live weights only)."""
        if self.from_copy:
            raise RLError("a kept weight copy can only be published, not read back.")
        return iter(self.policy._call("weights", self.policy.role)[0])


class _Colocation:
    """Releases generator memory while colocated policy ranks train (synchronous loop only)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.engines: list[Any] = []
        self.released = False

    def before_train(self) -> None:
        if self.enabled and self.engines and not self.released:
            import ray

            ray.get([e.release_memory.remote() for e in self.engines])
            self.released = True

    async def before_generate(self) -> None:
        if self.released:
            await asyncio.gather(*(e.resume_memory.remote() for e in self.engines))
            self.released = False


class _RankGroup:
    """A model of one ``role`` living in the SPMD ranks of the Ray policy group: every call runs
    on every rank; rank 0's result is returned. With several data-parallel replicas
    (``dp_ranks``) each replica gets its shard of a planned batch. A dead or hung rank raises
    :class:`~rl_core.errors.RLError` (the run stops; resume from a checkpoint)."""

    def __init__(
        self,
        ranks: Sequence[Any],
        *,
        role: str,
        version: int,
        shape: ModelShape | None,
        timeout_s: float | None,
        colocation: _Colocation,
        dp_ranks: Sequence[int] | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.dp_ranks = list(dp_ranks) if dp_ranks is not None else [0] * len(self.ranks)
        """Data-parallel replica of each rank."""
        self.role = role
        self._version = version
        self._shape = shape
        self._timeout = timeout_s
        self._colocation = colocation

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas among the ranks (the trainer plans one shard per replica)."""
        return max(self.dp_ranks) + 1

    def _shards(self, batch: TrainBatch) -> list[Any] | None:
        """Per-rank object refs of the batch's data-parallel shards (``None``: no sharding)."""
        import ray

        if self.data_parallel_size == 1:
            return None
        if batch.num_shards != self.data_parallel_size:
            raise RLError(
                f"policy ({self.role}): a batch with {batch.num_shards} data-parallel shards for "
                f"{self.data_parallel_size} replicas; plan it with dp_size="
                f"{self.data_parallel_size} (TrainBatch.dp_bounds)."
            )
        refs = [ray.put(batch.shard(i)) for i in range(batch.num_shards)]
        return [refs[d] for d in self.dp_ranks]

    def _first_of_each_replica(self, results: list[Any]) -> list[Any]:
        """One result per data-parallel replica, in replica order."""
        return [results[self.dp_ranks.index(d)] for d in range(self.data_parallel_size)]

    def _call(self, method: str, *args: Any, per_rank: list[Any] | None = None) -> list[Any]:
        """Run ``method`` on every rank (``per_rank[i]`` first, then ``args``); the results."""
        import ray

        refs = [
            getattr(r, method).remote(*(() if per_rank is None else (per_rank[i],)), *args)
            for i, r in enumerate(self.ranks)
        ]
        try:
            return ray.get(refs, timeout=self._timeout)
        except ray.exceptions.GetTimeoutError as e:
            raise RLError(
                f"policy ({self.role}): {method} took longer than runtime.policy_timeout_s="
                f"{self._timeout}; a rank hangs. The run stops; continue from the newest "
                "checkpoint with --resume."
            ) from e
        except ray.exceptions.RayActorError as e:
            raise RLError(
                f"policy ({self.role}): a policy rank died during {method} ({e}). The run stops; "
                "continue from the newest checkpoint with --resume."
            ) from e

    @property
    def version(self) -> int:
        """Weight version (kept in step with the ranks)."""
        return self._version

    def _sharded(self, method: str, batch: TrainBatch, *args: Any, train: bool) -> list[Any]:
        """``method(batch_or_shard, role, *args)`` on every rank; rank 0's result, or one per
        data-parallel replica in shard order. A training call needs a batch planned for the
        replicas; a forward-only call on an unsharded batch runs it whole on every rank."""
        import ray

        shards = self._shards(batch) if train or batch.num_shards > 1 else None
        if shards is None:
            ref = ray.put(batch)
            return self._call(method, self.role, *args, per_rank=[ref] * len(self.ranks))[:1]
        return self._first_of_each_replica(self._call(method, self.role, *args, per_rank=shards))

    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Every rank saves (rank 0 the weights); ``directory`` must be on a shared filesystem."""
        self._call("save", self.role, str(directory), with_optimizer)

    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Every rank loads what :meth:`save` wrote."""
        self._version = self._call("load", self.role, str(directory), with_optimizer)[0]


class RayCritic(_RankGroup, Critic):
    """A :class:`~rl_core.interfaces.Critic` in the ranks of the Ray policy group (built next
    to the policy, ``role`` ``critic``): values and value steps run on every rank, each
    data-parallel replica on its shard."""

    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[T]``: rank 0's, or each replica's shard concatenated in shard order."""
        return torch.cat(self._sharded("compute_values", batch, train=False))

    def train_step(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """One value step on every rank; rank 0's metrics (reduced over replicas by a parallel
        critic)."""
        self._colocation.before_train()
        metrics, version = self._sharded("critic_train_step", batch, loss_fn, train=True)[0]
        self._version = version
        return metrics


class RayPolicy(_RankGroup, Policy):
    """A :class:`~rl_core.interfaces.Policy` in the SPMD ranks of the Ray policy group (see
    :class:`_RankGroup` for how calls reach the ranks)."""

    @property
    def model_shape(self) -> ModelShape:
        """Architecture numbers (from rank 0)."""
        assert self._shape is not None
        return self._shape

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs on every rank; rank 0's result, or with data-parallel shards each
        replica's shard, concatenated in shard order."""
        outs = self._sharded("compute_logprobs", batch, with_entropy, train=False)
        if len(outs) == 1:
            return outs[0]
        ent = [o.entropy for o in outs]
        return LogProbOutput(
            logprobs=torch.cat([o.logprobs for o in outs]),
            entropy=torch.cat(ent) if with_entropy and all(e is not None for e in ent) else None,
        )

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step on every rank (each data-parallel replica on its shard); rank 0's
        metrics (a parallel policy reduces them over the replicas)."""
        self._colocation.before_train()
        metrics, version = self._sharded("train_step", batch, loss_fn, train=True)[0]
        self._version = version
        return metrics

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The live weights as :class:`RemoteWeights` (published by rank 0, or fetched)."""
        return RemoteWeights(self, self._version, from_copy=False)  # type: ignore[return-value]

    def keep_copy(self) -> RemoteWeights:
        """Have the ranks keep a CPU copy of the current weights for a later publication."""
        self._call("keep_copy")
        return RemoteWeights(self, self._version, from_copy=True)


class RayGeneratorPool(Generator):
    """A :class:`~rl_core.interfaces.Generator` over generator engines (Ray actors).

    Each :meth:`generate` call splits its requests into one contiguous chunk per engine (a
    fixed split, so runs are reproducible) and returns the results in request order. A failed
    or hung engine is replaced: its chunk runs on another engine, and it restarts in its bundle
    serving the current weights (``restarts`` counts them).
    """

    def __init__(self, runtime: RayRuntime, spec: ComponentSpec) -> None:
        self.runtime = runtime
        self.spec = spec
        self.receiver_spec: ComponentSpec | None = None
        self.engines: list[Any] = runtime.take_engines()
        import ray

        ready = ray.get([e.build.remote(spec) for e in self.engines])
        self._version = min(v for v, _, _ in ready)
        self.supports_release = all(flag for _, flag, _ in ready)
        self.supports_abort = all(flag for _, _, flag in ready)
        """Every engine's backend can abort requests (``rl.partial_rollouts`` needs it)."""
        self.last_update: WeightUpdate | None = None
        self.restarts = 0
        """Engines restarted so far (died or hung)."""
        self.events: list[str] = []
        """What happened to each failed engine, oldest first."""
        self._restarting: dict[int, asyncio.Task[None]] = {}
        self._lock: asyncio.Lock | None = None

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
                return await asyncio.wait_for(_await_ref(engine.generate.remote(chunk)), timeout)
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
                spec = _options("generator", spec, model_path=path, initial_version=version)
            engine = self.runtime._start_engine(slot)
            served, _, _ = await _await_ref(engine.build.remote(spec))
            if self.receiver_spec is not None:
                await _await_ref(engine.set_receiver.remote(self.receiver_spec))
            if served != target and self.last_update is not None:
                served = await _await_ref(engine.update_weights.remote(self.last_update))
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
        refs = [e.update_weights.remote(update) for e in self.engines]
        versions = []
        for slot, (engine, ref) in enumerate(zip(list(self.engines), refs, strict=True)):
            try:
                versions.append(await _await_ref(ref))
            except ray.exceptions.RayActorError:
                self._fail(slot, engine, "died applying a weight update")
                versions.append(update.version)  # its restart syncs to the new version
        await self._whole()  # engines that died restart on this update
        if all(v == update.version for v in versions):
            self._version = update.version  # else the loop reports the mismatch

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort every in-flight request on every live engine (they return their partial
        tokens); only abort-all is supported across engines."""
        if request_ids is not None:
            raise GenerationError(
                "ray runtime: the generator pool aborts all requests only; call abort() "
                "without request ids."
            )
        live = [e for i, e in enumerate(self.engines) if i not in self._restarting]
        await asyncio.gather(*(_await_ref(e.abort.remote()) for e in live), return_exceptions=True)

    async def set_receiver(self, spec: ComponentSpec) -> None:
        """Build the receiver side of the weight transport on every engine."""
        self.receiver_spec = spec
        await asyncio.gather(*(_await_ref(e.set_receiver.remote(spec)) for e in self.engines))

    async def health(self) -> bool:
        """True when every engine answers its health check."""
        try:
            return all(await asyncio.gather(*(_await_ref(e.health.remote()) for e in self.engines)))
        except Exception:
            return False

    async def close(self) -> None:
        """Stop restarts and kill the engines."""
        import ray

        for task in self._restarting.values():
            task.cancel()
        for e in self.engines:
            ray.kill(e, no_restart=True)
        self.engines = []


async def _await_ref(ref: Any) -> Any:
    return await ref


# --------------------------------------------------------------------------------------------
# The runtime
# --------------------------------------------------------------------------------------------


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
        self.colocation = _Colocation(self.colocated and not self.async_generation)
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
        self._engines = [self._start_engine(i) for i in range(self.n_gen)]
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

    def _start_engine(self, slot: int) -> Any:
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
        version, shape, _ = built[0]
        proxy = RayPolicy(
            self.ranks,
            role=role,
            version=version,
            shape=shape,
            timeout_s=self.config.policy_timeout_s,
            colocation=self.colocation,
            dp_ranks=[dp for _, _, dp in built],
        )
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
            dp_ranks=[dp for _, _, dp in built],
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
