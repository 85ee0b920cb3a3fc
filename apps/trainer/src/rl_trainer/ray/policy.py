"""The policy group on the ``ray`` runtime: :class:`PolicyRank` actors (one per SPMD rank) and
the driver-side proxies :class:`RayPolicy` and :class:`RayCritic` that satisfy the
:class:`~rl_core.interfaces.Policy` and :class:`~rl_core.interfaces.Critic` interfaces.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import socket
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rl_core import registry
from rl_core.config import ComponentSpec
from rl_core.errors import RLError
from rl_core.interfaces import Critic, LossFn, Policy, ValueLossFn, WeightTransport
from rl_core.types import (
    LogProbOutput,
    ModelShape,
    TrainBatch,
    WeightUpdate,
)
from rl_trainer.ray.colocation import Colocation
from rl_trainer.ray.config import setup_process

__all__ = ["PolicyRank", "RayCritic", "RayPolicy", "RemoteWeights"]


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
        setup_process(threads, env)
        self.rank = rank
        self.world_size = world_size
        self.models: dict[str, Any] = {}
        self.sender: WeightTransport | None = None
        self._sender_lock = threading.Lock()  # a publish and a group re-formation never overlap
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
    ) -> tuple[int, ModelShape | None, int, bool]:
        """Build the model of ``role`` (replacing an earlier one) from the registry group of
        ``kind`` (``policy`` or ``critic``); returns version, shape (policies only), this
        rank's data-parallel index (``layout.dp_rank`` of a parallel model, else 0) and
        whether it ``shares_prefixes`` (policies only)."""

        def run() -> tuple[int, ModelShape | None, int, bool]:
            self.models.pop(role, None)
            model = registry.build(kind, spec, field=kind)
            self.models[role] = model
            layout = getattr(model, "layout", None)
            shape = model.model_shape if kind == "policy" else None
            shares = kind == "policy" and bool(getattr(model, "shares_prefixes", False))
            return model.version, shape, int(getattr(layout, "dp_rank", 0)), shares

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

    def compute_base_logprobs(self, batch: TrainBatch, role: str) -> LogProbOutput:
        """``Policy.compute_base_logprobs`` of ``role`` (LoRA: the base with adapters off)."""
        model = self.models[role]
        return self._on_model_thread(lambda: model.compute_base_logprobs(batch))

    def named_adapter_weights(self, role: str) -> list[tuple[str, torch.Tensor]]:
        """``Policy.named_adapter_weights`` of ``role`` as CPU copies (small: LoRA only)."""
        model = self.models[role]
        return self._on_model_thread(
            lambda: [(n, t.detach().to("cpu", copy=True)) for n, t in model.named_adapter_weights()]
        )

    def lora(self, role: str) -> Any:
        """``Policy.lora`` of ``role``."""
        return self.models[role].lora

    def save_merged(self, role: str, directory: str) -> None:
        """``save_merged`` of ``role`` (a LoRA policy's merged Hugging Face model)."""
        model = self.models[role]
        self._on_model_thread(lambda: model.save_merged(directory))

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

    def offload(self, role: str) -> None:
        """``offload()`` of ``role`` (a no-op for a backend without ``supports_offload``)."""
        model = self.models[role]
        self._on_model_thread(model.offload)

    def onload(self, role: str) -> None:
        """``onload()`` of ``role``."""
        model = self.models[role]
        self._on_model_thread(model.onload)

    def memory_sample(self, role: str) -> dict[str, int]:
        """This rank's memory (:func:`rl_trainer.step.memory.memory_sample` of ``role``'s model)."""
        from rl_trainer.step.memory import memory_sample

        model = self.models[role]
        return memory_sample([model] if hasattr(model, "resident_storages") else [])

    def weights(self, role: str) -> list[tuple[str, torch.Tensor]]:
        """Full weights of ``role`` (every rank iterates; rank 0 returns them)."""
        model = self.models[role]
        out = self._on_model_thread(
            lambda: [(n, t.detach().to("cpu", copy=True)) for n, t in model.named_weights()]
        )
        return out if self.rank == 0 else []

    def build_sender(self, spec: ComponentSpec | None) -> None:
        """Build (rank 0) or drop the sender side of the weight transport."""
        with self._sender_lock:
            if self.sender is not None:
                self.sender.close()
                self.sender = None
            if spec is not None and self.rank == 0:
                self.sender = registry.build("weight_transport", spec, field="weight_transport")

    def reform_sender(self, spec: ComponentSpec) -> WeightUpdate | None:
        """Rank 0 of a new generation of the collective (``broadcast``) group: build its sender,
        which takes over the previous one and posts its newest published version again for the
        members to re-sync (:meth:`~rl_weightsync.BroadcastTransport.take_over`); returns that
        update, or ``None`` when nothing was published yet."""
        with self._sender_lock:
            new = registry.build("weight_transport", spec, field="weight_transport")
            old, self.sender = self.sender, new
            if old is None:
                return None
            take_over = getattr(new, "take_over", None)
            if take_over is None:
                old.close()
                raise RLError(
                    f"weight_transport.type: {spec.type!r} cannot re-form a collective group; "
                    "use weight_transport: {type: broadcast}."
                )
            return take_over(old)

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
        or the copy kept by :meth:`keep_copy` (runs concurrently with a ``train_step``).

        Every rank iterates the live ``named_weights`` (a model-parallel policy such as Megatron
        TP/PP gathers each weight in that collective), and only rank 0 hands them to the
        transport: each weight is gathered once and sent once, from rank 0 (with ``broadcast``,
        one broadcast per bucket to every engine)."""
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
        with self._sender_lock:
            if self.sender is None:
                raise RLError("policy rank 0 has no weight transport; build_sender was not called.")
            return self.sender.publish(version, weights)

    def close(self) -> None:
        """Close the sender and drop the models."""
        self.build_sender(None)
        self.models.clear()
        self.copies.clear()
        self._model_thread.shutdown(wait=False)


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
        colocation: Colocation,
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

    def offload(self) -> None:
        """Every rank offloads (colocated hand-over, :mod:`rl_trainer.step.offload`)."""
        self._call("offload", self.role)

    def onload(self) -> None:
        """Every rank onloads."""
        self._call("onload", self.role)

    def memory_sample(self) -> dict[str, int]:
        """Rank 0's memory: ``bytes`` (CUDA allocated or resident tensor bytes), ``rss_bytes``."""
        import ray

        return ray.get(self.ranks[0].memory_sample.remote(self.role), timeout=self._timeout)

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

    _shares_prefixes = False  # what the ranks' policy reports (set by the runtime)

    @property
    def model_shape(self) -> ModelShape:
        """Architecture numbers (from rank 0)."""
        assert self._shape is not None
        return self._shape

    @property
    def shares_prefixes(self) -> bool:
        """Whether the ranks' policy computes shared prompts once (from rank 0)."""
        return self._shares_prefixes

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs on every rank; rank 0's result, or with data-parallel shards each
        replica's shard, concatenated in shard order."""
        outs = self._sharded("compute_logprobs", batch, with_entropy, train=False)
        if len(outs) == 1:
            return outs[0]
        ent = [o.entropy for o in outs]
        routed = [o.routed_experts for o in outs]
        return LogProbOutput(
            logprobs=torch.cat([o.logprobs for o in outs]),
            entropy=torch.cat(ent) if with_entropy and all(e is not None for e in ent) else None,
            routed_experts=torch.cat(routed) if all(r is not None for r in routed) else None,
        )

    def compute_base_logprobs(self, batch: TrainBatch) -> LogProbOutput:
        """Base-model log-probs (LoRA adapters disabled) on every rank; rank 0's result, or
        each replica's shard concatenated in shard order."""
        outs = self._sharded("compute_base_logprobs", batch, train=False)
        if len(outs) == 1:
            return outs[0]
        return LogProbOutput(logprobs=torch.cat([o.logprobs for o in outs]))

    @property
    def lora(self) -> Any:
        """The ranks' ``Policy.lora`` (rank 0's)."""
        if not hasattr(self, "_lora"):
            self._lora = self._call("lora", self.role)[0]
        return self._lora

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter tensors (peft names) as CPU copies from rank 0 (every rank is called)."""
        return iter(self._call("named_adapter_weights", self.role)[0])

    def save_merged(self, directory: str | Path) -> None:
        """Every rank writes the merged model (rank 0 the files); a shared filesystem."""
        self._call("save_merged", self.role, str(directory))

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
