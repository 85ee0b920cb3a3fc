"""Routing replay of :class:`~rl_megatron.policy.MegatronPolicy` (mixture-of-experts models).

:class:`RoutingControl` installs a ``_ReplayingRecorder`` as the megatron-core ``router_replay``
hook of every MoE router of one pipeline stage (``TransformerConfig.moe_enable_routing_replay``):
it always records the top-k the router itself computes, and when a target is set it returns that
target instead (the probabilities are the router's scores gathered at the target experts, then
normalised as the router does). :class:`RoutingReplay` is the policy's part built on it: it checks
a batch's ``routed_experts``, sets and reads the targets around each forward, joins the choices of
all micro-batches and pipeline stages, and scales the load-balancing loss of a step. For a dense
model it holds no control and every method is a no-op.

Routing tensors follow :mod:`rl_core.routing`: ``[T, L, K]`` over the packed tokens of a batch
and the ``L`` MoE layers of the model. The model runs padded ``[N, S]`` rows and megatron-core's
router sees tokens in ``[S, N]`` order (sequence-major), split along ``S`` over the tensor-parallel
ranks under sequence parallelism; :class:`RoutingControl` converts between the two.

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``S`` padded sequence length, ``L``
MoE layers, ``K`` experts per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rl_core.errors import ConfigError
from rl_core.routing import routing_dtype
from rl_core.types import TrainBatch
from rl_megatron._moe import moe_layer_pattern
from rl_megatron.parallel import ParallelLayout, current_device

__all__ = ["RoutingControl", "RoutingReplay"]


def _replaying_recorder_type() -> type:
    """``_ReplayingRecorder``, built on megatron-core's ``RouterReplay`` at first use (so this
    module imports without megatron-core)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    class _ReplayingRecorder(RouterReplay):
        """Records the router's own top-k every forward; returns :attr:`target` instead when
        set. Not registered in ``RouterReplay.global_router_replay_instances`` (a process-wide
        list that would outlive the policy); :class:`RoutingControl` drives each one."""

        def __init__(self) -> None:
            self.target_topk_idx = None
            self.recorded_topk_idx = None
            self.router_replay_action = None
            self.replay_backward_list = []

        def get_replay_topk(
            self,
            scores: torch.Tensor,
            topk: int,
            num_groups: int | None = None,
            group_topk: int | None = None,
            default_compute_topk: Any = None,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            probs, top_idx = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            self.recorded_topk_idx = top_idx.detach()
            if self.target_topk_idx is None:
                return probs, top_idx
            target = self.target_topk_idx.to(scores.device)
            return scores.gather(1, target), target

    return _ReplayingRecorder


class RoutingControl:
    """Routing replay and recording for the MoE layers of one pipeline stage of a GPTModel."""

    def __init__(self, module: Any, *, moe_layers_before: int, num_moe_layers: int) -> None:
        """Install a recorder on every MoE router of ``module``; ``moe_layers_before`` = MoE
        layers on earlier pipeline stages, ``num_moe_layers`` = MoE layers of the whole model."""
        from megatron.core.transformer.moe.moe_layer import MoELayer

        recorder_type = _replaying_recorder_type()
        self.recorders: list[Any] = []
        """One per MoE layer of this stage, in layer order."""
        self.top_k = 0
        """Experts per token."""
        for layer in module.decoder.layers:
            if isinstance(layer.mlp, MoELayer):
                router = layer.mlp.router
                previous = router.router_replay
                if previous is not None:  # drop megatron's process-wide registration
                    from megatron.core.transformer.moe.router_replay import RouterReplay

                    instances = RouterReplay.global_router_replay_instances
                    if previous in instances:
                        instances.remove(previous)
                router.router_replay = recorder_type()
                # The policy sets one gradient scale per step for the load-balancing loss
                # (RoutingReplay.aux_loss_scale); not multiplied by the token count.
                router.calculate_per_token_loss = False
                self.recorders.append(router.router_replay)
                self.top_k = int(router.topk)
        self.first = moe_layers_before
        """Global index of this stage's first MoE layer."""
        self.num_layers = num_moe_layers
        """MoE layers of the whole model (the ``L`` of routing tensors)."""

    # The model's token order: flat index pos * N + seq of the [S, N] layout, cut along S into
    # tp_size equal parts under sequence parallelism.

    def set_targets(self, routing_TLK: torch.Tensor | None, prep: dict[str, torch.Tensor]) -> None:
        """Replay ``routing_TLK`` (``[T, L, K]`` for the whole model) in the next forward, or
        route freely when ``None``; clears what was recorded."""
        for rec in self.recorders:
            rec.recorded_topk_idx = None
            rec.target_topk_idx = None
        if routing_TLK is None or not self.recorders:
            return
        n, s = prep["tokens_NL"].shape
        seq_T, pos_T = prep["seq_T"], prep["pos_T"]
        k = self.top_k
        rows = _tp_rows(s)
        for i, rec in enumerate(self.recorders):
            full_SNK = torch.arange(k, device=seq_T.device).expand(s, n, k).clone()
            full_SNK[pos_T, seq_T] = routing_TLK[:, self.first + i, :].to(
                device=seq_T.device, dtype=torch.long
            )
            rec.target_topk_idx = full_SNK[rows].reshape(-1, k)

    def recorded(self, prep: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[T, L_stage, K]``: what this stage's routers chose in the last forward (gathered
        over tensor-parallel ranks under sequence parallelism)."""
        n, s = prep["tokens_NL"].shape
        seq_T, pos_T = prep["seq_T"], prep["pos_T"]
        out = []
        for rec in self.recorders:
            local_K = rec.recorded_topk_idx
            full_SNK = _gather_tp_rows(local_K.reshape(-1, n, local_K.shape[-1]), s)
            out.append(full_SNK[pos_T, seq_T])
        if not out:
            return torch.zeros(seq_T.shape[0], 0, self.top_k, dtype=torch.long)
        return torch.stack(out, dim=1)


def _sequence_parallel() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _tp_rows(s: int) -> slice:
    """This TP rank's rows of a length-``s`` sequence axis (all rows without TP)."""
    rank, size = _sequence_parallel()
    if size == 1:
        return slice(0, s)
    part = s // size
    return slice(rank * part, (rank + 1) * part)


def _gather_tp_rows(local_SNK: torch.Tensor, s: int) -> torch.Tensor:
    """``[s, N, K]`` from each TP rank's ``[s / tp, N, K]`` rows (identity without TP)."""
    from megatron.core import parallel_state as ps

    _, size = _sequence_parallel()
    if size == 1:
        return local_SNK
    parts = [torch.empty_like(local_SNK) for _ in range(size)]
    torch.distributed.all_gather(
        parts, local_SNK.contiguous(), group=ps.get_tensor_model_parallel_group()
    )
    return torch.cat(parts, dim=0)


class RoutingReplay:
    """The routing part of a policy: replay of ``TrainBatch.routed_experts``, the routers' own
    choice per micro-batch and pipeline stage, and the load-balancing loss scale (no-ops for a
    dense model)."""

    def __init__(self, module: Any, hf_config: Any, layout: ParallelLayout) -> None:
        """Find the MoE routers of this rank's stage of ``module`` (a ``GPTModel``) and install
        the replaying recorders; ``hf_config`` is the model's Hugging Face config."""
        self._text_config = hf_config.get_text_config()
        self._layout = layout
        pattern = moe_layer_pattern(self._text_config)
        self.control: RoutingControl | None = None
        """The recorders of this stage's routers (``None`` for a dense model)."""
        if any(pattern):
            first_layer = (
                int(module.decoder.layers[0].layer_number) - 1 if len(module.decoder.layers) else 0
            )
            self.control = RoutingControl(
                module,
                moe_layers_before=sum(pattern[:first_layer]),
                num_moe_layers=sum(pattern),
            )

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self.control is not None

    @property
    def num_layers(self) -> int:
        """MoE layers of the whole model (the ``L`` of routing tensors; 0 for a dense model)."""
        return self.control.num_layers if self.control is not None else 0

    def check(self, batch: TrainBatch) -> None:
        """Refuse routing on a dense model or routing of the wrong shape, naming the field.

        Raises:
            ConfigError: ``batch.routed_experts`` on a dense model, of the wrong shape, or naming
                an expert the model does not have.
        """
        routed = batch.routed_experts
        if routed is None:
            return
        if self.control is None:
            raise ConfigError(
                "rollout.routing_replay: the batch carries routed_experts but the policy's model "
                f"({self._text_config.model_type}) has no mixture-of-experts "
                "layers; set rollout.routing_replay to 'off' for a dense model."
            )
        want = (self.control.num_layers, self.control.top_k)
        if tuple(routed.shape[1:]) != want:
            raise ConfigError(
                f"rollout.routing_replay: routed_experts has [layers, top_k] = "
                f"{list(routed.shape[1:])} but the model has {list(want)}; the routing was "
                "recorded from a different model."
            )
        experts = int(self._text_config.num_experts)
        if routed.numel() and int(routed.max()) >= experts:
            raise ConfigError(
                f"rollout.routing_replay: routed_experts holds expert id {int(routed.max())} but "
                f"the model has {experts} experts; the routing was recorded from a different "
                "model."
            )

    def begin(self, mb: TrainBatch, prep: dict[str, torch.Tensor] | None) -> None:
        """Set (or clear) the replay targets of this stage's routers for micro-batch ``mb``
        (``prep``: its padded inputs, see ``MegatronPolicy._prepare``)."""
        if self.control is not None and prep is not None:
            self.control.set_targets(mb.routed_experts, prep)

    def end(self, prep: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """``[T, L_stage, K]``: this stage's routers' own choice in the last forward (``None``
        for a dense model)."""
        if self.control is None or prep is None:
            return None
        return self.control.recorded(prep)

    def join(self, parts_TLK: list[torch.Tensor], num_tokens: int) -> Any:
        """The router choices of all micro-batches and pipeline stages as ``[T, L, K]`` in the
        compact dtype (``None`` for a dense model); collective over the pipeline group."""
        if self.control is None:
            return None
        from megatron.core import parallel_state as ps

        k = self.control.top_k
        mine_TLK = (
            torch.cat(parts_TLK).cpu()
            if parts_TLK
            else torch.zeros(num_tokens, len(self.control.recorders), k, dtype=torch.long)
        )
        if self._layout.pp_size > 1:
            stages: list[Any] = [None] * self._layout.pp_size
            torch.distributed.all_gather_object(
                stages, mine_TLK, group=ps.get_pipeline_model_parallel_group()
            )
            mine_TLK = torch.cat(stages, dim=1)
        experts = int(self._text_config.num_experts)
        return mine_TLK.to(routing_dtype(experts))

    @contextlib.contextmanager
    def aux_loss_scale(self, num_micro_batches: int) -> Iterator[None]:
        """Within the block, the load-balancing loss gradient of every micro-batch is ``coeff *
        aux / (micro-batches * data-parallel size)``: summed over a step's micro-batches and
        replicas (gradients are summed), the coefficient times the mean auxiliary loss.

        The routers do not multiply it by their token count (see :class:`RoutingControl`), so
        one scale holds for every micro-batch; megatron-core's pipeline schedule resets the scale
        to 1 after each forward (its per-token-loss convention), so ``set_loss_scale`` is pinned
        to this value meanwhile.
        """
        if self.control is None:
            yield
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = torch.full(
            (1,), 1.0 / (max(1, num_micro_batches) * self._layout.dp_size), device=current_device()
        )
        saved = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda _scale: None)
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.set_loss_scale = saved
            MoEAuxLossAutoScaler.main_loss_backward_scale = None
