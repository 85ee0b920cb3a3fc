"""Mixture-of-experts hooks of :class:`~rl_megatron.policy.MegatronPolicy`: routing replay and
the router's own choice per micro-batch and pipeline stage, the load-balancing loss scale, and
the expert-parallel export of weights (see :mod:`rl_megatron._moe`).

Tensor-name legend: ``T`` packed tokens, ``L`` MoE layers, ``K`` experts per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rl_core.errors import ConfigError
from rl_core.routing import routing_dtype
from rl_core.types import TrainBatch
from rl_megatron._moe import MoESettings, RoutingControl, moe_layer_pattern
from rl_megatron._policy_pipeline import _PolicyState


class _MoEMixin(_PolicyState):
    """Routing replay/recording and expert-parallel weight export (no-ops for a dense model)."""

    _routing: RoutingControl | None
    _moe_pattern: list[bool]

    def _moe_settings(self) -> MoESettings:
        cfg = self.config
        return MoESettings(
            ep_size=self.layout.ep_size,
            etp_size=self.layout.etp_size,
            ep_rank=self.layout.ep_rank,
            etp_rank=self.layout.etp_rank,
            aux_loss_coeff=cfg.moe_aux_loss_coeff,
        )

    def _init_routing(self) -> None:
        """Find this stage's MoE routers and install the replaying recorders."""
        self._moe_pattern = moe_layer_pattern(self.hf_config.get_text_config())
        if not any(self._moe_pattern):
            self._routing = None
            return
        first_layer = (
            int(self.module.decoder.layers[0].layer_number) - 1
            if len(self.module.decoder.layers)
            else 0
        )
        self._routing = RoutingControl(
            self.module,
            moe_layers_before=sum(self._moe_pattern[:first_layer]),
            num_moe_layers=sum(self._moe_pattern),
        )

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self._routing is not None

    def _check_routing(self, batch: TrainBatch) -> None:
        """Refuse routing on a dense model or routing of the wrong shape, naming the field."""
        routed = batch.routed_experts
        if routed is None:
            return
        if self._routing is None:
            raise ConfigError(
                "rollout.routing_replay: the batch carries routed_experts but the policy's model "
                f"({self.hf_config.get_text_config().model_type}) has no mixture-of-experts "
                "layers; set rollout.routing_replay to 'off' for a dense model."
            )
        want = (self._routing.num_layers, self._routing.top_k)
        if tuple(routed.shape[1:]) != want:
            raise ConfigError(
                f"rollout.routing_replay: routed_experts has [layers, top_k] = "
                f"{list(routed.shape[1:])} but the model has {list(want)}; the routing was "
                "recorded from a different model."
            )
        experts = int(self.hf_config.get_text_config().num_experts)
        if routed.numel() and int(routed.max()) >= experts:
            raise ConfigError(
                f"rollout.routing_replay: routed_experts holds expert id {int(routed.max())} but "
                f"the model has {experts} experts; the routing was recorded from a different "
                "model."
            )

    def _routing_begin(self, mb: TrainBatch, prep: dict[str, torch.Tensor] | None) -> None:
        """Set (or clear) the replay targets of this stage's routers for micro-batch ``mb``."""
        if self._routing is not None and prep is not None:
            self._routing.set_targets(mb.routed_experts, prep)

    def _routing_end(self, prep: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """``[T, L_stage, K]``: this stage's routers' own choice in the last forward."""
        if self._routing is None or prep is None:
            return None
        return self._routing.recorded(prep)

    def _join_stage_routing(self, parts_TLK: list[torch.Tensor], num_tokens: int) -> Any:
        """The router choices of all micro-batches and pipeline stages as ``[T, L, K]`` in the
        compact dtype (``None`` for a dense model); collective over the pipeline group."""
        if self._routing is None:
            return None
        from megatron.core import parallel_state as ps

        k = self._routing.top_k
        mine_TLK = (
            torch.cat(parts_TLK).cpu()
            if parts_TLK
            else torch.zeros(num_tokens, len(self._routing.recorders), k, dtype=torch.long)
        )
        if self.layout.pp_size > 1:
            stages: list[Any] = [None] * self.layout.pp_size
            torch.distributed.all_gather_object(
                stages, mine_TLK, group=ps.get_pipeline_model_parallel_group()
            )
            mine_TLK = torch.cat(stages, dim=1)
        experts = int(self.hf_config.get_text_config().num_experts)
        return mine_TLK.to(routing_dtype(experts))

    @contextlib.contextmanager
    def _aux_loss_scale(self, num_micro_batches: int) -> Iterator[None]:
        """Within the block, the load-balancing loss gradient of every micro-batch is ``coeff *
        aux / (micro-batches * data-parallel size)``: summed over a step's micro-batches and
        replicas (gradients are summed), the coefficient times the mean auxiliary loss.

        The routers do not multiply it by their token count (see
        :class:`~rl_megatron._moe.RoutingControl`), so one scale holds for every micro-batch;
        megatron-core's pipeline schedule resets the scale to 1 after each forward (its
        per-token-loss convention), so ``set_loss_scale`` is pinned to this value meanwhile.
        """
        if self._routing is None:
            yield
            return
        from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

        scale = torch.full(
            (1,), 1.0 / (max(1, num_micro_batches) * self.layout.dp_size), device=self._device()
        )
        saved = MoEAuxLossAutoScaler.__dict__["set_loss_scale"]
        MoEAuxLossAutoScaler.main_loss_backward_scale = scale
        MoEAuxLossAutoScaler.set_loss_scale = staticmethod(lambda _scale: None)
        try:
            yield
        finally:
            MoEAuxLossAutoScaler.set_loss_scale = saved
            MoEAuxLossAutoScaler.main_loss_backward_scale = None

    # ------------------------------------------------------------------ weights

    def _owner_ranks(self) -> dict[str, int]:
        """Exported HF name (first of each entry) -> lowest global rank holding it."""
        held = [e.hf_names[0] for e in self.weight_map.entries if e.exported]
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, held)
        owners: dict[str, int] = {}
        for rank, names in enumerate(everyone):
            for name in names:
                owners.setdefault(name, rank)
        return owners

    def _expert_parallel_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every HF weight on every rank, for layouts where experts or stages are spread: the
        ranks holding a weight gather its (expert) tensor-parallel shards, the lowest of them
        broadcasts it to the world (shape first)."""
        if not hasattr(self, "_owners"):
            self._owners = self._owner_ranks()
        device = self._device()
        me = self.layout.rank
        for entry in self._global_map.entries:
            src = self._owners[entry.hf_names[0]]
            local = self.weight_map.by_hf_name.get(entry.hf_names[0])
            mine: list[tuple[str, torch.Tensor]] = []
            if local is not None and local.exported:
                mine = list(self.weight_map.to_hf(local, self._gathered_shards(local)))
            for i, name in enumerate(entry.hf_names):
                shape_4 = torch.full((4,), -1, dtype=torch.int64, device=device)
                if me == src:
                    shape = mine[i][1].shape
                    shape_4[: len(shape)] = torch.tensor(shape, dtype=torch.int64)
                torch.distributed.broadcast(shape_4, src=src)
                shape = tuple(int(d) for d in shape_4 if d >= 0)
                tensor = (
                    mine[i][1].contiguous()
                    if me == src
                    else torch.empty(shape, dtype=self._params_dtype, device=device)
                )
                torch.distributed.broadcast(tensor, src=src)
                yield name, tensor.detach()
