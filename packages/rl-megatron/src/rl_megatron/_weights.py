"""Weight exchange of :class:`~rl_megatron.policy.MegatronPolicy` with Hugging Face tensors.

:class:`HFWeights` owns this rank's HF <-> Megatron weight maps (its own stage and the whole
model) and the model's parameters as they were built (base weights, before any LoRA adapter):
full Hugging Face tensors go out gathered over tensor, pipeline and expert parallel ranks, and
come in sliced into this rank's shards. The optimizer is not its business: a caller that changes
weights under a built optimizer reloads the optimizer's copy itself.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import ConfigError, RLError
from rl_megatron._moe import MoESettings, unfuse_hf_experts
from rl_megatron.convert import HFWeightMap, WeightEntry
from rl_megatron.parallel import ParallelLayout, current_device

__all__ = ["HFWeights"]


class HFWeights:
    """Full Hugging Face tensors out of and into one rank's shards of a Megatron ``GPTModel``."""

    def __init__(
        self,
        module: Any,
        hf_config: Any,
        layout: ParallelLayout,
        *,
        num_layers: int,
        padded_vocab: int,
        moe: MoESettings,
        params_dtype: torch.dtype,
    ) -> None:
        """Map ``module``'s parameters (this rank's stage of a model of ``num_layers`` layers
        built from ``hf_config``) to Hugging Face names and set Megatron's tensor-parallel
        attributes on them.

        Raises:
            ConfigError: the model has parameters the converter does not map (a Megatron option
                changed the architecture).
        """
        self._layout = layout
        self._params_dtype = params_dtype
        self._layers_per_stage = num_layers // layout.pp_size
        self._owners: dict[str, int] | None = None
        layer_numbers = {
            i: int(layer.layer_number) - 1 for i, layer in enumerate(module.decoder.layers)
        }
        self.weight_map = HFWeightMap(
            hf_config,
            layers=layer_numbers,
            pre_process=module.pre_process,
            post_process=module.post_process,
            padded_vocab=padded_vocab,
            moe=moe,
        )
        """The HF <-> Megatron weight mapping of this rank's stage."""
        self.global_map = HFWeightMap(
            hf_config,
            layers={i: i for i in range(num_layers)},
            pre_process=True,
            post_process=True,
            padded_vocab=padded_vocab,
        )
        """The mapping of the whole model (every layer, both ends)."""
        self.params: dict[str, torch.nn.Parameter] = dict(module.named_parameters())
        """The model's parameters by Megatron name, as built (base weights only)."""
        self._check_param_coverage()
        self._mark_tensor_parallel_params()

    def _check_param_coverage(self) -> None:
        mapped = {e.mcore_name for e in self.weight_map.entries}
        unmapped = sorted(set(self.params) - mapped)
        if unmapped:
            raise ConfigError(
                f"policy.megatron_args: the Megatron model has parameters {unmapped[:3]} that the "
                "HF converter does not map; an option changed the architecture, remove it."
            )

    def _mark_tensor_parallel_params(self) -> None:
        """Set Megatron's ``tensor_model_parallel`` / ``partition_dim`` attributes.

        megatron-core 0.16 sets them only while initialising weights; the model is built with
        ``perform_initialization=False`` (the HF weights overwrite them anyway), and without the
        attributes the gradient norm counts only TP rank 0's shards.
        """
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        for entry in self.weight_map.entries:
            dim = self.weight_map.gather_dim(entry)
            param = self.params[entry.mcore_name]
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(param, attr):
                    delattr(param, attr)
            set_tensor_model_parallel_attributes(
                param, dim is not None, -1 if dim is None else dim, 1
            )

    # ------------------------------------------------------------------ out

    def _shard_count(self, entry: WeightEntry) -> int:
        """How many ranks split ``entry``: the (expert) tensor-parallel size, 1 if replicated."""
        if self.weight_map.gather_dim(entry) is None:
            return 1
        return self._layout.etp_size if self.weight_map.is_expert(entry) else self._layout.tp_size

    def _gathered_shards(self, entry: WeightEntry) -> list[torch.Tensor]:
        from megatron.core import parallel_state as ps

        local = self.params[entry.mcore_name].detach()
        count = self._shard_count(entry)
        if count == 1:
            return [local]
        group = (
            ps.get_expert_tensor_parallel_group()
            if self.weight_map.is_expert(entry)
            else ps.get_tensor_model_parallel_group()
        )
        shards = [torch.empty_like(local) for _ in range(count)]
        torch.distributed.all_gather(shards, local.contiguous(), group=group)
        return shards

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every weight, in Hugging Face ``state_dict`` order
        (collective: every rank must consume the iterator to the end; see
        :meth:`rl_megatron.policy.MegatronPolicy.named_weights`)."""
        if self._layout.ep_size > 1:
            yield from self._expert_parallel_named_weights()
            return
        if self._layout.pp_size == 1:
            for entry in self.weight_map.entries:
                for name, tensor in self.weight_map.to_hf(entry, self._gathered_shards(entry)):
                    yield name, tensor.detach()
            return
        yield from self._pipeline_named_weights()

    def _owner_stage(self, entry: WeightEntry) -> int:
        """Pipeline stage that holds ``entry`` of the global (all-layers) map."""
        name = entry.mcore_name
        if name.startswith("embedding."):
            return 0
        if name.startswith("decoder.layers."):
            return int(name.split(".")[2]) // self._layers_per_stage
        return self._layout.pp_size - 1

    def _pipeline_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each stage gathers its TP shards; the owner broadcasts each HF tensor over the
        pipeline group (shape first), so every rank yields every weight."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        device = current_device()
        for entry in self.global_map.entries:
            owner = self._owner_stage(entry)
            src = torch.distributed.get_global_rank(group, owner)
            mine: list[tuple[str, torch.Tensor]] = []
            if owner == self._layout.pp_rank:
                local = self.weight_map.by_hf_name[entry.hf_names[0]]
                mine = list(self.weight_map.to_hf(local, self._gathered_shards(local)))
            for i, name in enumerate(entry.hf_names):
                shape_4 = torch.full((4,), -1, dtype=torch.int64, device=device)
                if mine:
                    shape = mine[i][1].shape
                    shape_4[: len(shape)] = torch.tensor(shape, dtype=torch.int64)
                torch.distributed.broadcast(shape_4, src=src, group=group)
                shape = tuple(int(d) for d in shape_4 if d >= 0)
                tensor = (
                    mine[i][1].contiguous()
                    if mine
                    else torch.empty(shape, dtype=self._params_dtype, device=device)
                )
                torch.distributed.broadcast(tensor, src=src, group=group)
                yield name, tensor.detach()

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
        if self._owners is None:
            self._owners = self._owner_ranks()
        device = current_device()
        me = self._layout.rank
        for entry in self.global_map.entries:
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

    # ------------------------------------------------------------------ in

    def _expected_hf_shapes(self, entry: WeightEntry) -> dict[str, tuple[int, ...]]:
        local = self.params[entry.mcore_name]
        shards = [local.detach()] * self._shard_count(entry)
        return {n: tuple(t.shape) for n, t in self.weight_map.to_hf(entry, shards)}

    def copy_in(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        error: type[RLError],
        source: str,
    ) -> None:
        """Copy Hugging Face-named full tensors into this rank's shards (collective: every rank
        passes the same tensors). Names and shapes are checked before any weight changes; names
        not given keep their values (a fused Megatron tensor such as qkv is completed from the
        current weights); for a tied model ``lm_head.weight`` goes to the shared matrix.

        Raises:
            error: an unknown name or a shape mismatch, the message starting with ``source``
                (nothing is changed).
        """
        tensors = dict(named_tensors)
        wm = self.weight_map
        if wm.moe_layers and any(wm.moe_layers):
            tensors = unfuse_hf_experts(tensors)
        if wm.tied and "lm_head.weight" in tensors:
            lm_head = tensors.pop("lm_head.weight")
            tensors.setdefault("model.embed_tokens.weight", lm_head)
        self.global_map.check_names(list(tensors), error=error, source=source)
        # Pipeline stages take the names they hold (the owner stage checks the shape).
        tensors = {n: t for n, t in tensors.items() if n in wm.by_hf_name}
        touched = [e for e in wm.entries if any(n in tensors for n in e.hf_names)]
        for entry in touched:
            expected = self._expected_hf_shapes(entry)
            for name in entry.hf_names:
                if name in tensors and tuple(tensors[name].shape) != expected[name]:
                    raise error(
                        f"{source}: weight {name!r} has shape {tuple(tensors[name].shape)}, the "
                        f"model expects {expected[name]}; is it from a different model config?"
                    )
        with torch.no_grad():
            for entry in touched:
                if not all(n in tensors for n in entry.hf_names):
                    current = dict(wm.to_hf(entry, self._gathered_shards(entry)))
                    parts = [tensors.get(n, current[n]) for n in entry.hf_names]
                else:
                    parts = [tensors[n] for n in entry.hf_names]
                param = self.params[entry.mcore_name]
                parts = [p.to(device=param.device, dtype=param.dtype) for p in parts]
                shard = wm.to_megatron(entry, parts, self._layout.tp_rank, self._layout.tp_size)
                param.data.copy_(shard)

    def load_hf_dir(self, path: Path, *, error: type[RLError]) -> None:
        """Read the ``*.safetensors`` weights of a Hugging Face directory into the shards
        (collective, as :meth:`copy_in`; nothing in the files executes).

        Raises:
            error: no weights, a weight missing, or one of the wrong shape.
        """
        from safetensors import safe_open

        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise error(f"{path}: no *.safetensors weights; save the model with save_pretrained.")
        wanted = {n for e in self.weight_map.entries for n in e.hf_names}
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    fused_experts = name.endswith((".mlp.experts.gate_up_proj", ".down_proj"))
                    if (
                        name in wanted
                        or (self.weight_map.tied and name == "lm_head.weight")
                        or (fused_experts and ".mlp.experts." in name)
                    ):
                        tensors[name] = handle.get_tensor(name)
        if any(self.weight_map.moe_layers):
            unfused = unfuse_hf_experts(tensors)
            tensors = {n: t for n, t in unfused.items() if n in wanted or n == "lm_head.weight"}
        if self.weight_map.tied and "model.embed_tokens.weight" in tensors:
            tensors.pop("lm_head.weight", None)
        missing = sorted(wanted - set(tensors))
        if missing:
            raise error(
                f"{path}: weights {missing[:3]} missing from the checkpoint; was it saved from a "
                "different model?"
            )
        self.copy_in(tensors.items(), error=error, source=str(path))
