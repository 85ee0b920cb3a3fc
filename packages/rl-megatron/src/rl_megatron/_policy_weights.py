"""Weight export and import of :class:`~rl_megatron.policy.MegatronPolicy`: full Hugging Face
tensors out (gathered over TP and PP), HF tensors in (sliced into this rank's shards)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from rl_core.errors import RLError, WeightSyncError
from rl_megatron._policy_pipeline import _PolicyState
from rl_megatron.convert import WeightEntry


class _WeightsMixin(_PolicyState):
    """``named_weights`` / ``load_weights`` and loading a Hugging Face directory into the shards."""

    def _shard_count(self, entry: WeightEntry) -> int:
        """How many ranks split ``entry``: the (expert) tensor-parallel size, 1 if replicated."""
        if self.weight_map.gather_dim(entry) is None:
            return 1
        return self.layout.etp_size if self.weight_map.is_expert(entry) else self.layout.tp_size

    def _gathered_shards(self, entry: WeightEntry) -> list[torch.Tensor]:
        from megatron.core import parallel_state as ps

        local = self._params[entry.mcore_name].detach()
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
        """``(hf_name, full tensor)`` for every weight, in Hugging Face ``state_dict`` order.

        Tensor-parallel shards are gathered and the vocabulary padding trimmed, so every rank
        yields the same full tensors: a collective, every rank must consume the iterator to the
        end. With tied embeddings ``lm_head.weight`` is omitted (as ``HFPolicy``). At TP=1 the
        tensors are detached views of the live weights: copy them if you keep them across a
        ``train_step``.
        """
        if self.layout.ep_size > 1:
            yield from self._expert_parallel_named_weights()
            return
        if self.layout.pp_size == 1:
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
        return self.layout.pp_size - 1

    def _pipeline_named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each stage gathers its TP shards; the owner broadcasts each HF tensor over the
        pipeline group (shape first), so every rank yields every weight."""
        from megatron.core import parallel_state as ps

        group = ps.get_pipeline_model_parallel_group()
        device = self._device()
        for entry in self._global_map.entries:
            owner = self._owner_stage(entry)
            src = torch.distributed.get_global_rank(group, owner)
            mine: list[tuple[str, torch.Tensor]] = []
            if owner == self.layout.pp_rank:
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

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy Hugging Face-named full tensors into this rank's shards and set the version.

        Collective (every rank passes the same tensors). Names and shapes are checked before any
        weight changes; names not given keep their values (a fused Megatron tensor such as qkv
        is completed from the current weights); for a tied model ``lm_head.weight`` is accepted
        and written to the shared matrix.

        Raises:
            WeightSyncError: an unknown name or a shape mismatch (nothing is changed).
        """
        self._copy_in(dict(named_tensors), error=WeightSyncError, source="load_weights")
        self._version = int(version)

    def _expected_hf_shapes(self, entry: WeightEntry) -> dict[str, tuple[int, ...]]:
        local = self._params[entry.mcore_name]
        shards = [local.detach()] * self._shard_count(entry)
        return {n: tuple(t.shape) for n, t in self.weight_map.to_hf(entry, shards)}

    def _copy_in(
        self, tensors: dict[str, torch.Tensor], *, error: type[RLError], source: str
    ) -> None:
        wm = self.weight_map
        if wm.moe_layers and any(wm.moe_layers):
            from rl_megatron._moe import unfuse_hf_experts

            tensors = unfuse_hf_experts(tensors)
        if wm.tied and "lm_head.weight" in tensors:
            lm_head = tensors.pop("lm_head.weight")
            tensors.setdefault("model.embed_tokens.weight", lm_head)
        self._global_map.check_names(list(tensors), error=error, source=source)
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
                param = self._params[entry.mcore_name]
                parts = [p.to(device=param.device, dtype=param.dtype) for p in parts]
                shard = wm.to_megatron(entry, parts, self.layout.tp_rank, self.layout.tp_size)
                param.data.copy_(shard)
        reload = getattr(getattr(self, "optimizer", None), "reload_model_params", None)
        if callable(reload):
            reload()

    def _load_hf_dir(self, path: Path, *, error: type[RLError]) -> None:
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
            from rl_megatron._moe import unfuse_hf_experts

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
        self._copy_in(tensors, error=error, source=str(path))
