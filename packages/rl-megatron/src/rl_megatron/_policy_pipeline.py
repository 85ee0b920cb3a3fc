"""Pipeline-parallel execution of :class:`~rl_megatron.policy.MegatronPolicy` (Megatron's 1F1B
schedule), and the attributes its parts share.

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``L`` longest sequence, ``V`` this
rank's vocabulary slice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rl_core.interfaces import LossFn
from rl_core.types import TrainBatch
from rl_megatron.convert import HFWeightMap
from rl_megatron.parallel import ParallelLayout

if TYPE_CHECKING:
    from rl_megatron.policy import MegatronPolicy


class _PolicyState:
    """Attributes shared by the mixins of :class:`~rl_megatron.policy.MegatronPolicy` (set in
    its ``__init__``)."""

    config: MegatronPolicy.Config
    layout: ParallelLayout
    hf_config: Any
    tokenizer: Any
    module: Any
    model: Any
    optimizer: Any
    weight_map: HFWeightMap
    _global_map: HFWeightMap
    _params: dict[str, torch.nn.Parameter]
    _params_dtype: torch.dtype
    _layers_per_stage: int
    _version: int
    _applied_steps: int

    if TYPE_CHECKING:  # defined by the other mixins and the policy

        def _routing_begin(self, mb: TrainBatch, prep: dict[str, torch.Tensor]) -> None: ...
        def _routing_end(self, prep: dict[str, torch.Tensor]) -> torch.Tensor | None: ...
        def _device(self) -> torch.device: ...
        def _save_lora(self, out: Any) -> None: ...
        def _lora_record(self) -> dict[str, Any] | None: ...
        def _check_lora_checkpoint(self, state_path: Any, saved: Any) -> bool: ...
        def _load_lora_checkpoint(self, src: Any) -> None: ...
        def _lora_model_keys(self, key: str) -> bool: ...


class _PipelineMixin(_PolicyState):
    """Log-probs and training steps through the pipeline stages; the last stage broadcasts results."""

    def _run_pipeline(
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
            self._routing_begin(micro_batches[index], prep)
            output = model(
                prep["tokens_NL"], prep["positions_NL"], None, runtime_gather_output=False
            )
            own_TLK = self._routing_end(prep)
            if routing is not None and own_TLK is not None:
                routing.append(own_TLK)

            def loss_func(logits_NLV: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                loss = loss_for(index, prep, logits_NLV)
                return loss, torch.ones((), dtype=torch.int), {}

            return output, loss_func

        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(items),
            model=[self.model],
            num_microbatches=len(items),
            seq_length=max(int(p["tokens_NL"].shape[1]) for _, p in items),
            micro_batch_size=max(int(p["tokens_NL"].shape[0]) for _, p in items),
            forward_only=forward_only,
        )

    def _broadcast_from_last_stage(self, x_T: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        torch.distributed.broadcast(
            x_T,
            src=ps.get_pipeline_model_parallel_last_rank(),
            group=ps.get_pipeline_model_parallel_group(),
        )
        return x_T

    def _pipeline_logprobs(
        self,
        batch: TrainBatch,
        *,
        with_entropy: bool,
        routing: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs through the pipeline; the last stage broadcasts them to every stage."""
        mbs = batch.micro_batches()
        device = self._device()
        logp_T = torch.zeros(batch.num_tokens, dtype=torch.float32, device=device)
        ent_T = torch.zeros_like(logp_T) if with_entropy else None
        offsets = [int(batch.cu_seqlens[b]) for b in (batch.micro_batch_bounds or (0,))]

        def loss_for(index: int, prep: dict[str, torch.Tensor], logits: torch.Tensor) -> Any:
            lp, ent = self._logits_to_logp(logits, prep, with_entropy=with_entropy)
            t0 = offsets[index]
            logp_T[t0 : t0 + lp.shape[0]] = lp
            if ent_T is not None and ent is not None:
                ent_T[t0 : t0 + ent.shape[0]] = ent
            return logits.new_zeros(())

        self._run_pipeline(mbs, loss_for, forward_only=True, routing=routing)
        logp_T = self._broadcast_from_last_stage(logp_T)
        if ent_T is not None:
            ent_T = self._broadcast_from_last_stage(ent_T)
        return logp_T, ent_T

    def _pipeline_train(
        self, batch: TrainBatch, loss_fn: LossFn, *, needs_entropy: bool, record: Any
    ) -> None:
        """Forward and backward of every micro-batch through the pipeline (1F1B)."""
        mbs = batch.micro_batches()

        def loss_for(index: int, prep: dict[str, torch.Tensor], logits: torch.Tensor) -> Any:
            logp_T, ent_T = self._logits_to_logp(logits, prep, with_entropy=needs_entropy)
            out = loss_fn(logp_T, _to_device(mbs[index], logp_T.device), ent_T)
            record(out)
            loss = out.loss
            if not loss.requires_grad:  # the stage before still needs a (zero) gradient
                loss = loss + 0.0 * logp_T.sum()
            return loss

        self._run_pipeline(mbs, loss_for, forward_only=False)


def _to_device(batch: TrainBatch, device: torch.device) -> TrainBatch:
    if batch.tokens.device == device:
        return batch
    moved = {
        f.name: getattr(batch, f.name).to(device)
        for f in dataclasses.fields(batch)
        if isinstance(getattr(batch, f.name), torch.Tensor)
    }
    return dataclasses.replace(batch, **moved)
