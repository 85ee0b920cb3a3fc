"""The seams of the framework.

ABCs for stateful components (:class:`Policy`, :class:`Generator`, :class:`Buffer`,
:class:`DataSource`, :class:`WeightTransport`); ``typing.Protocol`` for function seams
(:class:`RewardFn`, :class:`GenerateFn`, :class:`GroupFilter`, :class:`AdvantageFn`,
:class:`LossFn`), so a plain function satisfies them.

Each component class has a nested ``Config`` dataclass and is built from it::

    policy = HFPolicy(HFPolicy.Config(model_path="runs/tiny", lr=1e-4))

The trainer wires them::

    prompts = data.next_prompts(8)
    groups = [await generate_fn(p, ctx) for p in prompts]    # GenerateFn over a Generator
    buffer.put(groups); groups = buffer.take(8)
    metrics = policy.train_step(batch, loss_fn)                # LossFn
    update = transport.publish(policy.version, policy.named_weights())
    await generator.update_weights(update, transport)
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import AsyncIterator, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from rl_core.errors import ConfigError
from rl_core.types import (
    AdvantageInputs,
    GenerationRequest,
    GenerationResult,
    Group,
    LogProbOutput,
    LossOutput,
    ModelShape,
    Prompt,
    Rollout,
    SamplingParams,
    TrainBatch,
    WeightUpdate,
)

if TYPE_CHECKING:
    from rl_core.lora import LoRAConfig

__all__ = [
    "AdvantageFn",
    "Buffer",
    "Critic",
    "DataSource",
    "GenerateFn",
    "GenerationChunk",
    "Generator",
    "GroupFilter",
    "GroupRewardFn",
    "LossFn",
    "Policy",
    "RewardFn",
    "RolloutContext",
    "Tokenizer",
    "ValueLossFn",
    "WeightTarget",
    "WeightTransport",
]


class Tokenizer(Protocol):
    """The part of a (Hugging Face) tokenizer the framework uses."""

    eos_token_id: int | None
    pad_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]:
        """Text to token ids."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str:
        """Token ids to text."""
        ...


# --------------------------------------------------------------------------------------------
# Stateful components (ABCs)
# --------------------------------------------------------------------------------------------


class Policy(abc.ABC):
    """The trained model: log-probs, optimizer steps, weights out in Hugging Face naming.

    Versions: a freshly built or loaded policy has ``version`` 0 (or the loaded one); every
    ``train_step`` adds 1. Generators tag tokens with the version of the weights that sampled them.

    Routing replay (mixture-of-experts models, :mod:`rl_core.routing`): when a batch carries
    ``routed_experts``, a policy with ``supports_routing_replay`` makes every MoE layer use exactly
    those experts in ``compute_logprobs`` and ``train_step``; a policy without it raises
    ``ConfigError`` naming ``rollout.routing_replay``.
    """

    supports_routing_replay: ClassVar[bool] = False
    """Replays ``TrainBatch.routed_experts`` and reports its own routing in
    ``LogProbOutput.routed_experts``."""

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Weight version: the number of optimizer steps applied since the initial weights."""

    @property
    @abc.abstractmethod
    def model_shape(self) -> ModelShape:
        """Architecture numbers for FLOPs estimation."""

    @abc.abstractmethod
    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` (and entropy ``[T]``) of ``batch.tokens`` without gradients."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over all micro-batches of ``batch`` (gradient accumulation).

        Returns step metrics: at least ``loss`` and ``grad_norm`` (before clipping), plus the sums of
        the loss function's metrics over micro-batches.
        """

    @abc.abstractmethod
    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) tensors in Hugging Face names, as the generator serves them."""

    @abc.abstractmethod
    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Write weights (Hugging Face format) and, optionally, optimizer state."""

    @abc.abstractmethod
    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote, version included."""

    def offload(self) -> None:  # noqa: B027 - optional capability
        """Move weights and optimizer state off the accelerator (colocation); default no-op."""

    def onload(self) -> None:  # noqa: B027 - optional capability
        """Undo :meth:`offload`; default no-op."""

    @property
    def shares_prefixes(self) -> bool:
        """Whether the policy computes the prompt that sequences of one micro-batch share once
        (``HFPolicy.Config.share_prefix``); the trainer then packs a group's samples into the
        same micro-batch (``rl_buffer.schedule_step``'s ``prefix_groups``). Default ``False``."""
        return False

    # LoRA (rl_core.lora): a policy built with ``lora`` trains adapters only, the base frozen.
    @property
    def lora(self) -> LoRAConfig | None:
        """The adapter settings this policy trains with, or ``None`` (full fine-tuning).

        With LoRA, :meth:`named_weights` still yields the *merged* full weights (what a generator
        without adapter support loads), :meth:`named_adapter_weights` the adapter alone."""
        return None

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full (unsharded) adapter tensors in peft naming (:func:`rl_core.lora.peft_name`).

        Raises:
            ConfigError: the policy has no LoRA adapter (``policy.lora`` is not set).
        """
        raise ConfigError(
            f"{type(self).__name__} has no LoRA adapter: set policy.lora (e.g. {{rank: 8}}) to "
            "train and publish adapters."
        )

    def save_merged(self, directory: str | Path) -> None:
        """Write the model with its adapter folded in (``W + scaling * B @ A``) as a Hugging Face
        directory a policy or generator without LoRA loads; without ``lora``:
        ``save(directory, with_optimizer=False)``.

        Raises:
            ConfigError: the policy has an adapter but cannot merge it.
        """
        if self.lora is None:
            self.save(directory, with_optimizer=False)
            return
        raise ConfigError(
            f"{type(self).__name__} cannot write its LoRA adapter merged into the base; export "
            "the adapter (save) and merge with peft's merge_and_unload."
        )

    def compute_base_logprobs(self, batch: TrainBatch) -> LogProbOutput:
        """Log-probs ``[T]`` of the frozen base model (adapters disabled): the reference of the
        KL term, with no second copy of the base in memory.

        Raises:
            ConfigError: the policy has no LoRA adapter.
        """
        raise ConfigError(
            f"{type(self).__name__} has no LoRA adapter to disable: the base-model log-probs "
            "need policy.lora; without it build a separate reference model."
        )


class Critic(abc.ABC):
    """A value model for PPO with a critic: per-token values and optimizer steps on a value loss.

    ``compute_values`` follows the log-prob alignment of :class:`TrainBatch`: ``values[t]``
    estimates the return from ``tokens[t]`` on, given ``tokens[<t]`` of the same sequence (so it
    is read off the hidden state of ``tokens[t-1]``); the first token of every sequence gets 0.
    Versions count optimizer steps, like :attr:`Policy.version`.
    """

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The number of optimizer steps applied since the initial weights."""

    @abc.abstractmethod
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """Values ``[T]`` (float32) of ``batch`` without gradients."""

    @abc.abstractmethod
    def train_step(self, batch: TrainBatch, loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimizer step over all micro-batches of ``batch`` on ``loss_fn``.

        Returns at least ``loss`` and ``grad_norm`` plus the sums of the loss function's
        metrics over micro-batches.
        """

    @abc.abstractmethod
    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Write weights (with the value head) and, optionally, optimizer state."""

    @abc.abstractmethod
    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore what :meth:`save` wrote, version included."""


class WeightTarget(Protocol):
    """Something that can take new weights in place: a generator, or a policy used as reference."""

    @property
    def weight_version(self) -> int:
        """Version of the weights currently loaded."""
        ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Replace the weights named (Hugging Face names) and set the version."""
        ...


@dataclass(frozen=True, slots=True)
class GenerationChunk:
    """One piece of a streamed generation (:meth:`Generator.generate_stream`): the tokens
    sampled since the previous chunk and their log-probs; the last chunk also carries the
    whole :class:`~rl_core.types.GenerationResult`. The chunks' ``output_ids`` concatenated are
    the result's ``output_ids`` (the same for the log-probs)."""

    output_ids: tuple[int, ...]
    """Token ids sampled since the previous chunk (may be empty on the last chunk)."""
    output_logprobs: tuple[float, ...]
    """Their log-probs, one per id."""
    result: GenerationResult | None = None
    """The finished result, on the last chunk only."""


class Generator(abc.ABC):
    """A rollout engine: token ids in, sampled token ids and log-probs out.

    Capabilities are class attributes so conformance suites and the trainer can ask for them.
    """

    supports_abort: ClassVar[bool] = False
    """``abort()`` ends in-flight requests early, returning their partial tokens."""
    supports_pause: ClassVar[bool] = False
    """``pause()``/``resume()`` hold new work without dropping what is in flight."""
    supports_memory_release: ClassVar[bool] = False
    """``release_memory()``/``resume_memory()`` free device memory for a colocated trainer."""
    supports_routing: ClassVar[bool] = False
    """Honours ``GenerationRequest.return_routing``: returns the experts a mixture-of-experts
    model chose for every token in ``GenerationResult.routed_experts``."""
    supports_lora_adapters: ClassVar[bool] = False
    """``update_weights`` takes adapter-only updates (:func:`rl_core.lora.adapter_of` is not
    ``None``: peft-named LoRA tensors, loaded as the named adapter on the served base); without
    it a trainer publishes merged full weights instead."""
    truncated_logprobs: ClassVar[bool] = False
    """``output_logprobs`` are under the distribution actually sampled from: the
    temperature-scaled softmax renormalised over the top-k / top-p candidate set
    (:func:`rl_core.logprobs.truncate_logits`). ``False``: under the temperature-scaled softmax
    before truncation (what SGLang returns). The two agree when a request does not truncate."""

    @property
    @abc.abstractmethod
    def weight_version(self) -> int:
        """Version of the weights currently served."""

    @abc.abstractmethod
    async def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Serve the requests; results come back in request order."""

    @abc.abstractmethod
    async def update_weights(self, update: WeightUpdate, transport: WeightTransport) -> None:
        """Take the weights of ``update`` through ``transport``; on failure stay on the old ones."""

    streams_tokens: ClassVar[bool] = False
    """:meth:`generate_stream` yields tokens as they are sampled; ``False``: it yields the whole
    result once it is generated (the default implementation)."""

    async def generate_stream(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """Serve one request, yielding :class:`GenerationChunk` pieces as tokens are sampled;
        the last chunk carries the :class:`~rl_core.types.GenerationResult`, the same result
        :meth:`generate` returns for the request (same tokens and log-probs for a seeded
        request). The default generates the whole result, then yields it as one chunk; engines
        that stream set :attr:`streams_tokens`. Closing the iterator early does not abort the
        request (call :meth:`abort`)."""
        (result,) = await self.generate([request])
        yield GenerationChunk(result.output_ids, result.output_logprobs, result)

    async def health(self) -> bool:
        """True when the engine can serve requests."""
        return True

    async def abort(self, request_ids: Sequence[str] | None = None) -> None:
        """Abort the given (or all) in-flight requests; they return with ``FinishReason.ABORT``."""
        raise NotImplementedError(f"{type(self).__name__} does not support abort")

    async def pause(self) -> None:
        """Stop starting new work until :meth:`resume`."""
        raise NotImplementedError(f"{type(self).__name__} does not support pause")

    async def resume(self) -> None:
        """Undo :meth:`pause`."""
        raise NotImplementedError(f"{type(self).__name__} does not support pause")

    async def release_memory(self) -> None:
        """Free device memory (weights, KV cache) for a colocated trainer."""
        raise NotImplementedError(f"{type(self).__name__} does not support memory release")

    async def resume_memory(self) -> None:
        """Undo :meth:`release_memory`."""
        raise NotImplementedError(f"{type(self).__name__} does not support memory release")

    async def close(self) -> None:  # noqa: B027 - optional
        """Release processes, connections and threads; default no-op."""


class Buffer(abc.ABC):
    """Holds scored groups between generation and training."""

    @abc.abstractmethod
    def put(self, groups: Sequence[Group]) -> None:
        """Add groups."""

    @abc.abstractmethod
    def take(self, n: int, *, min_version: int | None = None) -> list[Group] | None:
        """Remove and return ``n`` groups, or ``None`` (and remove nothing) when fewer than ``n``
        groups are available. Groups with tokens older than ``min_version`` are never returned."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of groups available."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to restore the buffer exactly (JSON- or torch-serialisable)."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


class DataSource(abc.ABC):
    """Yields prompts in a reproducible order with a resumable cursor."""

    @abc.abstractmethod
    def next_prompts(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (crossing epochs as needed)."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Prompts per epoch."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The cursor (epoch, position, RNG) as plain data."""

    @abc.abstractmethod
    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the cursor so the next prompts equal those of an uninterrupted run."""


class WeightTransport(abc.ABC):
    """Moves trained weights to receivers, one explicit version at a time.

    Sender side: :meth:`publish`. Receiver side: :meth:`receive` yields verified tensors;
    :meth:`apply` loads them into a :class:`WeightTarget`. A receiver refuses a corrupt,
    truncated or out-of-order update with :class:`~rl_core.errors.WeightSyncError` and keeps its
    previous version.
    """

    name: ClassVar[str] = ""
    """Registry name, copied into every :class:`WeightUpdate` it makes."""

    @abc.abstractmethod
    def publish(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        metadata: Mapping[str, Any] | None = None,
    ) -> WeightUpdate:
        """Publish the full weights of ``version`` (or, with the :data:`rl_core.lora.ADAPTER_KEY`
        marker in ``metadata``, a LoRA adapter's tensors); returns the handle receivers get,
        ``metadata`` included in its ``metadata``."""

    @abc.abstractmethod
    def receive(
        self, update: WeightUpdate, *, current_version: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Verified tensors of ``update`` for a receiver now on ``current_version``.

        Raises :class:`~rl_core.errors.WeightSyncError` before yielding anything if the update is
        not applicable (wrong base, replayed or skipped version, corrupt payload).
        """

    def apply(self, update: WeightUpdate, target: WeightTarget) -> None:
        """Load ``update`` into ``target``; default: materialise all tensors, then load them.

        Tensors are fully received and verified before the target is touched, so a failure
        leaves the target on its previous version.
        """
        tensors = list(self.receive(update, current_version=target.weight_version))
        target.load_weights(tensors, version=update.version)

    def close(self) -> None:  # noqa: B027 - optional
        """Release channels and files; default no-op."""


# --------------------------------------------------------------------------------------------
# Function seams (Protocols)
# --------------------------------------------------------------------------------------------


@runtime_checkable
class RewardFn(Protocol):
    """Scores one rollout: a float, or a mapping of named components (one is the reward key).

    May be ``async``. Raising, or returning NaN/inf, marks the rollout failed (counted).
    """

    def __call__(self, prompt: Prompt, response: str, rollout: Rollout) -> Any:
        """Return ``float | Mapping[str, float]`` (or an awaitable of it)."""
        ...


@runtime_checkable
class GroupRewardFn(Protocol):
    """Scores all rollouts of a group at once (pairwise or ranking rewards). May be ``async``."""

    def __call__(
        self, prompt: Prompt, responses: Sequence[str], rollouts: Sequence[Rollout]
    ) -> Any:
        """Return one ``float | Mapping[str, float]`` per rollout (or an awaitable of the list)."""
        ...


@dataclass(slots=True, kw_only=True)
class RolloutContext:
    """What a :class:`GenerateFn` gets besides the prompt."""

    generator: Generator
    """The engine to sample from."""
    tokenizer: Tokenizer
    """The policy's tokenizer (for tool/observation text; never re-encode sampled tokens)."""
    sampling: SamplingParams
    """Default sampling settings for this run and phase (train or eval). Its ``seed`` is the
    prompt's: :meth:`generate` turns it into one seed per ``request_id``, so the samples of a
    group differ even when every call passes ``ctx.sampling`` (or a copy of it)."""
    n_samples: int
    """Rollouts wanted for the prompt (GRPO group size)."""
    policy_version: int
    """Version of the policy the generator should be serving."""
    return_routing: bool = False
    """Ask the engine for the experts it routed every token to (``rollout.routing_replay``);
    :meth:`generate` sets it on its requests. Keep ``GenerationResult.routed_experts`` in the
    rollout (``TrajectoryBuilder`` does)."""
    adapter: str | None = None
    """Multi-LoRA: the LoRA adapter of this prompt (``GenerationRequest.adapter``, set by the
    trainer from the prompt); :meth:`generate` sets it on its requests. ``None``: the
    generator's default."""

    async def generate(
        self, input_ids: Sequence[int], sampling: SamplingParams | None = None, *, request_id: str
    ) -> GenerationResult:
        """Sample one continuation of ``input_ids`` (with the routing when
        :attr:`return_routing`).

        When ``sampling`` carries the prompt's seed (``ctx.sampling``, or a copy with other
        fields changed, e.g. ``TrajectoryBuilder.clamp``), the request samples with a seed of
        its own derived from it and ``request_id`` (:func:`request_seed`): distinct request ids
        (one per sample and turn) sample differently, reproducibly. A ``sampling`` with another
        seed (or ``None``) is used as given."""
        params = sampling or self.sampling
        if params.seed is not None and params.seed == self.sampling.seed:
            params = replace(params, seed=request_seed(params.seed, request_id))
        req = GenerationRequest(
            request_id=request_id,
            input_ids=tuple(input_ids),
            sampling=params,
            return_routing=self.return_routing,
            adapter=self.adapter,
        )
        (result,) = await self.generator.generate([req])
        return result


def request_seed(seed: int, request_id: str) -> int:
    """A stable 31-bit sampling seed for request ``request_id`` of a prompt seeded ``seed``
    (what :meth:`RolloutContext.generate` uses)."""
    h = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFFFFFF


@runtime_checkable
class GenerateFn(Protocol):
    """A rollout workflow: single-turn sampling, multi-turn tool use, fan-out, agents.

    Returns the rollouts for one prompt (``ctx.n_samples`` of them for a plain GRPO group; fan-out
    siblings share a ``rollout_id``).
    """

    async def __call__(self, prompt: Prompt, ctx: RolloutContext) -> list[Rollout]:
        """Generate the rollouts of ``prompt``."""
        ...


@runtime_checkable
class GroupFilter(Protocol):
    """Dynamic sampling: decide whether a scored group is kept for training."""

    def __call__(self, group: Group) -> str | None:
        """``None`` to keep the group, or a short drop reason (counted as a metric)."""
        ...


@runtime_checkable
class AdvantageFn(Protocol):
    """Turn rewards (and optionally KL, values) into per-token advantages."""

    def __call__(self, inputs: AdvantageInputs) -> list[torch.Tensor]:
        """N tensors ``[R_i]``: the advantage of each response token (0 off the mask)."""
        ...


@runtime_checkable
class LossFn(Protocol):
    """The training objective for one micro-batch.

    Optional attributes a policy and the trainer read with ``getattr``:
    ``requires_entropy`` (the policy passes the entropy ``[T]``, else ``None``) and
    ``requires_ref_logprobs`` (the trainer fills ``TrainBatch.ref_logprobs``).
    """

    def __call__(
        self, logprobs: torch.Tensor, batch: TrainBatch, entropy: torch.Tensor | None
    ) -> LossOutput:
        """``logprobs`` ``[T]`` carries gradients; return the weighted loss and metrics."""
        ...


@runtime_checkable
class ValueLossFn(Protocol):
    """The critic's objective for one micro-batch (see :class:`Critic`)."""

    def __call__(self, values: torch.Tensor, batch: TrainBatch) -> LossOutput:
        """``values`` ``[T]`` carries gradients; return the weighted loss and metrics."""
        ...
