"""Value types that cross package boundaries.

Shapes are written in brackets: ``[R]`` is one entry per response token of a rollout, ``[T]`` one
per token of a packed batch, ``[N]`` one per sequence of a packed batch.

Token-in/token-out is a rule: the token ids a :class:`Rollout` carries are exactly those the
engine sampled (or the tool/observation tokens appended to them); no stage decodes and
re-encodes them.

Example: a two-turn tool rollout, prompt of 5 tokens, 3 model tokens, 2 tool tokens, 2 model
tokens::

    Rollout(
        tokens=(p0, p1, p2, p3, p4, m0, m1, m2, o0, o1, m3, m4),
        response_start=5,
        loss_mask=(1, 1, 1, 0, 0, 1, 1),         # [R]: model tokens 1, tool tokens 0
        rollout_logprobs=(-.1, -.3, -.2, 0, 0, -.5, -.1),
        versions=(7, 7, 7, 7, 7, 8, 8),          # resumed on version 8 after an abort
        ...)
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "AdvantageInputs",
    "FinishReason",
    "GenerationRequest",
    "GenerationResult",
    "Group",
    "LogProbOutput",
    "LossOutput",
    "ModelShape",
    "Prompt",
    "Rollout",
    "RolloutStatus",
    "SamplingParams",
    "TrainBatch",
    "WeightUpdate",
]


class RolloutStatus(enum.StrEnum):
    """How a rollout ended."""

    COMPLETED = "completed"
    """The model emitted a stop token."""
    TRUNCATED = "truncated"
    """The response hit the token limit."""
    ABORTED = "aborted"
    """Generation was aborted (e.g. at a weight update); the rollout may be resumed."""
    FAILED = "failed"
    """Generation or reward failed; the rollout is not trained on."""

    def is_trainable(self) -> bool:
        """True for statuses whose tokens may be trained on (completed or truncated)."""
        return self in (RolloutStatus.COMPLETED, RolloutStatus.TRUNCATED)


class FinishReason(enum.StrEnum):
    """Why an engine stopped generating one response."""

    STOP = "stop"
    """A stop token (or EOS) was sampled; it is included in the output."""
    LENGTH = "length"
    """``max_new_tokens`` was reached."""
    ABORT = "abort"
    """The request was aborted; the output holds the tokens sampled so far."""
    ERROR = "error"
    """The engine could not serve the request (it kept failing after retries); the rollout is
    failed, not trained on, and counted."""

    def to_status(self) -> RolloutStatus:
        """The rollout status that corresponds to this finish reason."""
        return {
            FinishReason.STOP: RolloutStatus.COMPLETED,
            FinishReason.LENGTH: RolloutStatus.TRUNCATED,
            FinishReason.ABORT: RolloutStatus.ABORTED,
            FinishReason.ERROR: RolloutStatus.FAILED,
        }[self]


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling settings of one generation request; engines map them 1:1."""

    temperature: float = 1.0
    """Softmax temperature; 0 means greedy."""
    top_p: float = 1.0
    """Nucleus mass in (0, 1]; 1 disables it."""
    top_k: int = 0
    """Keep the k most likely tokens; 0 (or negative) disables it."""
    max_new_tokens: int = 64
    """Upper bound on sampled tokens per response."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response (in addition to the tokenizer's EOS, if the engine adds it)."""
    seed: int | None = None
    """Per-request sampling seed, for reproducible sampling where the engine supports it."""

    def __post_init__(self) -> None:
        from rl_core.errors import ConfigError

        if self.temperature < 0:
            raise ConfigError(f"sampling.temperature: must be >= 0, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p}.")
        if self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens: must be >= 1, got {self.max_new_tokens}.")


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationRequest:
    """One token-in request to a :class:`~rl_core.interfaces.Generator`."""

    request_id: str
    """Caller-chosen id, unique among requests in flight; used by ``abort``."""
    input_ids: tuple[int, ...]
    """Prompt (or trajectory so far) as token ids ``[P]``."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """Sampling settings."""
    return_routing: bool = False
    """Ask the engine for the experts a mixture-of-experts model chose for every token
    (:attr:`GenerationResult.routed_experts`); an engine that cannot record them raises
    ``GenerationError`` naming ``rollout.routing_replay``."""
    adapter: str | None = None
    """Multi-LoRA: the name of the loaded LoRA adapter to sample with (an engine without it
    raises ``GenerationError``); ``None``: the generator's default (the adapter it serves
    when none is named, or the base model)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class GenerationResult:
    """The token-out answer to one :class:`GenerationRequest`."""

    request_id: str
    """The id of the request this answers."""
    output_ids: tuple[int, ...]
    """Sampled token ids ``[R]``, stop token included when one was sampled."""
    output_logprobs: tuple[float, ...]
    """Log-probability ``[R]`` of each sampled token under the engine's (tempered) distribution."""
    finish_reason: FinishReason
    """Why generation ended."""
    weight_version: int
    """Version of the weights that sampled these tokens."""
    routed_experts: torch.Tensor | None = None
    """``[P + R, L, K]`` integer expert ids (:mod:`rl_core.routing`) for the input tokens and the
    output tokens, when the request asked for them (``return_routing``); else ``None``."""

    def __post_init__(self) -> None:
        if len(self.output_ids) != len(self.output_logprobs):
            raise ValueError(
                f"GenerationResult {self.request_id}: {len(self.output_ids)} token ids but "
                f"{len(self.output_logprobs)} log-probs; an engine must return one log-prob per token."
            )


@dataclass(slots=True, kw_only=True)
class Prompt:
    """One prompt drawn from a data source."""

    uid: str
    """Unique id of this draw (source, epoch and index); the id of the group sampled from it."""
    input: str | list[dict[str, Any]]
    """The raw input: plain text or chat messages (``[{"role": ..., "content": ...}]``)."""
    token_ids: tuple[int, ...]
    """The prompt as token ids ``[P]``, after the chat template (if any)."""
    label: Any = None
    """Reference answer for verifiable rewards, or ``None``."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form data carried to the reward function (source name, tools, ...)."""


@dataclass(slots=True, kw_only=True)
class Rollout:
    """One sampled trajectory: prompt tokens followed by response tokens."""

    prompt_uid: str
    """``Prompt.uid`` of the prompt it answers (also the group id)."""
    rollout_id: str
    """Id shared by fan-out siblings (sub-agents, branches) of one trajectory; counted once in
    per-rollout loss aggregation. Equal to ``sample_id`` when there is no fan-out."""
    sample_id: str
    """Unique id of this sequence."""
    tokens: tuple[int, ...]
    """Prompt and response token ids ``[P + R]``."""
    response_start: int
    """Index in ``tokens`` of the first response token (``P``)."""
    loss_mask: tuple[int, ...]
    """``[R]``: 1 for tokens the model sampled and is trained on, 0 for tool/observation tokens."""
    rollout_logprobs: tuple[float, ...]
    """``[R]``: log-probs the sampling engine returned (0 for tokens it did not sample)."""
    versions: tuple[int, ...]
    """``[R]``: policy version that produced each response token."""
    status: RolloutStatus = RolloutStatus.COMPLETED
    """How generation ended."""
    reward: float | None = None
    """Scalar reward used for advantages; ``None`` until scored."""
    reward_info: dict[str, float] = field(default_factory=dict)
    """All components returned by the reward function (the scalar is one of them)."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form data (failure reason, tool calls, ...)."""
    routed_experts: torch.Tensor | None = None
    """``[len(tokens), L, K]`` expert ids the engine chose for every token (prompt included) of
    a mixture-of-experts model, for routing replay (:mod:`rl_core.routing`); ``None`` when not
    recorded."""

    def __post_init__(self) -> None:
        if self.routed_experts is not None:
            from rl_core.routing import validate_routing

            validate_routing(
                self.routed_experts, num_tokens=len(self.tokens), where=f"Rollout {self.sample_id}"
            )
        r = len(self.tokens) - self.response_start
        if r < 0:
            raise ValueError(f"Rollout {self.sample_id}: response_start beyond the tokens.")
        for name in ("loss_mask", "rollout_logprobs", "versions"):
            n = len(getattr(self, name))
            if n != r:
                raise ValueError(
                    f"Rollout {self.sample_id}: {name} has {n} entries but the response has {r} "
                    "tokens; every per-token field must be aligned with the response."
                )

    @property
    def response_ids(self) -> tuple[int, ...]:
        """Response token ids ``[R]``."""
        return self.tokens[self.response_start :]

    @property
    def response_length(self) -> int:
        """Number of response tokens ``R``."""
        return len(self.tokens) - self.response_start

    @property
    def min_version(self) -> int | None:
        """Oldest policy version among the response tokens (``None`` for an empty response)."""
        return min(self.versions) if self.versions else None


@dataclass(slots=True, kw_only=True)
class Group:
    """The rollouts sampled for one prompt (a GRPO group). May be uneven after filtering or
    fan-out: consumers normalise per actual group, never by reshaping."""

    prompt: Prompt
    """The prompt every rollout answers."""
    rollouts: list[Rollout]
    """The rollouts, in sampling order."""

    @property
    def uid(self) -> str:
        """The group id (the prompt's uid)."""
        return self.prompt.uid

    def rewards(self) -> list[float]:
        """Rewards of the rollouts; raises if any is unscored."""
        out = []
        for r in self.rollouts:
            if r.reward is None or not math.isfinite(r.reward):
                raise ValueError(f"Rollout {r.sample_id} has no finite reward ({r.reward!r}).")
            out.append(float(r.reward))
        return out

    @property
    def min_version(self) -> int | None:
        """Oldest policy version of any token in the group."""
        vs = [v for r in self.rollouts if (v := r.min_version) is not None]
        return min(vs) if vs else None


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """Architecture numbers a FLOPs estimator needs; filled by a policy from its model config."""

    num_layers: int
    """Transformer layers."""
    hidden_size: int
    """Model width."""
    num_attention_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than the query heads)."""
    head_dim: int
    """Width of one head."""
    ffn_hidden_size: int
    """Width of the (per-expert) MLP; SwiGLU has three matrices of this width."""
    vocab_size: int
    """Vocabulary size of the LM head."""
    num_experts: int = 0
    """Routed experts per MoE layer; 0 for a dense model."""
    moe_top_k: int = 0
    """Experts each token is routed to."""
    num_shared_experts: int = 0
    """Always-active shared experts per MoE layer."""
    moe_ffn_hidden_size: int | None = None
    """MLP width of one expert, when it differs from ``ffn_hidden_size``."""
    tied_embeddings: bool = False
    """Whether the LM head shares the embedding matrix (same FLOPs, fewer parameters)."""


@dataclass(slots=True, kw_only=True)
class TrainBatch:
    """Packed, padding-free tensors for one data-parallel rank.

    Sequences are concatenated; ``cu_seqlens`` marks their bounds. Position ``t`` of every per-token
    tensor refers to ``tokens[t]``: ``old_logprobs[t]`` is ``log p(tokens[t] | tokens[<t] of the same
    sequence)``. The first token of every sequence has no log-prob (0) and ``loss_mask`` 0.

    ``loss_weights`` folds the loss aggregation in: the step loss is ``sum_t x_t * loss_weights[t]``
    summed over all micro-batches and data-parallel ranks, whatever the aggregation (per token,
    per sequence, per rollout with fan-out siblings counted once, or a constant divisor).
    """

    tokens: torch.Tensor
    """``[T]`` int64 token ids."""
    cu_seqlens: torch.Tensor
    """``[N+1]`` int64 cumulative sequence lengths, starting at 0 and ending at ``T``."""
    loss_mask: torch.Tensor
    """``[T]`` float32: 1 on tokens trained on."""
    loss_weights: torch.Tensor
    """``[T]`` float32: per-token weight of the aggregated loss (0 off the mask)."""
    advantages: torch.Tensor
    """``[T]`` float32 advantages (0 off the mask)."""
    old_logprobs: torch.Tensor | None = None
    """``[T]`` float32 log-probs of the policy before this step's updates (``None``: on-policy,
    use the detached current log-probs)."""
    ref_logprobs: torch.Tensor | None = None
    """``[T]`` float32 reference-model log-probs, for a KL loss."""
    rollout_logprobs: torch.Tensor | None = None
    """``[T]`` float32 log-probs returned by the sampling engine, for mismatch correction."""
    versions: torch.Tensor | None = None
    """``[T]`` int64 policy version of each token (-1 for prompt tokens)."""
    old_values: torch.Tensor | None = None
    """``[T]`` float32 critic values before this step's critic update (PPO with a critic):
    ``old_values[t]`` estimates the return from ``tokens[t]`` on, given ``tokens[<t]``."""
    returns: torch.Tensor | None = None
    """``[T]`` float32 critic targets (GAE returns; 0 off the mask)."""
    routed_experts: torch.Tensor | None = None
    """``[T, L, K]`` integer expert ids the engine chose for each token, for routing replay
    (:mod:`rl_core.routing`); ``None`` when not recorded or not replayed."""
    sample_ids: tuple[str, ...] = ()
    """``[N]`` ``Rollout.sample_id`` of each sequence."""
    adapters: tuple[str | None, ...] = ()
    """``[N]`` multi-LoRA: the adapter each sequence is scored and trained with (``None``: the
    policy's default); empty: the default for every sequence."""
    micro_batch_bounds: tuple[int, ...] = ()
    """Sequence-index bounds ``[0, k1, ..., N]`` of the micro-batches; empty means one."""
    dp_bounds: tuple[int, ...] = ()
    """Sequence-index bounds ``[0, n1, ..., N]`` of the data-parallel shards, in rank order
    (each also a micro-batch bound); empty means one shard. See :meth:`shard`."""

    def __post_init__(self) -> None:
        t = self.tokens.shape[0]
        if int(self.cu_seqlens[-1]) != t or int(self.cu_seqlens[0]) != 0:
            raise ValueError("TrainBatch: cu_seqlens must start at 0 and end at len(tokens).")
        if self.dp_bounds:
            n = self.num_sequences
            mb = set(self.micro_batch_bounds or (0, n))
            if self.dp_bounds[0] != 0 or self.dp_bounds[-1] != n or not mb >= set(self.dp_bounds):
                raise ValueError(
                    f"TrainBatch.dp_bounds {self.dp_bounds}: must run from 0 to {n} along "
                    "micro-batch bounds."
                )
        for name in (
            "loss_mask",
            "loss_weights",
            "advantages",
            "old_logprobs",
            "ref_logprobs",
            "rollout_logprobs",
            "versions",
            "old_values",
            "returns",
        ):
            v = getattr(self, name)
            if v is not None and v.shape != (t,):
                raise ValueError(f"TrainBatch.{name}: shape {tuple(v.shape)}, expected ({t},).")
        if self.routed_experts is not None:
            from rl_core.routing import validate_routing

            validate_routing(self.routed_experts, num_tokens=t, where="TrainBatch")
        if self.adapters and len(self.adapters) != self.num_sequences:
            raise ValueError(
                f"TrainBatch.adapters: {len(self.adapters)} names for {self.num_sequences} "
                "sequences; give one per sequence (or none)."
            )

    @property
    def num_sequences(self) -> int:
        """Number of packed sequences ``N``."""
        return self.cu_seqlens.shape[0] - 1

    @property
    def num_tokens(self) -> int:
        """Number of packed tokens ``T``."""
        return self.tokens.shape[0]

    def seq_index(self) -> torch.Tensor:
        """``[T]`` int64 index of the sequence each token belongs to."""
        lengths_N = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(
            torch.arange(self.num_sequences, device=self.cu_seqlens.device), lengths_N
        )

    def position_ids(self) -> torch.Tensor:
        """``[T]`` int64 position of each token inside its own sequence."""
        starts_T = self.cu_seqlens[:-1][self.seq_index()]
        return torch.arange(self.num_tokens, device=self.cu_seqlens.device) - starts_T

    def _sequences(self, a: int, b: int, micro_batch_bounds: tuple[int, ...] = ()) -> TrainBatch:
        """Sequences ``a..b`` as a self-contained batch (per-token tensors cut, offsets rebased)."""
        t0, t1 = int(self.cu_seqlens[a]), int(self.cu_seqlens[b])

        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[t0:t1]

        return TrainBatch(
            tokens=self.tokens[t0:t1],
            cu_seqlens=self.cu_seqlens[a : b + 1] - t0,
            loss_mask=self.loss_mask[t0:t1],
            loss_weights=self.loss_weights[t0:t1],
            advantages=self.advantages[t0:t1],
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            rollout_logprobs=cut(self.rollout_logprobs),
            versions=cut(self.versions),
            old_values=cut(self.old_values),
            returns=cut(self.returns),
            routed_experts=cut(self.routed_experts),
            sample_ids=self.sample_ids[a:b],
            adapters=self.adapters[a:b],
            micro_batch_bounds=micro_batch_bounds,
        )

    def micro_batches(self) -> list[TrainBatch]:
        """Split along ``micro_batch_bounds`` into self-contained batches (one if no plan)."""
        bounds = self.micro_batch_bounds or (0, self.num_sequences)
        return [self._sequences(a, b) for a, b in itertools.pairwise(bounds)]

    @property
    def num_shards(self) -> int:
        """Number of data-parallel shards (1 without ``dp_bounds``)."""
        return max(1, len(self.dp_bounds) - 1)

    def shard(self, index: int) -> TrainBatch:
        """The data-parallel shard ``index`` (sequences ``dp_bounds[index]..dp_bounds[index+1]``)
        with its own micro-batch bounds; the whole batch when there are no ``dp_bounds``.

        ``loss_weights`` are kept as they are: they were computed over the whole step, so the
        shards' losses sum to the step loss (data-parallel gradients are summed, not averaged).
        """
        if not self.dp_bounds:
            if index != 0:
                raise IndexError(f"TrainBatch.shard({index}): the batch has one shard.")
            return self
        a, b = self.dp_bounds[index], self.dp_bounds[index + 1]
        bounds = self.micro_batch_bounds or (0, self.num_sequences)
        inner = tuple(x - a for x in bounds if a <= x <= b)
        return self._sequences(a, b, inner if len(inner) > 1 else ())


@dataclass(frozen=True, slots=True, kw_only=True)
class LogProbOutput:
    """What :meth:`~rl_core.interfaces.Policy.compute_logprobs` returns."""

    logprobs: torch.Tensor
    """``[T]`` log-prob of each token given its prefix (0 at each sequence start)."""
    entropy: torch.Tensor | None = None
    """``[T]`` entropy of the predictive distribution that produced each token, when asked for."""
    routed_experts: torch.Tensor | None = None
    """``[T, L, K]`` the experts the policy's own router chose for each token (a mixture-of-experts
    policy with ``supports_routing_replay``; ``None`` otherwise). With replay this is still the
    router's own choice, so its difference from the batch's ``routed_experts`` is the routing
    mismatch that replay removed."""


@dataclass(slots=True, kw_only=True)
class LossOutput:
    """What a :class:`~rl_core.interfaces.LossFn` returns for one micro-batch."""

    loss: torch.Tensor
    """Scalar to back-propagate; already weighted by ``TrainBatch.loss_weights``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-micro-batch contributions to step metrics, each already weighted like the loss (so
    summing over micro-batches and ranks gives the step value)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AdvantageInputs:
    """Inputs of an :class:`~rl_core.interfaces.AdvantageFn`, over the N rollouts of one step."""

    rewards: torch.Tensor
    """``[N]`` float32 scalar rewards."""
    group_index: torch.Tensor
    """``[N]`` int64 group of each rollout (0..G-1); groups may have different sizes."""
    response_mask: list[torch.Tensor]
    """N tensors ``[R_i]`` float32: the loss mask of each rollout's response."""
    kl: list[torch.Tensor] | None = None
    """Optional N tensors ``[R_i]``: per-token KL to the reference (for KL-in-reward estimators)."""
    values: list[torch.Tensor] | None = None
    """Optional N tensors ``[R_i]``: critic values (for GAE)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightUpdate:
    """Handle to one published weight version, passed from sender to receivers."""

    version: int
    """The version these weights become."""
    base_version: int | None
    """For deltas: the version they apply to; ``None`` for a full update."""
    transport: str
    """Registry name of the transport that made it."""
    location: str = ""
    """Where the payload is (a directory, a channel name); transport-specific."""
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """Transport-specific details (manifest digest, bucket count, byte counts)."""


def as_float_tuple(xs: Sequence[float]) -> tuple[float, ...]:
    """Convert a sequence of numbers to a tuple of Python floats."""
    return tuple(float(x) for x in xs)
