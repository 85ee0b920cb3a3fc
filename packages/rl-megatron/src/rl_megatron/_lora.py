"""LoRA adapters on :class:`~rl_megatron.policy.MegatronPolicy`'s linear layers (``policy.lora``).

Each adapted Megatron linear layer gets a small adapter module (a sibling registered on its parent,
``self_attention.lora_linear_qkv``, ``mlp.lora_linear_fc1``, ...) and a forward hook that adds
``scaling * B (A x)`` to the layer's output. The adapter keeps one ``A`` ``[r, in]`` and ``B``
``[out, r]`` per Hugging Face projection (peft's layout), so a peft adapter loads in and comes
out unchanged:

============================  ==========================  ===================================
Megatron layer                HF projections (targets)    tensor parallelism
============================  ==========================  ===================================
``linear_qkv`` (column)       ``q_proj k_proj v_proj``    ``A`` replicated, ``B`` split on out
``linear_proj`` (row)         ``o_proj``                  ``A`` split on in, ``B`` replicated
``linear_fc1`` (column)       ``gate_proj up_proj``       ``A`` replicated, ``B`` split on out
``linear_fc2`` (row)          ``down_proj``               ``A`` split on in, ``B`` replicated
============================  ==========================  ===================================

A fused column layer's delta is ``h @ B_fused^T`` with ``h = [A_q x, A_k x, A_v x]`` ``[.., P r]``
and ``B_fused`` ``[out/tp, P r]`` the per-projection ``B`` shards placed block-wise into the
layer's own output layout (q, k, v interleaved per query group; ``[gate; up]``), so the delta lands
exactly where the fused weight's rows are. ``h`` passes Megatron's ``copy_to`` region (all-reduce of
its gradient over TP: every rank's ``B`` shard contributes to ``A``'s gradient); a row layer's
partial ``A x_shard`` is all-reduced over TP before ``B``. Pipeline stages hold their own layers'
adapters. The base weights are frozen, so Megatron's DDP buffers and (distributed) optimizer hold
adapter parameters only.

Refused with a :class:`~rl_core.errors.ConfigError`: sequence parallelism, mixture-of-experts
models, and target names this model has no linear layer for.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rl_core.errors import ConfigError, WeightSyncError
from rl_core.lora import (
    LoRAConfig,
    load_adapter,
    merge_adapter,
    module_of,
    peft_name,
)
from rl_megatron.parallel import ParallelLayout, current_device

__all__ = ["LoRAAdapter", "LoRASpec", "PolicyLoRA", "is_adapter_key", "read_adapter"]


@dataclass(frozen=True, slots=True)
class LoRASpec:
    """One adaptable Megatron linear layer of a decoder layer."""

    parent: str
    """Attribute path of its parent module inside a ``TransformerLayer``."""
    linear: str
    """The linear layer's attribute on the parent."""
    kind: str
    """``qkv`` / ``fc1`` (fused column parallel) or ``row`` (row parallel)."""
    parts: tuple[str, ...]
    """Hugging Face module suffixes (after ``model.layers.i.``) of its projections, in layout
    order."""


SPECS = (
    LoRASpec(
        "self_attention",
        "linear_qkv",
        "qkv",
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ),
    LoRASpec("self_attention", "linear_proj", "row", ("self_attn.o_proj",)),
    LoRASpec("mlp", "linear_fc1", "fc1", ("mlp.gate_proj", "mlp.up_proj")),
    LoRASpec("mlp", "linear_fc2", "row", ("mlp.down_proj",)),
)
"""Every adaptable layer, in Hugging Face module order (q, k, v, o, gate, up, down)."""


def _short(part: str) -> str:
    return part.rsplit(".", 1)[-1]


class LoRAAdapter(torch.nn.Module):
    """The adapter of one Megatron linear layer: ``A``/``B`` of each targeted projection (this
    rank's shards) and the delta it adds to the layer's output."""

    def __init__(
        self,
        spec: LoRASpec,
        parts: dict[str, tuple[torch.Tensor, torch.Tensor]],
        *,
        scaling: float,
        dropout: float,
        groups: tuple[int, int, int],
    ) -> None:
        """``parts`` maps a projection's short name (``q_proj``) to this rank's ``(A, B)``;
        ``groups`` is ``(local query groups, query heads per group, head dim)`` (qkv only)."""
        super().__init__()
        self.spec = spec
        self.scaling = scaling
        self.dropout = dropout
        self.groups = groups
        self.lora_A = torch.nn.ParameterDict(
            {n: torch.nn.Parameter(a) for n, (a, _) in parts.items()}
        )
        self.lora_B = torch.nn.ParameterDict(
            {n: torch.nn.Parameter(b) for n, (_, b) in parts.items()}
        )
        self.disabled = False

    def _fused_B(self) -> torch.Tensor:
        """``[out_local, P r]``: each ``B`` shard in its column block, rows in the layer's
        layout (missing projections are zero rows)."""
        names = list(self.lora_A)
        r = self.lora_A[names[0]].shape[0]
        width = len(names) * r
        ref = self.lora_B[names[0]]

        def block(part: str, rows: int) -> torch.Tensor:
            name = _short(part)
            if name not in self.lora_B:
                return ref.new_zeros(rows, width)
            i = names.index(name)
            return F.pad(self.lora_B[name], (i * r, width - (i + 1) * r))

        if self.spec.kind == "row":
            return self.lora_B[names[0]]
        if self.spec.kind == "fc1":
            rows = next(b.shape[0] for b in self.lora_B.values())
            return torch.cat([block(p, rows) for p in self.spec.parts])
        g, q_per_group, d = self.groups
        q = block(self.spec.parts[0], g * q_per_group * d).reshape(g, q_per_group * d, width)
        k = block(self.spec.parts[1], g * d).reshape(g, d, width)
        v = block(self.spec.parts[2], g * d).reshape(g, d, width)
        return torch.cat([q, k, v], dim=1).reshape(-1, width)

    def delta(self, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A dropout(x))`` in the layer's output layout (this rank's columns)."""
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        drop = self.dropout > 0 and self.training and torch.is_grad_enabled()
        hs = [
            F.linear(F.dropout(x, self.dropout) if drop else x, a.to(x.dtype))
            for a in self.lora_A.values()
        ]
        h = torch.cat(hs, dim=-1)
        if self.spec.kind == "row":
            h = reduce_from_tensor_model_parallel_region(h, ps.get_tensor_model_parallel_group())
        else:
            h = copy_to_tensor_model_parallel_region(h, ps.get_tensor_model_parallel_group())
        return self.scaling * F.linear(h, self._fused_B().to(h.dtype))

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple[Any, ...] = (), metadata: Any = None
    ) -> dict[str, Any]:
        """Megatron distributed-checkpoint view: each ``B`` of a column layer split on dim 0,
        each ``A`` of a row layer on dim 1 over TP (layout-independent keys)."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = self.state_dict(prefix="", keep_vars=True)
        axis = {
            (f"lora_A.{n}" if self.spec.kind == "row" else f"lora_B.{n}"): (
                1 if self.spec.kind == "row" else 0
            )
            for n in self.lora_A
        }
        return make_sharded_tensors_for_checkpoint(state, prefix, axis, sharded_offsets)


def _linear_hook(adapter: LoRAAdapter) -> Any:
    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if adapter.disabled:
            return output
        x = args[0] if args else kwargs["input_"]
        out, bias = output
        return out + adapter.delta(x).to(out.dtype), bias

    return hook


def is_adapter_key(key: str) -> bool:
    """Whether a key of the model's sharded state dict belongs to an adapter."""
    return ".lora_linear_" in key


def read_adapter(directory: str, lora: LoRAConfig | None) -> dict[str, torch.Tensor]:
    """The tensors of a peft adapter directory (``adapter_config.json`` + safetensors, as peft's
    ``save_pretrained`` or :func:`rl_core.lora.save_adapter` write it), checked against
    ``policy.lora``: rank, alpha, rslora and targets must be equal.

    Raises:
        ConfigError: ``lora`` is ``None``, or the adapter's settings differ.
    """
    tensors, saved = load_adapter(directory)
    if lora is None:
        raise ConfigError(
            f"{directory}: loading a LoRA adapter needs policy.lora (e.g. rank: {saved.rank})."
        )
    mine = (lora.rank, lora.scaling, sorted(lora.target_modules))
    theirs = (saved.rank, saved.scaling, sorted(saved.target_modules))
    if mine != theirs:
        raise ConfigError(
            f"{directory}: adapter has rank/scaling/targets {theirs}, policy.lora has {mine}; "
            "set policy.lora's rank, alpha, use_rslora and target_modules to the adapter's."
        )
    return tensors


class PolicyLoRA:
    """The LoRA part of a policy (``policy.lora``): adapters on this rank's decoder layers, their
    export and import in peft naming, merged weights, and switching the adapters off."""

    def __init__(
        self,
        lora: LoRAConfig,
        module: Any,
        hf_config: Any,
        tconfig: Any,
        layout: ParallelLayout,
        *,
        seed: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Check that ``module`` (this rank's stage of the ``GPTModel`` built with ``tconfig``
        from ``hf_config``) can be adapted, freeze it, and attach a fresh adapter to each
        targeted layer (peft's init: ``A`` Kaiming-uniform from a generator seeded by ``seed``
        and the layer, ``B`` zero).

        Raises:
            ConfigError: a mixture-of-experts model, sequence parallelism, or a target name this
                model has no linear layer for.
        """
        self.config = lora
        """The adapter settings (``policy.lora``)."""
        self._text_config = hf_config.get_text_config()
        self._layout = layout
        self._params_dtype = params_dtype
        self._num_layers = int(tconfig.num_layers)
        self._layers_per_stage = self._num_layers // layout.pp_size
        self._check_supported(tconfig, str(hf_config.model_type))
        self.adapters: dict[tuple[int, str], LoRAAdapter] = {}
        """This stage's adapters by ``(global layer, Megatron linear name)``."""
        self._attach(module, seed)

    # ------------------------------------------------------------------ construction

    def _check_supported(self, tconfig: Any, model_type: str) -> None:
        if tconfig.num_moe_experts:
            raise ConfigError(
                "policy.lora: LoRA on a mixture-of-experts model is not supported by "
                "MegatronPolicy; use a dense model, or HFPolicy (type: hf) with policy.lora."
            )
        if tconfig.sequence_parallel:
            raise ConfigError(
                "policy.lora: LoRA with sequence parallelism is not supported by MegatronPolicy; "
                "remove sequence_parallel from policy.megatron_args."
            )
        known = {_short(p) for s in SPECS for p in s.parts}
        unknown = sorted(set(self.config.target_modules) - known)
        if unknown:
            raise ConfigError(
                f"policy.lora.target_modules: {unknown} are not linear layers of a "
                f"{model_type} decoder layer adaptable by MegatronPolicy; choose "
                f"from {sorted(known)}."
            )

    def _full_shape(self, part: str, which: str) -> tuple[int, int]:
        """``A`` ``[r, in]`` / ``B`` ``[out, r]`` of projection ``part`` (full, unsharded)."""
        cfg = self._text_config
        heads = int(cfg.num_attention_heads)
        groups = int(getattr(cfg, "num_key_value_heads", None) or heads)
        d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        h, ffn = int(cfg.hidden_size), int(cfg.intermediate_size)
        in_out = {
            "q_proj": (h, heads * d),
            "k_proj": (h, groups * d),
            "v_proj": (h, groups * d),
            "o_proj": (heads * d, h),
            "gate_proj": (h, ffn),
            "up_proj": (h, ffn),
            "down_proj": (ffn, h),
        }[_short(part)]
        r = self.config.rank
        return (r, in_out[0]) if which == "A" else (in_out[1], r)

    def _shard(self, spec: LoRASpec, which: str, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's slice of a full ``A`` or ``B``."""
        tp, rank = self._layout.tp_size, self._layout.tp_rank
        if spec.kind == "row" and which == "A":
            return full.chunk(tp, dim=1)[rank].clone()
        if spec.kind != "row" and which == "B":
            return full.chunk(tp, dim=0)[rank].clone()
        return full.clone()

    def _attach(self, module: Any, seed: int) -> None:
        """Freeze the base, then add a fresh adapter to each targeted layer."""
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        lora = self.config
        for p in module.parameters():
            p.requires_grad_(False)
        cfg = self._text_config
        heads = int(cfg.num_attention_heads)
        n_groups = int(getattr(cfg, "num_key_value_heads", None) or heads)
        d = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
        groups = (n_groups // self._layout.tp_size, heads // n_groups, d)
        for layer in module.decoder.layers:
            index = int(layer.layer_number) - 1
            for s_i, spec in enumerate(SPECS):
                parts = {}
                for p_i, part in enumerate(spec.parts):
                    if _short(part) not in lora.target_modules:
                        continue
                    gen = torch.Generator().manual_seed(
                        seed * 1_000_003 + index * 64 + s_i * 8 + p_i
                    )
                    shape_a = self._full_shape(part, "A")
                    bound = 1.0 / math.sqrt(shape_a[1])
                    a_full = (torch.rand(shape_a, generator=gen) * 2 - 1) * bound
                    b_full = torch.zeros(self._full_shape(part, "B"))
                    parts[_short(part)] = (
                        self._shard(spec, "A", a_full).to(self._params_dtype),
                        self._shard(spec, "B", b_full).to(self._params_dtype),
                    )
                if not parts:
                    continue
                adapter = LoRAAdapter(
                    spec, parts, scaling=lora.scaling, dropout=lora.dropout, groups=groups
                )
                device = next(module.parameters()).device
                adapter.to(device)
                for name in adapter.lora_A:
                    split = adapter.lora_A[name] if spec.kind == "row" else adapter.lora_B[name]
                    dim = 1 if spec.kind == "row" else 0
                    set_tensor_model_parallel_attributes(split, True, dim, 1)
                parent = layer.get_submodule(spec.parent)
                parent.add_module(f"lora_{spec.linear}", adapter)
                getattr(parent, spec.linear).register_forward_hook(
                    _linear_hook(adapter), with_kwargs=True
                )
                self.adapters[(index, spec.linear)] = adapter

    # ------------------------------------------------------------------ adapters in and out

    def _adapter_names(self) -> Iterator[tuple[int, LoRASpec, str]]:
        """``(global layer, spec, part)`` of every adapted projection, in peft order."""
        for index in range(self._num_layers):
            for spec in SPECS:
                for part in spec.parts:
                    if _short(part) in self.config.target_modules:
                        yield index, spec, part

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full adapter tensors in peft naming (``base_model.model.model.layers.0.self_attn.
        q_proj.lora_A.weight`` ...), in peft's order: gathered over TP and broadcast from the
        stage that holds each layer, so every rank yields every tensor (collective; consume it
        to the end on every rank)."""
        from megatron.core import parallel_state as ps

        device = current_device()
        pp_group = ps.get_pipeline_model_parallel_group() if self._layout.pp_size > 1 else None
        for index, spec, part in self._adapter_names():
            owner = index // self._layers_per_stage
            adapter = self.adapters.get((index, spec.linear))
            for which in ("A", "B"):
                full: torch.Tensor | None = None
                if adapter is not None:
                    local = (adapter.lora_A if which == "A" else adapter.lora_B)[_short(part)]
                    full = self._gather_tp(spec, which, local.detach())
                if pp_group is not None:
                    if full is None:
                        shape = self._full_shape(part, which)
                        full = torch.empty(shape, dtype=self._params_dtype, device=device)
                    src = torch.distributed.get_global_rank(pp_group, owner)
                    full = full.contiguous()
                    torch.distributed.broadcast(full, src=src, group=pp_group)
                assert full is not None
                yield peft_name(f"model.layers.{index}.{part}", which), full

    def _gather_tp(self, spec: LoRASpec, which: str, local: torch.Tensor) -> torch.Tensor:
        from megatron.core import parallel_state as ps

        split = (spec.kind == "row") == (which == "A")
        if self._layout.tp_size == 1 or not split:
            return local.clone()
        shards = [torch.empty_like(local) for _ in range(self._layout.tp_size)]
        torch.distributed.all_gather(
            shards, local.contiguous(), group=ps.get_tensor_model_parallel_group()
        )
        return torch.cat(shards, dim=1 if spec.kind == "row" else 0)

    def load_adapter_weights(self, named_tensors: Any) -> None:
        """Copy full peft-named adapter tensors into this rank's shards (all of them, checked
        before anything changes; the optimizer's copy is the caller's to reload).

        Raises:
            WeightSyncError: a tensor is missing, unknown or of the wrong shape.
        """
        tensors = {peft_name(*module_of(n)): t for n, t in named_tensors}
        expected = {
            peft_name(f"model.layers.{i}.{part}", w): (spec, part, i, w)
            for i, spec, part in self._adapter_names()
            for w in ("A", "B")
        }
        missing, unknown = (
            sorted(set(expected) - set(tensors)),
            sorted(set(tensors) - set(expected)),
        )
        if missing or unknown:
            raise WeightSyncError(
                f"adapter tensors do not match policy.lora: missing {missing[:3]}, unknown "
                f"{unknown[:3]}; was it trained with other target_modules or another model?"
            )
        for name, (_, part, _, w) in expected.items():
            if tuple(tensors[name].shape) != self._full_shape(part, w):
                raise WeightSyncError(
                    f"adapter tensor {name!r} has shape {tuple(tensors[name].shape)}, expected "
                    f"{self._full_shape(part, w)} (policy.lora.rank and the model)."
                )
        with torch.no_grad():
            for name, (spec, part, i, w) in expected.items():
                adapter = self.adapters.get((i, spec.linear))
                if adapter is None:  # another pipeline stage's layer
                    continue
                param = (adapter.lora_A if w == "A" else adapter.lora_B)[_short(part)]
                shard = self._shard(spec, w, tensors[name].to(param.device, param.dtype))
                param.data.copy_(shard)

    # ------------------------------------------------------------------ merged weights, base

    def merged(
        self, base_weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """``base_weights`` (full HF tensors, collective) with the adapted ones merged
        (``W + scaling * B @ A``); the adapter is gathered first (collective)."""
        adapter = dict(self.named_adapter_weights())
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in adapter.items():
            module = module_of(name)[0]
            pairs.setdefault(f"{module}.weight", {})[name] = tensor
        for name, tensor in base_weights:
            if name in pairs:
                tensor = merge_adapter({name: tensor}, pairs[name], self.config)[name]
            yield name, tensor

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Within the block the model runs as the frozen base (adapters skipped)."""
        for a in self.adapters.values():
            a.disabled = True
        try:
            yield
        finally:
            for a in self.adapters.values():
                a.disabled = False
