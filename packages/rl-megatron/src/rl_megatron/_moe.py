"""Mixture-of-experts parts of :class:`~rl_megatron.policy.MegatronPolicy` (Qwen3-MoE).

Two things live here (routing replay is :mod:`rl_megatron._routing`):

* :func:`moe_transformer_kwargs` and :func:`moe_layer_pattern`: the megatron-core MoE settings
  of a Hugging Face ``qwen3_moe`` config (routed experts as ``SequentialMLP``, a top-k softmax
  router whose top-k probabilities are renormalised exactly when ``norm_topk_prob`` is set, the
  all-to-all token dispatcher, the load-balancing loss coefficient, ``mlp_only_layers`` /
  ``decoder_sparse_step`` as ``moe_layer_freq``);
* :func:`expert_entries`: the weight-map entries of one MoE layer (router and this rank's
  experts; see :mod:`rl_megatron.convert`).

megatron-core 0.16.1 notes (CPU, no TransformerEngine): the router's gating linear reads a
``te_general_gemm`` name that is only defined when TransformerEngine imports
(:func:`patch_missing_te_gemm` defines it as ``None``, the torch path); the all-to-all dispatcher
creates a CUDA side stream (redirected by :mod:`rl_megatron._cpu_support`); gloo implements
``all_to_all_single`` with uneven splits, so the all-to-all dispatcher runs on CPU as it does
on GPU. MoE with tensor parallelism trains only with sequence parallelism in megatron-core, so
it is switched on whenever ``tp_size > 1``.

Tensor-name legend: ``E`` experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rl_core.errors import ConfigError
from rl_core.moe_weights import unfuse_expert_tensors

__all__ = [
    "MoESettings",
    "expert_entries",
    "is_moe_config",
    "moe_layer_pattern",
    "moe_transformer_kwargs",
    "patch_missing_te_gemm",
]

EXPERT_KINDS = frozenset({"expert_fc1", "expert_row"})
"""Weight-map kinds sharded over the expert tensor-parallel group (not the attention one)."""


@dataclass(frozen=True, slots=True)
class MoESettings:
    """Expert-parallel layout and router options of a mixture-of-experts policy."""

    ep_size: int = 1
    """Expert-parallel size (experts are split evenly over it)."""
    etp_size: int | None = None
    """Expert tensor-parallel size; ``None`` = the tensor-parallel size."""
    ep_rank: int = 0
    """This rank's place in the expert-parallel group."""
    etp_rank: int = 0
    """This rank's place in the expert tensor-parallel group."""
    aux_loss_coeff: float | None = None
    """Load-balancing loss coefficient; ``None`` = ``router_aux_loss_coef`` of config.json."""


def is_moe_config(cfg: Any) -> bool:
    """True for a Hugging Face text config with routed experts (``qwen3_moe``)."""
    return (
        str(getattr(cfg, "model_type", "")) == "qwen3_moe"
        and int(getattr(cfg, "num_experts", 0) or 0) > 0
    )


def moe_layer_pattern(cfg: Any) -> list[bool]:
    """Per decoder layer, whether it is a MoE layer (Qwen3-MoE's rule: not in
    ``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``)."""
    n = int(cfg.num_hidden_layers)
    if not is_moe_config(cfg):
        return [False] * n
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return [i not in only_dense and (i + 1) % step == 0 for i in range(n)]


def moe_transformer_kwargs(cfg: Any, *, tp_size: int, moe: MoESettings) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` MoE fields for HF config ``cfg`` (``{}`` if dense).

    Raises:
        ConfigError: expert parallelism on a dense model, or sizes that do not divide the
            experts / the expert FFN, naming the field to change.
    """
    if not is_moe_config(cfg):
        if moe.ep_size > 1:
            raise ConfigError(
                f"policy.expert_model_parallel_size: {moe.ep_size}, but config.json "
                f"(model_type {getattr(cfg, 'model_type', None)!r}) has no experts; use 1."
            )
        return {}
    experts = int(cfg.num_experts)
    top_k = int(cfg.num_experts_per_tok)
    ffn = int(cfg.moe_intermediate_size)
    etp = moe.etp_size or tp_size
    if experts % moe.ep_size:
        raise ConfigError(
            f"policy.expert_model_parallel_size: {moe.ep_size} does not divide the "
            f"{experts} experts of config.json (num_experts); pick a divisor."
        )
    if ffn % etp:
        raise ConfigError(
            f"policy.expert_tensor_parallel_size: {etp} does not divide moe_intermediate_size "
            f"{ffn} of config.json; pick a divisor."
        )
    if not 1 <= top_k <= experts:
        raise ConfigError(
            f"config.json num_experts_per_tok: {top_k} must be between 1 and num_experts "
            f"({experts})."
        )
    coeff = moe.aux_loss_coeff
    if coeff is None:
        coeff = float(getattr(cfg, "router_aux_loss_coef", 0.0) or 0.0)
    pattern = moe_layer_pattern(cfg)
    return {
        "num_moe_experts": experts,
        "moe_router_topk": top_k,
        "moe_ffn_hidden_size": ffn,
        "moe_layer_freq": [int(x) for x in pattern],
        # HF: softmax over all experts, top-k, then renormalise iff norm_topk_prob. Megatron:
        # without pre-softmax, softmax over the top-k logits = the renormalised probabilities;
        # with pre-softmax, the top-k of the full softmax, not renormalised.
        "moe_router_pre_softmax": not bool(getattr(cfg, "norm_topk_prob", True)),
        "moe_router_score_function": "softmax",
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": coeff,
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_enable_routing_replay": True,
        "expert_model_parallel_size": moe.ep_size,
        "expert_tensor_parallel_size": etp,
        "sequence_parallel": tp_size > 1,
    }


def patch_missing_te_gemm() -> None:
    """Define ``moe_utils.te_general_gemm = None`` when TransformerEngine is absent.

    megatron-core 0.16.1 imports ``te_general_gemm`` only inside its TransformerEngine ``try``
    block but reads it unconditionally in the router's gating linear (a ``NameError`` without
    TE); ``None`` selects its torch path.
    """
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


class SequenceParallelTorchNorm:
    """megatron-core's ``WrappedTorchNorm`` (torch ``RMSNorm``) that also runs under sequence
    parallelism: the weight is marked ``sequence_parallel`` so that ``finalize_model_grads``
    sums its gradient over the tensor-parallel ranks (each saw a slice of the sequence).
    ``WrappedTorchNorm`` refuses sequence parallelism only because it does not set that mark."""

    def __new__(
        cls,
        config: Any,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ) -> Any:
        if config.normalization != "RMSNorm":
            raise ConfigError(
                f"config.json: normalization {config.normalization!r}; only RMSNorm is supported."
            )
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def use_sequence_parallel_norms(spec: Any) -> Any:
    """A copy of ``spec`` (a megatron-core layer/block spec tree) with every
    ``WrappedTorchNorm`` replaced by :class:`SequenceParallelTorchNorm`."""
    import copy
    import dataclasses as dc

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    seen: set[int] = set()

    def walk(node: Any) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, list | tuple):
            for item in node:
                walk(item)
            return
        if not (dc.is_dataclass(node) and not isinstance(node, type)):
            return
        for f in dc.fields(node):
            value = getattr(node, f.name)
            if value is WrappedTorchNorm:
                setattr(node, f.name, SequenceParallelTorchNorm)
            else:
                walk(value)

    spec = copy.deepcopy(spec)
    walk(spec)
    return spec


def expert_entries(
    entry_type: Any, cfg: Any, *, local: int, glob: int, moe: MoESettings
) -> list[Any]:
    """Weight-map entries (``entry_type`` = :class:`~rl_megatron.convert.WeightEntry`) of MoE
    layer ``glob`` (local index ``local``): the router, then this expert-parallel rank's
    experts in global order."""
    hf = f"model.layers.{glob}.mlp."
    mc = f"decoder.layers.{local}.mlp."
    entries = [entry_type(mc + "router.weight", (hf + "gate.weight",), "router")]
    per_rank = int(cfg.num_experts) // moe.ep_size
    for j in range(per_rank):
        e = moe.ep_rank * per_rank + j
        local_mc = f"{mc}experts.local_experts.{j}."
        entries.append(
            entry_type(
                local_mc + "linear_fc1.weight",
                (f"{hf}experts.{e}.gate_proj.weight", f"{hf}experts.{e}.up_proj.weight"),
                "expert_fc1",
            )
        )
        entries.append(
            entry_type(
                local_mc + "linear_fc2.weight", (f"{hf}experts.{e}.down_proj.weight",), "expert_row"
            )
        )
    return entries


def unfuse_hf_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split transformers' in-memory fused expert tensors into the per-expert checkpoint names
    this converter uses (:func:`rl_core.moe_weights.unfuse_expert_tensors`); other names pass
    through."""
    return dict(unfuse_expert_tensors(tensors.items()))
