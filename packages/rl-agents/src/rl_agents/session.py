"""Agent sessions: the exact tokens served to one agent run, and how they become rollouts.

Every chat completion served in a session is recorded as a :class:`TurnRecord`: the prompt ids
the server rendered, and the engine's :class:`~rl_core.types.GenerationResult` (sampled ids,
their log-probs, finish reason, weight version). Nothing is re-tokenized afterwards.

Prompts reuse held tokens. When a request's rendered text starts with the text of an earlier
turn's prompt + completion (the usual case: the agent re-sends the history plus a tool result or
a new user message), the prompt ids are that turn's prompt ids + sampled ids + the encoding of
the new text only. So the prompt of turn k+1 extends the tokens of turn k exactly, even when the
tokenizer's ``encode(decode(ids))`` is not ``ids``.

:meth:`Session.to_rollouts` linearises the turns (:func:`linearize`): a turn whose prompt ids
extend an open trajectory is appended to it (the new prompt tokens with loss mask 0, the sampled
ids with mask 1); otherwise it starts a new trajectory (the agent rewrote its history, ran a
sub-agent, compacted its context). All trajectories of a session share its ``rollout_id`` and
its reward.

Re-rendered history is flagged, never hidden. When a request continues an earlier turn's prompt
but the earlier completion renders back differently from what the model sampled (a chat
template that rewrites earlier assistant turns, e.g. one that drops thinking from history, or an
agent that edits a reply), the tokens the model produced would change. The server does not
re-encode them into the old trajectory: the turn starts a new trajectory and records
:attr:`TurnRecord.rerendered_turn`; every rollout of the session carries the count in
``metadata["template_mismatch"]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rl_agents.trajectory import TrajectoryBuilder, siblings
from rl_core.errors import DataError
from rl_core.types import GenerationResult, Rollout, RolloutStatus, SamplingParams

__all__ = ["Session", "TurnRecord", "linearize"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TurnRecord:
    """One served chat completion."""

    prompt_ids: tuple[int, ...]
    """The prompt ids sent to the engine ``[P]``."""
    result: GenerationResult
    """What the engine returned: sampled ids, log-probs, finish reason, weight version."""
    prompt_text: str
    """The rendered prompt text (what ``prompt_ids`` encode)."""
    output_text: str
    """``decode(output_ids)`` with special tokens kept."""
    raw_content: str
    """The completion's text without its final stop token: how the assistant message is
    rendered back when the agent re-sends it."""
    content: str | None = None
    """The ``content`` returned to the client."""
    tool_call_ids: tuple[str, ...] = ()
    """Ids of the tool calls returned to the client."""
    ill_formed: bool = False
    """The completion held a malformed ``<tool_call>`` block."""
    rerendered_turn: int | None = None
    """Index of the earlier turn whose prompt this one continues but whose completion was
    rendered back differently (see the module docstring); ``None`` when the history matched."""

    @property
    def held_text(self) -> str:
        """Prompt text + completion text: what a later prompt extends."""
        return self.prompt_text + self.output_text

    @property
    def held_ids(self) -> tuple[int, ...]:
        """Prompt ids + sampled ids."""
        return self.prompt_ids + tuple(self.result.output_ids)


@dataclass(slots=True, kw_only=True)
class Session:
    """The state of one agent run on the server (see the module docstring)."""

    id: str
    """Session id (the client's API key, ``X-Session-Id`` header, or ``user`` field)."""
    sampling: SamplingParams
    """Sampling of every completion of the session (the client may lower ``max_new_tokens``)."""
    max_turns: int | None = None
    """Completions allowed at most (then the server answers 400)."""
    max_context_tokens: int | None = None
    """Prompt + completion tokens allowed per request at most."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form data copied into each rollout's metadata."""
    return_routing: bool = False
    """Ask the engine for the experts it routed every token to (MoE routing replay,
    ``rollout.routing_replay``); the session's rollouts then carry ``routed_experts`` for every
    token, the tool tokens between turns included (from the next turn's prefill)."""
    turns: list[TurnRecord] = field(default_factory=list)
    """Served completions, in order."""
    closed: bool = False
    """No more completions are served once the session is finished."""
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """Responses API state: the conversation (chat messages) of each response id served, which
    a later request continues with ``previous_response_id``."""

    def prompt_ids(self, text: str, encode: Any) -> tuple[tuple[int, ...], int | None]:
        """Token ids for the rendered prompt ``text``: the held ids of the earlier turn whose
        held text is the longest prefix of ``text`` plus ``encode`` of the rest, or
        ``encode(text)`` when no turn is a prefix. Returns ``(ids, turn index or None)``."""
        best: int | None = None
        for i, t in enumerate(self.turns):
            held = t.held_text
            if text.startswith(held) and (
                best is None or len(held) > len(self.turns[best].held_text)
            ):
                best = i
        if best is None:
            return tuple(encode(text)), None
        t = self.turns[best]
        rest = text[len(t.held_text) :]
        return t.held_ids + (tuple(encode(rest)) if rest else ()), best

    def rerendered(self, text: str) -> int | None:
        """The turn whose completion ``text`` renders back differently: no turn's held text
        is a prefix of ``text``, but the latest such turn's prompt text is (``None`` when a
        held text matches or no earlier prompt is continued)."""
        if any(text.startswith(t.held_text) for t in self.turns):
            return None
        for i in range(len(self.turns) - 1, -1, -1):
            if text.startswith(self.turns[i].prompt_text):
                return i
        return None

    def substitute(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with each assistant message served in this session (matched by its tool
        call ids, or by its content when it has no calls) replaced by the completion's raw text,
        so the template renders back exactly what the model wrote: call formatting and special
        tokens the client never saw included."""
        by_call = {cid: t for t in self.turns for cid in t.tool_call_ids}
        by_content = {t.content: t for t in self.turns if not t.tool_call_ids and t.content}
        out = []
        for m in messages:
            if not isinstance(m, Mapping) or m.get("role") != "assistant":
                out.append(m)
                continue
            calls = m.get("tool_calls")
            turn = None
            if calls:
                ids = [c.get("id") if isinstance(c, Mapping) else None for c in calls]
                if all(c in by_call for c in ids) and len({id(by_call[c]) for c in ids}) == 1:
                    turn = by_call[ids[0]]
            elif isinstance(m.get("content"), str):
                turn = by_content.get(m["content"])
            out.append(
                {"role": "assistant", "content": turn.raw_content} if turn is not None else m
            )
        return out

    def to_rollouts(
        self,
        prompt_uid: str,
        prompt_ids: Sequence[int],
        *,
        reward: float | None = None,
        failure: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> list[Rollout]:
        """The session's rollouts (siblings sharing ``rollout_id = self.id``).

        ``reward`` (finite) is set on every rollout and stored as ``metadata["session_reward"]``.
        ``failure`` marks every rollout failed with that reason. A session without turns gives
        one failed rollout holding ``prompt_ids`` (the agent never called the model).
        """
        if reward is not None and not math.isfinite(float(reward)):
            raise DataError(f"session {self.id!r}: reward {reward!r} is not finite.")
        meta: dict[str, Any] = {
            **self.metadata,
            "session": self.id,
            "session_turns": len(self.turns),
            "ill_formed": sum(t.ill_formed for t in self.turns),
            "tool_calls": sum(len(t.tool_call_ids) for t in self.turns),
            "template_mismatch": sum(t.rerendered_turn is not None for t in self.turns),
            **(metadata or {}),
        }
        if reward is not None:
            meta["session_reward"] = float(reward)
        if not self.turns:
            failure = failure or "agent made no model call"
            builders = [TrajectoryBuilder(prompt_ids)]
        else:
            builders = linearize(self.turns)
        status = RolloutStatus.FAILED if failure else None
        if failure:
            meta["failure"] = failure
        out = siblings(
            builders, prompt_uid=prompt_uid, rollout_id=self.id, status=status, metadata=meta
        )
        if reward is not None:
            for r in out:
                r.reward = float(reward)
                r.reward_info = {"reward": float(reward)}
        return out


def linearize(turns: Sequence[TurnRecord]) -> list[TrajectoryBuilder]:
    """Merge turns into trajectories: each turn extends the open trajectory whose tokens are
    the longest prefix of its prompt ids, or starts a new one (see the module docstring)."""
    open_: list[TrajectoryBuilder] = []
    for t in turns:
        best: TrajectoryBuilder | None = None
        for b in open_:
            held = b.input_ids
            extends = len(held) <= len(t.prompt_ids) and t.prompt_ids[: len(held)] == held
            if extends and (best is None or len(held) > len(best.input_ids)):
                best = b
        if best is None:
            best = TrajectoryBuilder(t.prompt_ids, version=t.result.weight_version)
            open_.append(best)
        else:
            best.append_tokens(t.prompt_ids[len(best.input_ids) :])
        best.append_model(t.result)
    return open_
