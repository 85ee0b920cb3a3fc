"""Hugging Face <-> Megatron-core: model config and weights for Llama, Qwen2, Qwen3 and
Qwen3-MoE (the mixture-of-experts parts live in :mod:`rl_megatron._moe`).

The Megatron model is built from the Hugging Face ``config.json`` alone: no architecture flag is
restated by hand. Megatron-native options (fusions, recompute, dtypes, ...) pass through as a
dictionary validated against megatron-core's own config dataclasses
(:func:`transformer_config_from_hf`).

Weights map name by name (local layer spec, ``get_gpt_layer_local_spec``)::

    model.embed_tokens.weight                    embedding.word_embeddings.weight   vocab rows
    model.layers.i.input_layernorm.weight        decoder.layers.i.input_layernorm.weight
    model.layers.i.self_attn.{q,k,v}_proj.*      decoder.layers.i.self_attention.linear_qkv.*
    model.layers.i.self_attn.o_proj.weight       decoder.layers.i.self_attention.linear_proj.weight
    model.layers.i.self_attn.{q,k}_norm.weight   decoder.layers.i.self_attention.{q,k}_layernorm.weight
    model.layers.i.post_attention_layernorm.*    decoder.layers.i.pre_mlp_layernorm.weight
    model.layers.i.mlp.{gate,up}_proj.weight     decoder.layers.i.mlp.linear_fc1.weight
    model.layers.i.mlp.down_proj.weight          decoder.layers.i.mlp.linear_fc2.weight
    model.norm.weight                            decoder.final_layernorm.weight
    lm_head.weight                               output_layer.weight (untied models)

Mixture-of-experts layers (Qwen3-MoE) map their router and experts instead of the dense MLP::

    model.layers.i.mlp.gate.weight                       decoder.layers.i.mlp.router.weight
    model.layers.i.mlp.experts.e.{gate,up}_proj.weight   ...mlp.experts.local_experts.j.linear_fc1
    model.layers.i.mlp.experts.e.down_proj.weight        ...mlp.experts.local_experts.j.linear_fc2

where expert ``e`` is local expert ``j = e - ep_rank * E / ep_size`` of expert-parallel rank
``ep_rank``, sharded like the dense fc1/fc2 over the *expert* tensor-parallel group.

Layouts: ``linear_qkv`` interleaves q, k and v per query group (``[G, (q_per_group + 2) * D, H]``
flattened); ``linear_fc1`` is ``[gate; up]``. Tensor parallelism splits qkv by group, fc1's gate
and up halves separately, ``linear_proj``/``linear_fc2`` along their input dimension and the
vocabulary rows (padded to a multiple of the TP size times ``make_vocab_size_divisible_by``; the
padding rows are zero on load and trimmed on export). Both directions are exact copies.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.errors import ConfigError, RLError
from rl_megatron._moe import (
    EXPERT_KINDS,
    MoESettings,
    expert_entries,
    moe_layer_pattern,
    moe_transformer_kwargs,
)

__all__ = [
    "ARCHITECTURE_FIELDS",
    "POLICY_OWNED_FIELDS",
    "SUPPORTED_MODEL_TYPES",
    "HFWeightMap",
    "WeightEntry",
    "padded_vocab_size",
    "split_megatron_args",
    "transformer_config_from_hf",
]

SUPPORTED_MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")
"""Hugging Face ``model_type`` values this converter handles."""

ARCHITECTURE_FIELDS: frozenset[str] = frozenset(
    {
        "num_layers",
        "hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "ffn_hidden_size",
        "normalization",
        "layernorm_epsilon",
        "gated_linear_unit",
        "activation_func",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "calculate_per_token_loss",
        "share_embeddings_and_output_weights",
        "num_moe_experts",
        "moe_router_topk",
        "moe_ffn_hidden_size",
        "moe_layer_freq",
        "moe_router_pre_softmax",
        "moe_router_score_function",
        "moe_shared_expert_intermediate_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
        "moe_aux_loss_coeff",
        "moe_enable_routing_replay",
        "sequence_parallel",
    }
)
"""Megatron settings derived from the Hugging Face config or the policy's parallel layout; a
``megatron_args`` entry may not override them (change ``config.json`` or the policy config)."""


POLICY_OWNED_FIELDS: dict[str, str] = {
    "lr": "lr",
    "weight_decay": "weight_decay",
    "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2",
    "adam_eps": "adam_eps",
    "clip_grad": "grad_clip",
    "use_distributed_optimizer": "use_distributed_optimizer",
    "params_dtype": "dtype",
    "pipeline_dtype": "dtype",
    "bf16": "dtype",
    "fp16": "dtype",
    "optimizer": "(Adam only)",
}
"""Megatron options that a ``MegatronPolicy.Config`` field sets (the value names that field)."""


def padded_vocab_size(vocab_size: int, tp_size: int, divisible_by: int) -> int:
    """Vocabulary rounded up to a multiple of ``divisible_by * tp_size`` (Megatron's rule)."""
    multiple = max(1, divisible_by) * tp_size
    return -(-vocab_size // multiple) * multiple


def _hf_text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def _rope_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(
            f"config.json rope_parameters.rope_type: {rope_type!r} is not supported by the "
            "rl-megatron converter (only 'default' RoPE); use a model without RoPE scaling."
        )
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None))
    if theta is None:
        raise ConfigError("config.json: no rope_theta (in rope_parameters or at top level).")
    return float(theta)


def split_megatron_args(megatron_args: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Sort pass-through options into the megatron-core config dataclasses that own them.

    Each key must be a field of ``TransformerConfig``, ``DistributedDataParallelConfig`` or
    ``OptimizerConfig`` (a key present in several goes to all of them), and must not be one of
    :data:`ARCHITECTURE_FIELDS`.

    Returns:
        ``{"transformer": {...}, "ddp": {...}, "optimizer": {...}}``.

    Raises:
        ConfigError: an unknown key (with the closest field names) or an architecture key.
    """
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    owners = {
        "transformer": {f.name for f in dataclasses.fields(TransformerConfig)},
        "ddp": {f.name for f in dataclasses.fields(DistributedDataParallelConfig)},
        "optimizer": {f.name for f in dataclasses.fields(OptimizerConfig)},
    }
    out: dict[str, dict[str, Any]] = {k: {} for k in owners}
    every = set().union(*owners.values())
    for key, value in megatron_args.items():
        if key in ARCHITECTURE_FIELDS:
            raise ConfigError(
                f"policy.megatron_args.{key}: set from the Hugging Face config.json or the policy "
                "config (tp_size, pp_size, ...), not as a Megatron option; remove it."
            )
        if key in POLICY_OWNED_FIELDS:
            raise ConfigError(
                f"policy.megatron_args.{key}: set by the policy config field "
                f"policy.{POLICY_OWNED_FIELDS[key]}; remove it from megatron_args."
            )
        hits = [name for name, fields in owners.items() if key in fields]
        if not hits:
            close = difflib.get_close_matches(key, sorted(every), n=3)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ConfigError(
                f"policy.megatron_args.{key}: not a field of megatron-core's TransformerConfig, "
                f"DistributedDataParallelConfig or OptimizerConfig.{hint}"
            )
        for name in hits:
            out[name][key] = value
    return out


def _check_supported(cfg: Any) -> str:
    """The ``model_type`` of HF text config ``cfg``, after refusing what the converter cannot
    map (model type, activation, biases, sliding window), naming the config.json field."""
    model_type = getattr(cfg, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"config.json model_type: {model_type!r} is not supported by rl-megatron (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})."
        )
    act = getattr(cfg, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config.json hidden_act: {act!r}; only 'silu' (SwiGLU) is supported.")
    if model_type == "llama" and (
        getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)
    ):
        raise ConfigError(
            "config.json attention_bias/mlp_bias: Llama with biases is not supported by the "
            "rl-megatron converter; use attention_bias=false and mlp_bias=false."
        )
    if model_type in ("qwen3", "qwen3_moe") and getattr(cfg, "attention_bias", False):
        raise ConfigError(
            "config.json attention_bias: Qwen3 with attention biases is not supported."
        )
    if getattr(cfg, "use_sliding_window", False):
        raise ConfigError(
            "config.json use_sliding_window: sliding-window attention is not supported."
        )
    return str(model_type)


def _transformer_kwargs(
    cfg: Any, *, tp_size: int, pp_size: int, params_dtype: torch.dtype, moe: MoESettings
) -> dict[str, Any]:
    """``TransformerConfig`` keyword arguments for HF text config ``cfg`` (before overrides)."""
    model_type = _check_supported(cfg)
    heads = int(cfg.num_attention_heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    if kv_heads % tp_size:
        raise ConfigError(
            f"policy.tp_size: {tp_size} does not divide the {kv_heads} key/value heads of "
            "config.json; pick a tp_size that divides num_key_value_heads."
        )
    bf16 = params_dtype == torch.bfloat16
    kwargs: dict[str, Any] = {
        "num_layers": int(cfg.num_hidden_layers),
        "hidden_size": int(cfg.hidden_size),
        "num_attention_heads": heads,
        "num_query_groups": kv_heads,
        "kv_channels": head_dim,
        "ffn_hidden_size": int(cfg.intermediate_size),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(cfg.rms_norm_eps),
        "gated_linear_unit": True,
        "activation_func": torch.nn.functional.silu,
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "qk_layernorm": model_type in ("qwen3", "qwen3_moe"),
        "tensor_model_parallel_size": tp_size,
        "pipeline_model_parallel_size": pp_size,
        # Gradients are summed over data-parallel ranks (TrainBatch.loss_weights fold the mean).
        "calculate_per_token_loss": True,
        # CPU-safe, exact defaults; megatron_args may turn fusions on (GPU).
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "masked_softmax_fusion": False,
        "bias_activation_fusion": False,
        "apply_rope_fusion": False,
        "persist_layer_norm": False,
        "bias_dropout_fusion": False,
        "gradient_accumulation_fusion": False,
        "use_cpu_initialization": True,
        "perform_initialization": False,
        "params_dtype": params_dtype,
        "pipeline_dtype": params_dtype,
        "bf16": bf16,
        "attention_softmax_in_fp32": True,
    }
    kwargs.update(moe_transformer_kwargs(cfg, tp_size=tp_size, moe=moe))
    return kwargs


def transformer_config_from_hf(
    hf_config: Any,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    overrides: Mapping[str, Any] | None = None,
    moe: MoESettings | None = None,
) -> tuple[Any, dict[str, Any]]:
    """Megatron ``TransformerConfig`` and ``GPTModel`` keyword arguments for a HF config.

    Args:
        hf_config: a ``transformers`` config of a supported ``model_type``.
        tp_size: tensor-parallel size.
        pp_size: pipeline-parallel size.
        params_dtype: parameter dtype (``torch.bfloat16`` also turns on Megatron's bf16 mode).
        overrides: ``TransformerConfig`` fields to set (the ``"transformer"`` part of
            :func:`split_megatron_args`); CPU-safe defaults (no fusions, no dropout) otherwise.
        moe: expert-parallel layout and router settings of a mixture-of-experts model
            (ignored for a dense one; ``MoESettings()`` if omitted).

    Returns:
        ``(transformer_config, gpt_model_kwargs)``; the kwargs hold ``vocab_size`` (unpadded),
        ``max_sequence_length``, ``share_embeddings_and_output_weights``,
        ``position_embedding_type`` and ``rotary_base``.

    Raises:
        ConfigError: the model type or one of its options is not supported, naming the field.
    """
    from megatron.core.transformer import TransformerConfig

    cfg = _hf_text_config(hf_config)
    kwargs = _transformer_kwargs(
        cfg, tp_size=tp_size, pp_size=pp_size, params_dtype=params_dtype, moe=moe or MoESettings()
    )
    for key, value in (overrides or {}).items():
        if key in ARCHITECTURE_FIELDS:
            raise ConfigError(f"policy.megatron_args.{key}: derived from config.json; remove it.")
        kwargs[key] = value
    try:
        tconfig = TransformerConfig(**kwargs)
    except (AssertionError, ValueError, TypeError) as exc:
        raise ConfigError(
            f"policy.megatron_args: megatron-core rejects the model config ({exc}); check the "
            "pass-through options against TransformerConfig."
        ) from exc
    if pp_size > 1 and "variable_seq_lengths" not in (overrides or {}):
        # Micro-batches are padded to their own [N, L]: pipeline stages exchange shapes. Set
        # after construction: the MoE dispatcher check of __post_init__ concerns the allgather
        # dispatcher only (MoE models use the all-to-all one, see rl_megatron._moe).
        tconfig.variable_seq_lengths = True
    gpt_kwargs = {
        "vocab_size": int(cfg.vocab_size),
        "max_sequence_length": int(getattr(cfg, "max_position_embeddings", 4096)),
        "share_embeddings_and_output_weights": bool(getattr(cfg, "tie_word_embeddings", False)),
        "position_embedding_type": "rope",
        "rotary_base": _rope_theta(cfg),
    }
    return tconfig, gpt_kwargs


# ----------------------------------------------------------------------------------------------
# Weight map
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WeightEntry:
    """One Megatron parameter and the Hugging Face tensors it is made of."""

    mcore_name: str
    """Name in the (unwrapped) GPTModel of the owning pipeline stage."""
    hf_names: tuple[str, ...]
    """Hugging Face names, in the order the Megatron tensor concatenates them."""
    kind: str
    """``replicated``, ``column`` (dim 0), ``row`` (dim 1), ``vocab``, ``qkv``, ``fc1``,
    ``router`` (replicated), ``expert_fc1`` / ``expert_row`` (like ``fc1`` / ``row`` over the
    expert tensor-parallel group)."""
    exported: bool = True
    """False for the last pipeline stage's copy of a tied embedding: loaded, never exported."""


class HFWeightMap:
    """The Hugging Face <-> Megatron weight mapping of one model on one pipeline stage.

    Built from the HF config, the local layer numbers of this stage and whether it holds the
    embedding / the output layer. :meth:`to_megatron` turns full HF tensors into this TP rank's
    shards; :meth:`to_hf` turns TP-gathered Megatron tensors back into HF tensors.
    """

    def __init__(
        self,
        hf_config: Any,
        *,
        layers: Mapping[int, int],
        pre_process: bool,
        post_process: bool,
        padded_vocab: int,
        moe: MoESettings | None = None,
    ) -> None:
        """``layers`` maps each local layer index of this stage to its global (HF) index;
        ``moe`` gives the experts this rank holds (all of them when omitted)."""
        cfg = _hf_text_config(hf_config)
        self._cfg = cfg
        self.moe = moe or MoESettings()
        """Expert-parallel rank/size and expert tensor-parallel rank/size of this map."""
        self.moe_layers = moe_layer_pattern(cfg)
        """Per global layer, whether it is a mixture-of-experts layer."""
        self.model_type = str(cfg.model_type)
        """HF ``model_type``."""
        self.vocab_size = int(cfg.vocab_size)
        """True (unpadded) vocabulary size."""
        self.padded_vocab = padded_vocab
        """Rows of the Megatron embedding / output matrices."""
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        """Whether the LM head shares the embedding matrix."""
        self.num_heads = int(cfg.num_attention_heads)
        self.num_groups = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.hidden = int(cfg.hidden_size)
        entries: list[WeightEntry] = []
        if pre_process:
            entries.append(
                WeightEntry(
                    "embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"
                )
            )
        for local, glob in sorted(layers.items()):
            entries += self._layer_entries(local, glob)
        if post_process:
            entries += self._output_entries(pre_process=pre_process)
        self.entries: tuple[WeightEntry, ...] = tuple(entries)
        """Every parameter of this stage, in Hugging Face ``state_dict`` order."""
        self.by_hf_name: dict[str, WeightEntry] = {n: e for e in entries for n in e.hf_names}
        """HF name -> the entry that holds it."""

    def _layer_entries(self, local: int, glob: int) -> list[WeightEntry]:
        """The entries of decoder layer ``local`` of this stage (HF layer ``glob``)."""
        qkv_bias = self.model_type == "qwen2"
        entries: list[WeightEntry] = []
        hf = f"model.layers.{glob}."
        mc = f"decoder.layers.{local}."
        entries.append(
            WeightEntry(
                mc + "self_attention.linear_qkv.weight",
                tuple(hf + f"self_attn.{p}_proj.weight" for p in "qkv"),
                "qkv",
            )
        )
        if qkv_bias:
            entries.append(
                WeightEntry(
                    mc + "self_attention.linear_qkv.bias",
                    tuple(hf + f"self_attn.{p}_proj.bias" for p in "qkv"),
                    "qkv",
                )
            )
        entries.append(
            WeightEntry(
                mc + "self_attention.linear_proj.weight",
                (hf + "self_attn.o_proj.weight",),
                "row",
            )
        )
        if self.model_type in ("qwen3", "qwen3_moe"):
            for p in "qk":
                entries.append(
                    WeightEntry(
                        mc + f"self_attention.{p}_layernorm.weight",
                        (hf + f"self_attn.{p}_norm.weight",),
                        "replicated",
                    )
                )
        if self.moe_layers[glob]:
            entries += expert_entries(WeightEntry, self._cfg, local=local, glob=glob, moe=self.moe)
        else:
            entries.append(
                WeightEntry(
                    mc + "mlp.linear_fc1.weight",
                    (hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"),
                    "fc1",
                )
            )
            entries.append(
                WeightEntry(mc + "mlp.linear_fc2.weight", (hf + "mlp.down_proj.weight",), "row")
            )
        entries.append(
            WeightEntry(
                mc + "input_layernorm.weight", (hf + "input_layernorm.weight",), "replicated"
            )
        )
        entries.append(
            WeightEntry(
                mc + "pre_mlp_layernorm.weight",
                (hf + "post_attention_layernorm.weight",),
                "replicated",
            )
        )
        return entries

    def _output_entries(self, *, pre_process: bool) -> list[WeightEntry]:
        """The entries of the last stage: final norm, and the LM head (or, for a tied model on a
        stage without the embedding, the embedding copy it holds)."""
        entries: list[WeightEntry] = []
        entries.append(
            WeightEntry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated")
        )
        if not self.tied:
            entries.append(WeightEntry("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not pre_process:  # pipeline: the last stage holds a copy of the embedding
            entries.append(
                WeightEntry(
                    "output_layer.weight",
                    ("model.embed_tokens.weight",),
                    "vocab",
                    exported=False,
                )
            )
        return entries

    # ------------------------------------------------------------------ HF -> Megatron

    def _qkv_full(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``[G * (q_per_group + 2) * D, ...]``: q, k, v interleaved per query group."""
        g, d = self.num_groups, self.head_dim
        rest = q.shape[1:]
        q_g = q.reshape(g, -1, *rest)
        k_g = k.reshape(g, d, *rest)
        v_g = v.reshape(g, d, *rest)
        return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *rest)

    def to_megatron(
        self, entry: WeightEntry, tensors: list[torch.Tensor], tp_rank: int, tp_size: int
    ) -> torch.Tensor:
        """This TP rank's shard of ``entry`` from its full HF tensors (in ``hf_names`` order);
        expert weights are cut by the map's expert tensor-parallel rank and size instead."""
        kind = entry.kind
        if kind in EXPERT_KINDS:
            kind = "fc1" if kind == "expert_fc1" else "row"
            tp_rank, tp_size = self.moe.etp_rank, self.moe.etp_size or tp_size
        if kind in ("replicated", "router"):
            return tensors[0]
        if kind == "vocab":
            full = tensors[0]
            pad = self.padded_vocab - full.shape[0]
            if pad:
                full = torch.cat([full, full.new_zeros(pad, *full.shape[1:])])
            return full.chunk(tp_size, dim=0)[tp_rank]
        if kind == "column":
            return tensors[0].chunk(tp_size, dim=0)[tp_rank]
        if kind == "row":
            return tensors[0].chunk(tp_size, dim=1)[tp_rank]
        if kind == "qkv":
            return self._qkv_full(*tensors).chunk(tp_size, dim=0)[tp_rank]
        if kind == "fc1":
            gate, up = tensors
            return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]])
        raise AssertionError(kind)

    # ------------------------------------------------------------------ Megatron -> HF

    def gather_dim(self, entry: WeightEntry) -> int | None:
        """Dimension along which TP shards of ``entry`` concatenate (``None``: replicated)."""
        return {"replicated": None, "router": None, "row": 1, "expert_row": 1}.get(entry.kind, 0)

    def is_expert(self, entry: WeightEntry) -> bool:
        """True for an expert weight (sharded over the expert tensor-parallel group, held by
        one expert-parallel rank)."""
        return entry.kind in EXPERT_KINDS

    def to_hf(
        self, entry: WeightEntry, shards: list[torch.Tensor]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """HF ``(name, tensor)`` pairs of ``entry`` from its TP shards (rank order; expert
        weights: expert tensor-parallel shards)."""
        kind = {"expert_fc1": "fc1", "expert_row": "row", "router": "replicated"}.get(
            entry.kind, entry.kind
        )
        if kind == "replicated":
            yield entry.hf_names[0], shards[0]
            return
        if kind == "row":
            yield entry.hf_names[0], torch.cat(shards, dim=1)
            return
        if kind in ("vocab", "column"):
            full = torch.cat(shards, dim=0)
            yield entry.hf_names[0], full[: self.vocab_size] if kind == "vocab" else full
            return
        if kind == "fc1":
            halves = [s.chunk(2, dim=0) for s in shards]
            yield entry.hf_names[0], torch.cat([h[0] for h in halves])
            yield entry.hf_names[1], torch.cat([h[1] for h in halves])
            return
        if kind == "qkv":
            full = torch.cat(shards, dim=0)
            g, d = self.num_groups, self.head_dim
            q_per_group = self.num_heads // g
            rest = full.shape[1:]
            grouped = full.reshape(g, (q_per_group + 2) * d, *rest)
            q, k, v = grouped.split([q_per_group * d, d, d], dim=1)
            for name, part in zip(entry.hf_names, (q, k, v)):
                yield name, part.reshape(-1, *rest)
            return
        raise AssertionError(kind)

    def check_names(self, names: list[str], *, error: type[RLError], source: str) -> None:
        """Raise ``error`` naming the first HF name this map does not know."""
        for name in names:
            if name not in self.by_hf_name and not (self.tied and name == "lm_head.weight"):
                known = next(iter(self.by_hf_name), "model.embed_tokens.weight")
                raise error(
                    f"{source}: unknown weight {name!r}; expected Hugging Face names such as "
                    f"{known!r} of this {self.model_type} model."
                )
