"""Pipeline-parallel execution of :class:`~rl_megatron.policy.MegatronPolicy`: micro-batches
through megatron-core's 1F1B schedule, the last stage computing log-probs (and the loss) and
broadcasting what every stage returns.

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``L`` longest sequence, ``V`` this
rank's vocabulary slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rl_core.interfaces import LossFn
from rl_core.types import TrainBatch
from rl_megatron._routing import RoutingReplay
from rl_megatron.parallel import current_device

__all__ = ["Head", "PipelineSchedule", "Prepare", "to_device"]

Prepare = Callable[[TrainBatch], "dict[str, torch.Tensor] | None"]
"""A micro-batch's padded ``[N, L]`` inputs and index tensors (``None`` when it is empty)."""
Head = Callable[..., "tuple[torch.Tensor, torch.Tensor | None]"]
"""``head(output, prep, with_entropy=...)``: ``logp_T`` (and ``entropy_T``) from the last stage's
model output for the micro-batch ``prep`` describes."""


class PipelineSchedule:
    """Log-probs and training steps through the pipeline stages (1F1B); the last stage
    broadcasts the results so every rank returns the same values."""

    def __init__(self, model: Any, *, prepare: Prepare, head: Head, routing: RoutingReplay) -> None:
        """``model``: the DDP-wrapped stage the schedule runs; ``prepare`` pads a micro-batch;
        ``head`` turns the last stage's output into log-probs; ``routing`` replays and records
        each micro-batch's MoE routing."""
        self._model = model
        self._prepare = prepare
        self._head = head
        self._routing = routing

    def _run(
        self,
        micro_batches: list[TrainBatch],
        loss_for: Any,
        *,
        forward_only: bool,
        routing: list[torch.Tensor] | None = None,
    ) -> None:
        """Run Megatron's 1F1B schedule over the non-empty micro-batches.

        ``loss_for(index, prep, logits_NLV)`` runs on the last stage and returns the scalar to
        back-propagate (ignored when ``forward_only``). A MoE stage replays each micro-batch's
        ``routed_experts`` and appends its routers' own choice to ``routing`` (if given).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        items = [
            (i, p) for i, mb in enumerate(micro_batches) if (p := self._prepare(mb)) is not None
        ]
        if not items:
            return

        def forward_step(data_iterator: Iterator[Any], model: Any) -> tuple[Any, Any]:
            index, prep = next(data_iterator)
            self._routing.begin(micro_batches[index], prep)
            output = model(
                prep["tokens_NL"], prep["positions_NL"], None, runtime_gather_output=False
            )
            own_TLK = self._routing.end(prep)
            if routing is not None and own_TLK is not None:
                routing.append(own_TLK)

            def loss_func(logits_NLV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                loss = loss_for(index, prep, logits_NLV)
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(items),
            model=[self._model],
            num_microbatches=len(items),
            seq_length=max(int(p["tokens_NL"].shape[1]) for _, p in items),
            micro_batch_size=max(int(p["tokens_NL"].shape[0]) for _, p in items),
            forward_only=forward_only,
        )

    @staticmethod
    def _broadcast_from_last_stage(x_T: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        torch.distributed.broadcast(
            x_T,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return x_T

    def logprobs(
        self,
        batch: TrainBatch,
        *,
        with_entropy: bool,
        routing: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[T]`` (and entropy) of ``batch`` on this rank's device, computed on the
        last stage and broadcast to every stage (collective over the pipeline group); a MoE
        stage appends its routers' choices to ``routing``."""
        mbs = batch.micro_batches()
        device = current_device()
        logp_T = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)
        ent_T = torch.zeros_like(logp_T) if with_entropy else None
        offsets = [int(batch.cu_seqlens[b]) for b in (batch.micro_batch_bounds or (0,))]

        def loss_for(index: int, prep: dict[str, torch.Tensor], logits: torch.Tensor) -> Any:
            lp, ent = self._head(logits, prep, with_entropy=with_entropy)
            t0 = offsets[index]
            logp_T[t0 : t0 + lp.shape[0]] = lp
            if ent_T is not None and ent is not None:
                ent_T[t0 : t0 + ent.shape[0]] = ent
            return logits.new_zeros(())

        self._run(mbs, loss_for, forward_only=True, routing=routing)
        logp_T = self._broadcast_from_last_stage(logp_T)
        if ent_T is not None:
            ent_T = self._broadcast_from_last_stage(ent_T)
        return logp_T, ent_T

    def train(
        self,
        batch: TrainBatch,
        loss_fn: LossFn,
        *,
        needs_entropy: bool,
        record: Callable[[Any], None],
    ) -> None:
        """Forward and backward of every micro-batch of ``batch`` through the pipeline; the last
        stage calls ``loss_fn`` and passes each result to ``record``."""
        mbs = batch.micro_batches()

        def loss_for(index: int, prep: dict[str, torch.Tensor], logits: torch.Tensor) -> Any:
            logp_T, ent_T = self._head(logits, prep, with_entropy=needs_entropy)
            out = loss_fn(logp_T, to_device(mbs[index], logp_T.device), ent_T)
            record(out)
            loss = out.loss
            if not loss.requires_grad:  # the stage before still needs a (zero) gradient
                loss = loss + 0.0 * logp_T.sum()
            return loss

        self._run(mbs, loss_for, forward_only=False)


def to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    """``batch`` with every tensor field on ``device`` (itself when already there)."""
    if batch.tokens.device == device:
        return batch
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)
