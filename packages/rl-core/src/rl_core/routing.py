"""Expert routing of mixture-of-experts models, recorded by the engine and replayed by the trainer.

A mixture-of-experts layer sends every token to ``K`` of its ``E`` experts. The inference engine
and the trainer compute the router in different kernels and precisions, so for the same token
they can pick different experts, and the trainer's log-probs then belong to a different model
than the one that sampled ("routing replay", R3 in slime/miles/verl: record the engine's choice,
make the trainer use exactly it).

The payload is a tensor ``[S, L, K]`` per sequence: for each of its ``S`` tokens and each of the
``L`` MoE layers, the ``K`` expert indices the engine chose, stored in the smallest integer type
that holds ``E`` (:func:`routing_dtype`: one byte per expert choice up to 256 experts).

Where it lives:

- :attr:`rl_core.types.GenerationResult.routed_experts`: ``[P + R, L, K]`` for the request's
  input tokens and its output tokens;
- :attr:`rl_core.types.Rollout.routed_experts`: ``[len(tokens), L, K]``;
- :attr:`rl_core.types.TrainBatch.routed_experts`: ``[T, L, K]``, packed like the tokens.

Rows for tokens the engine never ran through the model (the last sampled token; tool tokens
appended after the last turn) repeat the row before them (:func:`pad_routing`): nothing trained
on reads the model's output at those positions (attention is causal and they come after every
token they could influence), so any valid expert choice is exact there.
"""

from __future__ import annotations

import torch

__all__ = [
    "RoutingShape",
    "pad_routing",
    "routing_bytes_per_token",
    "routing_dtype",
    "routing_mismatch",
    "validate_routing",
]


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert indices ``0..num_experts-1``:
    ``uint8`` up to 256 experts, ``int16`` up to 32768, ``int32`` beyond."""
    if num_experts < 1:
        raise ValueError(f"routing_dtype: num_experts must be >= 1, got {num_experts}.")
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    return torch.int32


class RoutingShape:
    """The routing layout of one model: ``num_layers`` MoE layers, ``top_k`` experts per token
    out of ``num_experts``."""

    __slots__ = ("num_experts", "num_layers", "top_k")

    def __init__(self, *, num_layers: int, top_k: int, num_experts: int) -> None:
        if num_layers < 1 or top_k < 1 or num_experts < top_k:
            raise ValueError(
                f"RoutingShape: need num_layers >= 1 and 1 <= top_k <= num_experts, got "
                f"num_layers={num_layers}, top_k={top_k}, num_experts={num_experts}."
            )
        self.num_layers = num_layers
        self.top_k = top_k
        self.num_experts = num_experts

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of this model's routing (:func:`routing_dtype`)."""
        return routing_dtype(self.num_experts)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RoutingShape) and (
            (self.num_layers, self.top_k, self.num_experts)
            == (other.num_layers, other.top_k, other.num_experts)
        )

    def __hash__(self) -> int:
        return hash((self.num_layers, self.top_k, self.num_experts))

    def __repr__(self) -> str:
        return (
            f"RoutingShape(num_layers={self.num_layers}, top_k={self.top_k}, "
            f"num_experts={self.num_experts})"
        )


def routing_bytes_per_token(shape: RoutingShape) -> int:
    """Bytes the routing of one token takes in storage: ``L * K * itemsize``."""
    return shape.num_layers * shape.top_k * torch.empty((), dtype=shape.dtype).element_size()


def validate_routing(routing_SLK: torch.Tensor, *, num_tokens: int, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless ``routing_SLK`` is an integer ``[S, L, K]``
    tensor with ``S == num_tokens``."""
    if routing_SLK.dim() != 3:
        raise ValueError(
            f"{where}: routed_experts must be [tokens, layers, top_k], got shape "
            f"{tuple(routing_SLK.shape)}."
        )
    if routing_SLK.dtype.is_floating_point or routing_SLK.dtype == torch.bool:
        raise ValueError(
            f"{where}: routed_experts must hold integer expert ids, got {routing_SLK.dtype}."
        )
    if routing_SLK.shape[0] != num_tokens:
        raise ValueError(
            f"{where}: routed_experts covers {routing_SLK.shape[0]} tokens but the sequence has "
            f"{num_tokens}; the routing must have one row per token (see rl_core.routing)."
        )


def pad_routing(routing_SLK: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``routing_SLK`` extended to ``num_tokens`` rows by repeating its last row (for tokens the
    engine never ran through the model), or cut to ``num_tokens`` rows if longer."""
    s = routing_SLK.shape[0]
    if s >= num_tokens:
        return routing_SLK[:num_tokens]
    if s == 0:
        raise ValueError("pad_routing: cannot extend an empty routing (no row to repeat).")
    tail_SLK = routing_SLK[-1:].expand(num_tokens - s, *routing_SLK.shape[1:])
    return torch.cat([routing_SLK, tail_SLK])


def routing_mismatch(
    a_SLK: torch.Tensor, b_SLK: torch.Tensor, mask_S: torch.Tensor | None = None
) -> float:
    """Fraction of (token, layer) pairs whose *set* of chosen experts differs between two
    routings of the same tokens (the order of the top-k does not matter). ``mask_S`` (0/1)
    restricts the count to some tokens; 0.0 when nothing is counted."""
    if a_SLK.shape != b_SLK.shape:
        raise ValueError(
            f"routing_mismatch: shapes differ, {tuple(a_SLK.shape)} vs {tuple(b_SLK.shape)}."
        )
    a_sorted = torch.sort(a_SLK.to(torch.int64), dim=-1).values
    b_sorted = torch.sort(b_SLK.to(torch.int64), dim=-1).values
    differ_SL = (a_sorted != b_sorted).any(dim=-1).float()
    if mask_S is not None:
        m_SL = mask_S.to(differ_SL.dtype)[:, None].expand_as(differ_SL)
        n = float(m_SL.sum())
        return float((differ_SL * m_SL).sum()) / n if n else 0.0
    return float(differ_SL.mean()) if differ_SL.numel() else 0.0
