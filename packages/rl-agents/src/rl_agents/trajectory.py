"""Multi-turn trajectories, token-in/token-out, for custom rollouts
(:class:`~rl_core.interfaces.GenerateFn`).

A :class:`TrajectoryBuilder` holds one token list that starts with the prompt's ids and grows by
turns:

- :meth:`~TrajectoryBuilder.append_model` appends the ids an engine sampled (from a
  :class:`~rl_core.types.GenerationResult`) with loss mask 1, the engine's log-probs and the
  weight version that sampled them. Model tokens are never decoded and re-encoded: the training
  targets are exactly the sampled ids, even when ``encode(decode(ids)) != ids`` (BPE merges,
  byte fallback, normalisation).
- :meth:`~TrajectoryBuilder.append_tokens` / :meth:`~TrajectoryBuilder.append_text` append
  tool or observation tokens (chat-template glue, tool results) with loss mask 0 and log-prob 0.
  Text is encoded once, when it is appended, with ``add_special_tokens=False``.

:attr:`~TrajectoryBuilder.input_ids` is what to send to the engine next, and
:meth:`~TrajectoryBuilder.to_rollout` turns the trajectory into a
:class:`~rl_core.types.Rollout` whose ``loss_mask``, ``rollout_logprobs`` and ``versions`` cover
the response (everything after the prompt) one entry per token. Every append and the final
conversion check that the four per-token lists stay aligned; a violation raises
:class:`~rl_core.errors.DataError` naming the turn and the fix.

Length budget: with ``Config.max_length`` set, :attr:`~TrajectoryBuilder.is_full` tells the loop
to stop, :meth:`~TrajectoryBuilder.clamp` shortens ``max_new_tokens`` to the tokens left, a model
turn appended to a trajectory that is already full is refused, and
:meth:`~TrajectoryBuilder.to_rollout` cuts an over-long trajectory to ``max_length`` tokens with
status ``truncated``.

Fan-out (sub-agents, branches, context compaction): :meth:`~TrajectoryBuilder.fork` copies a
trajectory to branch from it, and :func:`siblings` turns several builders into rollouts that
share one ``rollout_id`` (so per-rollout loss aggregation counts them once).

Worked example, a calculator tool (the model writes ``CALC: 12+7`` and the tool answers
``= 19``)::

    import re
    from rl_agents.trajectory import TrajectoryBuilder

    async def calculator_rollouts(prompt, ctx):
        rollouts = []
        for k in range(ctx.n_samples):
            traj = TrajectoryBuilder(prompt.token_ids,
                                     TrajectoryBuilder.Config(max_length=512))
            for turn in range(4):
                result = await ctx.generate(traj.input_ids, traj.clamp(ctx.sampling),
                                            request_id=f"{prompt.uid}/{k}/{turn}")
                traj.append_model(result)
                text = ctx.tokenizer.decode(result.output_ids)   # read it, never re-encode it
                m = re.search(r"CALC:\\s*(\\d+)\\s*([-+*])\\s*(\\d+)", text)
                if m is None or traj.is_full or result.finish_reason != "stop":
                    break
                a, op, b = int(m[1]), m[2], int(m[3])
                value = a + b if op == "+" else a - b if op == "-" else a * b
                traj.append_text(f"\\n= {value}\\n", ctx.tokenizer)   # observation, mask 0
            rollouts.append(traj.to_rollout(prompt.uid, f"{prompt.uid}/{k}"))
        return rollouts
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rl_agents.resumable import token_versions
from rl_core.config import PositiveInt
from rl_core.errors import ConfigError, DataError
from rl_core.interfaces import Tokenizer
from rl_core.routing import pad_routing
from rl_core.types import FinishReason, GenerationResult, Rollout, RolloutStatus, SamplingParams

__all__ = ["TrajectoryBuilder", "Turn", "TurnKind", "siblings"]


class TurnKind(enum.StrEnum):
    """Who produced the tokens of a turn."""

    MODEL = "model"
    """Sampled by the engine: loss mask 1, engine log-probs."""
    TOOL = "tool"
    """Appended by the rollout code (tool output, observation, template glue): mask 0."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Turn:
    """One appended span of a trajectory (for debugging and metadata)."""

    index: int
    """0-based turn number, counting model and tool turns."""
    kind: TurnKind
    """Model or tool tokens."""
    start: int
    """Index in the full token list (prompt included) of the turn's first token."""
    end: int
    """Index one past the turn's last token."""
    version: int
    """Policy version recorded for the turn's tokens (a resumed model turn: its last piece's;
    the per-token versions are in :attr:`TrajectoryBuilder.versions`)."""
    finish_reason: FinishReason | None = None
    """The engine's finish reason (model turns only)."""


class TrajectoryBuilder:
    """Builds one multi-turn token-in/token-out trajectory; see the module docstring.

    Args:
        prompt_ids: the prompt's token ids ``[P]`` (``Prompt.token_ids``); must not be empty.
        config: length budget and validation options.
        version: policy version recorded for tool tokens appended before any model turn
            (afterwards tool tokens take the version of the latest model turn unless given).
    """

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Config:
        """Options of a :class:`TrajectoryBuilder`."""

        max_length: PositiveInt | None = None
        """Budget on all tokens (prompt + response); ``None`` for no budget."""
        allow_empty_model_turn: bool = False
        """Accept a model turn with no token (e.g. an engine aborted before sampling); by default
        it is an error because it usually means the loop sent a request it should not have."""

        def __post_init__(self) -> None:
            if self.max_length is not None and self.max_length < 1:
                raise ConfigError(
                    f"trajectory.max_length: must be >= 1 or None, got {self.max_length}."
                )

    def __init__(
        self, prompt_ids: Sequence[int], config: Config | None = None, *, version: int = 0
    ) -> None:
        self.config = config or TrajectoryBuilder.Config()
        ids = tuple(prompt_ids)
        if not ids:
            raise DataError(
                "trajectory: the prompt has no token ids; pass Prompt.token_ids (the prompt after "
                "the chat template), not an empty sequence."
            )
        _check_ids(ids, "prompt")
        self._tokens: list[int] = list(ids)
        self._prompt_len = len(ids)
        self._mask: list[int] = []
        self._logprobs: list[float] = []
        self._versions: list[int] = []
        self._turns: list[Turn] = []
        self._version = int(version)
        # Expert routing [rows, L, K] (``GenerationRequest.return_routing``): the rows of the
        # first engine pass that ran each token; ``_routed_rows`` of them were really run
        # (the last sampled token of a turn is not, until the next turn's prefill runs it).
        self._routing: torch.Tensor | None = None
        self._routed_rows = 0

    # ---------------------------------------------------------------------------------------
    # Reading
    # ---------------------------------------------------------------------------------------

    @property
    def input_ids(self) -> tuple[int, ...]:
        """All tokens so far (prompt + response): the input of the next generation request."""
        return tuple(self._tokens)

    @property
    def prompt_length(self) -> int:
        """Number of prompt tokens ``P`` (the rollout's ``response_start``)."""
        return self._prompt_len

    @property
    def response_ids(self) -> tuple[int, ...]:
        """Response tokens ``[R]`` (model and tool tokens after the prompt)."""
        return tuple(self._tokens[self._prompt_len :])

    @property
    def loss_mask(self) -> tuple[int, ...]:
        """``[R]``: 1 on model tokens, 0 on tool tokens."""
        return tuple(self._mask)

    @property
    def rollout_logprobs(self) -> tuple[float, ...]:
        """``[R]``: engine log-probs of model tokens, 0 on tool tokens."""
        return tuple(self._logprobs)

    @property
    def versions(self) -> tuple[int, ...]:
        """``[R]``: policy version of each response token."""
        return tuple(self._versions)

    @property
    def turns(self) -> tuple[Turn, ...]:
        """The appended turns, in order."""
        return tuple(self._turns)

    @property
    def num_model_turns(self) -> int:
        """Number of model turns appended."""
        return sum(t.kind == TurnKind.MODEL for t in self._turns)

    @property
    def remaining(self) -> int | None:
        """Tokens left in the ``max_length`` budget (may be negative), or ``None`` without one."""
        if self.config.max_length is None:
            return None
        return self.config.max_length - len(self._tokens)

    @property
    def is_full(self) -> bool:
        """True when the budget is used up: no further model turn will be accepted."""
        left = self.remaining
        return left is not None and left <= 0

    def clamp(self, sampling: SamplingParams) -> SamplingParams:
        """``sampling`` with ``max_new_tokens`` cut to the tokens left in the budget (at least 1)."""
        left = self.remaining
        if left is None or left >= sampling.max_new_tokens:
            return sampling
        return dataclasses.replace(sampling, max_new_tokens=max(1, left))

    # ---------------------------------------------------------------------------------------
    # Appending
    # ---------------------------------------------------------------------------------------

    def append_model(self, result: GenerationResult) -> None:
        """Append the engine's sampled ids (mask 1), their log-probs and weight version (per
        piece for a turn resumed after a weight update, :class:`~rl_agents.resumable.ResumedResult`;
        the turn's :attr:`Turn.version` is then its newest piece's).

        Raises :class:`DataError` (nothing appended) when the log-probs do not match the ids
        one to one, a log-prob is not a finite number <= 0, the turn is empty and
        ``allow_empty_model_turn`` is off, or the trajectory is already at ``max_length``.
        """
        turn = len(self._turns)
        where = f"trajectory turn {turn} (model, request {result.request_id!r})"
        ids = tuple(result.output_ids)
        logps = tuple(result.output_logprobs)
        if self.is_full:
            raise DataError(
                f"{where}: the trajectory already has {len(self._tokens)} tokens, at or over "
                f"max_length={self.config.max_length}; stop the loop when `builder.is_full` "
                "(and send `builder.clamp(sampling)` so the engine never samples past the budget)."
            )
        if len(ids) != len(logps):
            raise DataError(
                f"{where}: {len(ids)} token ids but {len(logps)} log-probs; the engine must return "
                "one log-prob per sampled token (ask for return_logprob and do not trim either list)."
            )
        if not ids and not self.config.allow_empty_model_turn:
            raise DataError(
                f"{where}: the engine returned no token; skip appending empty results or set "
                "TrajectoryBuilder.Config(allow_empty_model_turn=True)."
            )
        _check_ids(ids, where)
        for i, lp in enumerate(logps):
            if not (isinstance(lp, int | float) and math.isfinite(lp) and lp <= 0.0):
                raise DataError(
                    f"{where}: log-prob {i} is {lp!r}; log-probs must be finite numbers <= 0 "
                    "(pass the engine's log-probs, not probabilities or logits)."
                )
        self._take_routing(result, where)
        # A turn resumed after a weight update (ResumedResult) keeps each piece's version.
        versions = token_versions(result)
        version = int(versions[-1]) if versions else int(result.weight_version)
        self._extend(ids, 1, logps, version, versions=versions)
        self._version = version
        self._turns.append(
            Turn(
                index=turn,
                kind=TurnKind.MODEL,
                start=len(self._tokens) - len(ids),
                end=len(self._tokens),
                version=version,
                finish_reason=result.finish_reason,
            )
        )
        self._check_aligned(turn)

    def _take_routing(self, result: GenerationResult, where: str) -> None:
        """Keep the turn's routing (checked before anything is appended): the rows of tokens
        an earlier turn already ran stay, the rest (this turn's prompt part the engine ran for
        the first time, and its output) come from this turn."""
        routed = result.routed_experts
        if routed is None:
            if self._routing is not None:
                raise DataError(
                    f"{where}: an earlier turn returned routed_experts but this one did not; ask "
                    "for it on every turn (ctx.generate does when rollout.routing_replay is on)."
                )
            return
        want = len(self._tokens) + len(result.output_ids)
        if routed.dim() != 3 or routed.shape[0] != want:
            raise DataError(
                f"{where}: routed_experts has shape {tuple(routed.shape)}, expected {want} rows "
                "(the request's input tokens, i.e. the trajectory so far, plus the output); "
                "send the whole trajectory (builder.input_ids) as the request's input."
            )
        if self._routing is None:
            if self._turns:
                raise DataError(
                    f"{where}: this turn returned routed_experts but an earlier one did not; "
                    "ask for it on every turn."
                )
            merged = routed
        else:
            keep = self._routed_rows
            merged = torch.cat([self._routing[:keep].to(routed.dtype), routed[keep:]])
        self._routing = merged
        self._routed_rows = want - 1 if result.output_ids else want

    def append_tokens(self, ids: Sequence[int], *, version: int | None = None) -> None:
        """Append tool/observation token ids with mask 0 and log-prob 0.

        ``version`` defaults to the version of the latest model turn (or the builder's initial
        version before any). Appending no id is a no-op.
        """
        turn = len(self._turns)
        ids = tuple(ids)
        if not ids:
            return
        _check_ids(ids, f"trajectory turn {turn} (tool)")
        v = self._version if version is None else int(version)
        self._extend(ids, 0, (0.0,) * len(ids), v)
        self._turns.append(
            Turn(
                index=turn,
                kind=TurnKind.TOOL,
                start=len(self._tokens) - len(ids),
                end=len(self._tokens),
                version=v,
            )
        )
        self._check_aligned(turn)

    def append_text(
        self, text: str, tokenizer: Tokenizer, *, version: int | None = None
    ) -> tuple[int, ...]:
        """Encode ``text`` once (``add_special_tokens=False``) and append it as tool tokens.

        Returns the ids appended, so the caller can log them.
        """
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        self.append_tokens(ids, version=version)
        return ids

    def fork(self) -> TrajectoryBuilder:
        """An independent copy of this trajectory, to branch from (fan-out)."""
        return copy.deepcopy(self)

    # ---------------------------------------------------------------------------------------
    # Output
    # ---------------------------------------------------------------------------------------

    def validate(self) -> None:
        """Check the whole trajectory: per-token lists aligned with the response, masks in
        {0, 1}, log-probs finite and <= 0, and 0 on every tool token. Raises DataError."""
        self._check_aligned(len(self._turns))
        for turn in self._turns:
            for pos in range(turn.start - self._prompt_len, turn.end - self._prompt_len):
                want = 1 if turn.kind == TurnKind.MODEL else 0
                if self._mask[pos] != want:
                    raise DataError(
                        f"trajectory turn {turn.index} ({turn.kind}): loss mask {self._mask[pos]} "
                        f"at response token {pos}, expected {want}; do not edit the builder's "
                        "lists directly, use append_model/append_tokens."
                    )
                lp = self._logprobs[pos]
                if not math.isfinite(lp) or lp > 0 or (want == 0 and lp != 0.0):
                    raise DataError(
                        f"trajectory turn {turn.index} ({turn.kind}): log-prob {lp!r} at response "
                        f"token {pos} is invalid; tool tokens carry 0, model tokens the engine's."
                    )

    def to_rollout(
        self,
        prompt_uid: str,
        sample_id: str,
        rollout_id: str | None = None,
        *,
        status: RolloutStatus | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """The trajectory as a :class:`Rollout` (validated first).

        ``rollout_id`` defaults to ``sample_id`` (no fan-out). ``status`` defaults to the last
        model turn's finish reason (``stop`` -> completed, ``length`` -> truncated, ``abort`` ->
        aborted); a trajectory over ``max_length`` is cut to it and marked truncated. The
        rollout's metadata gets ``turns`` (the number of turns) and ``model_turns``.

        Raises DataError when there is no model turn and ``status`` is not ``failed`` or
        ``aborted`` (a rollout with nothing to train on).
        """
        self.validate()
        n_model = self.num_model_turns
        if status is None:
            last = next((t for t in reversed(self._turns) if t.kind == TurnKind.MODEL), None)
            if last is None:
                raise DataError(
                    f"trajectory {sample_id!r}: no model turn was appended, so there is nothing "
                    "to train on; append_model at least once or pass status=RolloutStatus.FAILED."
                )
            status = (last.finish_reason or FinishReason.STOP).to_status()
        status = RolloutStatus(status)
        if n_model == 0 and status not in (RolloutStatus.FAILED, RolloutStatus.ABORTED):
            raise DataError(
                f"trajectory {sample_id!r}: status {status.value!r} but no model turn was "
                "appended; append_model at least once or pass status=RolloutStatus.FAILED."
            )
        tokens = self._tokens
        r_end = len(self._mask)
        limit = self.config.max_length
        if limit is not None and len(tokens) > limit:
            r_end = max(0, limit - self._prompt_len)
            tokens = tokens[: self._prompt_len + r_end]
            if status == RolloutStatus.COMPLETED:
                status = RolloutStatus.TRUNCATED
        meta = {"turns": len(self._turns), "model_turns": n_model}
        meta.update(metadata or {})
        return Rollout(
            prompt_uid=prompt_uid,
            rollout_id=sample_id if rollout_id is None else rollout_id,
            sample_id=sample_id,
            tokens=tuple(tokens),
            response_start=self._prompt_len,
            loss_mask=tuple(self._mask[:r_end]),
            rollout_logprobs=tuple(self._logprobs[:r_end]),
            versions=tuple(self._versions[:r_end]),
            status=status,
            metadata=meta,
            # Tool tokens after the last model turn were never run: padded rows.
            routed_experts=(
                pad_routing(self._routing, len(tokens)) if self._routing is not None else None
            ),
        )

    # ---------------------------------------------------------------------------------------

    def _extend(
        self,
        ids: Sequence[int],
        mask: int,
        logps: Sequence[float],
        version: int,
        *,
        versions: Sequence[int] | None = None,
    ) -> None:
        self._tokens.extend(int(t) for t in ids)
        self._mask.extend([mask] * len(ids))
        self._logprobs.extend(float(x) for x in logps)
        self._versions.extend([int(v) for v in versions] if versions else [version] * len(ids))

    def _check_aligned(self, turn: int) -> None:
        r = len(self._tokens) - self._prompt_len
        lengths = {
            "loss_mask": len(self._mask),
            "rollout_logprobs": len(self._logprobs),
            "versions": len(self._versions),
        }
        for name, n in lengths.items():
            if n != r:
                raise DataError(
                    f"trajectory after turn {turn}: {name} has {n} entries for {r} response "
                    "tokens; every per-token list must stay aligned. Do not edit the builder's "
                    "lists directly, use append_model/append_tokens."
                )


def _check_ids(ids: Sequence[int], where: str) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise DataError(
                f"{where}: token {i} is {t!r}; token ids must be non-negative ints (pass ids, "
                "not text; use append_text for text)."
            )


def siblings(
    builders: Sequence[TrajectoryBuilder],
    *,
    prompt_uid: str,
    rollout_id: str,
    status: RolloutStatus | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> list[Rollout]:
    """Fan-out: one rollout per builder, all sharing ``rollout_id`` (sample ids
    ``"{rollout_id}/{k}"``), so per-rollout loss aggregation counts them once.

    ``metadata`` is copied into each; each also gets ``sibling`` (its index ``k``) and
    ``num_siblings``.
    """
    if not builders:
        raise DataError(f"siblings({rollout_id!r}): no trajectories given.")
    out = []
    for k, b in enumerate(builders):
        meta = {"sibling": k, "num_siblings": len(builders), **(metadata or {})}
        out.append(
            b.to_rollout(prompt_uid, f"{rollout_id}/{k}", rollout_id, status=status, metadata=meta)
        )
    return out
