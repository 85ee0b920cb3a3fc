"""Sampling through the project's generators: rl-hf's :class:`~rl_hf.HFGenerator` in process.

A :class:`GeneratorSampler` serves the ``sample`` requests of one :class:`~rl_tinker.backend.BaseModel`
(``sampler: hf``). Its generator runs on a second module tree of the base model whose parameters
and buffers ARE the base model's tensors (a deep copy that keeps every tensor by identity), so
the base weights are held once: the generator adapts its own module tree in place through peft,
the training side adapts the other, and neither ever writes a base weight.

Every sampler snapshot (``save_weights_for_sampler``) is a named LoRA adapter of the generator,
loaded through its adapter-only update path (:meth:`~rl_hf.HFGenerator.load_adapter`) and asked for
per request (``GenerationRequest.adapter``), so a sampling client pinned to a snapshot keeps
sampling exactly that snapshot while its tenant trains on. At most ``max_slots`` snapshots of one
LoRA shape (rank and targets) are loaded; the least recently used one gives its slot (adapter
name) to the next snapshot, whose tensors overwrite it (``HFGenerator`` has no call that deletes an
adapter, so slots are reused instead of freed).

The base model itself (a sampler made from ``base_model``) is served by a zero adapter once any
adapter is loaded (``B = 0`` adds exact zeros), and by the bare model before.

Not thread-safe: the service's single compute thread calls it.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import shutil
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["BASE_ADAPTER", "GeneratorSampler", "SGLangSampler"]

BASE_ADAPTER = "base0"
"""Name of the zero adapter that serves the bare base model once other adapters are loaded."""


def shared_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A second module tree of ``model`` holding the very same parameter and buffer tensors
    (no weight is copied); call it before peft adapts ``model`` in place."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _requests(
    prefix: str,
    prompt: np.ndarray,
    *,
    adapter: str | None,
    num_samples: int,
    max_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    stop_ids: set[int],
    seed: int | None,
) -> list[Any]:
    """One :class:`~rl_core.types.GenerationRequest` per sample (row ``i`` seeded from
    ``seed`` and ``i`` when a seed is given)."""
    from rl_core.types import GenerationRequest, SamplingParams

    return [
        GenerationRequest(
            request_id=f"{prefix}-{i}",
            input_ids=tuple(int(t) for t in prompt),
            sampling=SamplingParams(
                temperature=temperature,
                top_p=top_p,
                top_k=max(int(top_k), 0),
                max_new_tokens=max_tokens,
                stop_token_ids=tuple(sorted(stop_ids)),
                seed=None if seed is None else (int(seed) * 1_000_003 + i) % (2**63),
            ),
            adapter=adapter,
        )
        for i in range(num_samples)
    ]


def _sequences(
    results: Sequence[Any], stop_strs: Sequence[str], tokenizer: Any
) -> list[tuple[list[int], list[float], str]]:
    """``(tokens, logprobs, "stop" | "length")`` per result, cut after the first token whose
    decoded text holds a stop string."""
    from rl_core.types import FinishReason

    out = []
    for res in results:
        toks, lps = list(res.output_ids), list(res.output_logprobs)
        reason = "stop" if res.finish_reason == FinishReason.STOP else "length"
        if stop_strs:
            for j in range(len(toks)):
                if any(s in tokenizer.decode(toks[: j + 1]) for s in stop_strs):
                    toks, lps, reason = toks[: j + 1], lps[: j + 1], "stop"
                    break
        out.append((toks, lps, reason))
    return out


class GeneratorSampler:
    """``sample`` of one base model served by an in-process :class:`~rl_hf.HFGenerator`."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        model_path: str,
        device: str,
        max_slots: int,
    ) -> None:
        """Build the generator on a weight-sharing copy of ``model`` (not yet adapted by peft).

        Args:
            model: the base model (float32, frozen, on ``device``).
            tokenizer: its tokenizer (stop strings are decoded with it).
            model_path: the model directory (recorded in the generator's config).
            device: torch device of ``model``.
            max_slots: snapshots of one LoRA shape kept loaded.
        """
        from rl_hf import HFGenerator

        dtype = next(model.parameters()).dtype
        names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
        self._linear = {
            n: (m.out_features, m.in_features)
            for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear)
        }
        self.generator = HFGenerator(
            HFGenerator.Config(
                model_path=model_path,
                device=device,
                dtype=names.get(dtype, "float32"),
                stop_on_eos=False,  # the service passes each request's stop ids itself
            ),
            model=shared_copy(model),
            tokenizer=tokenizer,
        )
        """The generator (its ``model`` shares every tensor with the base model)."""
        self.tokenizer = tokenizer
        """The base model's tokenizer."""
        self.max_slots = max_slots
        """Snapshots of one LoRA shape kept loaded."""
        self._slots: OrderedDict[str, tuple[str, tuple[Any, ...]]] = OrderedDict()
        self._names = itertools.count(1)
        self._requests = itertools.count(1)
        self._version = 0
        self._loop = asyncio.new_event_loop()

    @property
    def loaded(self) -> dict[str, str]:
        """Snapshot key -> generator adapter name, least recently used first."""
        return {k: v[0] for k, v in self._slots.items()}

    def _load(self, name: str, lora: Any, tensors: Mapping[str, torch.Tensor]) -> None:
        from rl_core.lora import AdapterInfo, peft_adapter_config

        self._version += 1
        info = AdapterInfo(name=name, config=peft_adapter_config(lora))
        with warnings.catch_warnings():
            # peft notes that an adapter on a tied LM head is not merged into the embedding
            # (never done here).
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings")
            self.generator.load_adapter(info, tensors.items(), version=self._version)

    def adapter(
        self, key: str, rank: int, alpha: float, targets: Sequence[str], tensors: Mapping[str, Any]
    ) -> str:
        """The generator adapter serving snapshot ``key`` (loaded, or reloaded into the least
        recently used slot of its shape, when it is not).

        Raises:
            WeightSyncError: the tensors do not form an adapter of the served model.
        """
        from rl_core.lora import LoRAConfig

        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key][0]
        shape = (rank, float(alpha), tuple(sorted(targets)))
        same = [k for k, (_, s) in self._slots.items() if s == shape]
        if len(same) >= self.max_slots:
            name, _ = self._slots.pop(same[0])
        else:
            name = f"s{next(self._names)}"
        lora = LoRAConfig(rank=rank, alpha=float(alpha), target_modules=shape[2], name=name)
        self._load(name, lora, tensors)
        self._slots[key] = (name, shape)
        return name

    def _base_adapter(self) -> str | None:
        """``None`` while no adapter is loaded (the bare model serves), else the zero adapter."""
        if self.generator.active_adapter is None:
            return None
        if BASE_ADAPTER not in {n for n, _ in self._slots.values()}:
            from rl_core.lora import LoRAConfig, peft_name

            module = next(iter(self._linear))
            target = module.rsplit(".", 1)[-1]
            lora = LoRAConfig(rank=1, alpha=1.0, target_modules=(target,), name=BASE_ADAPTER)
            zeros = {}
            for m, (o, i) in self._linear.items():
                if lora.targets(m):
                    zeros[peft_name(m, "A")] = torch.zeros(1, i)
                    zeros[peft_name(m, "B")] = torch.zeros(o, 1)
            self._load(BASE_ADAPTER, lora, zeros)
            self._slots["\0base"] = (BASE_ADAPTER, ("base",))
        return BASE_ADAPTER

    def sample(
        self,
        prompt: np.ndarray,
        *,
        adapter: str | None,
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        stop_ids: set[int],
        stop_strs: Sequence[str],
        seed: int | None,
    ) -> list[tuple[list[int], list[float], str]]:
        """``num_samples`` continuations of ``prompt`` with generator adapter ``adapter``
        (``None``: the base model), as ``(tokens, logprobs, "stop" | "length")``.

        Stop ids end a sample in the generator; stop strings cut it after the first token whose
        decoded text holds one (generation of that row runs on to a stop id or ``max_tokens``).
        """
        if max_tokens < 1:
            return [([], [], "length") for _ in range(num_samples)]
        if adapter is None:
            adapter = self._base_adapter()
        reqs = _requests(
            f"tinker-{next(self._requests)}",
            prompt,
            adapter=adapter,
            num_samples=num_samples,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_ids=stop_ids,
            seed=seed,
        )
        results = self._loop.run_until_complete(self.generator.generate(reqs))
        return _sequences(results, stop_strs, self.tokenizer)

    def close(self) -> None:
        """Stop the generator's worker thread."""
        self._loop.run_until_complete(self.generator.close())
        self._loop.close()


class SGLangSampler:
    """``sample`` of one base model served by :class:`~rl_sglang.SGLangGenerator` (its own
    server processes, launched with ``enable_lora``): each snapshot a LoRA adapter written in
    peft's format under ``adapter_dir`` and loaded by name (``/load_lora_adapter``), picked per
    request; the least recently used of ``max_slots`` is unloaded for the next. The base model
    is served with no adapter. Unlike the other samplers the model's EOS always ends a sample
    (SGLang honours stop ids only with its EOS on)."""

    def __init__(
        self,
        model_path: str,
        tokenizer: Any,
        *,
        adapter_dir: str,
        max_slots: int,
        options: Mapping[str, Any],
    ) -> None:
        """Launch (or attach to, with ``server_urls``) the SGLang servers.

        Args:
            model_path: the base model directory.
            tokenizer: its tokenizer (stop strings).
            adapter_dir: where snapshot adapters are written for the servers to load.
            max_slots: snapshots kept loaded.
            options: more :class:`~rl_sglang.SGLangGenerator.Config` fields (``python``,
                ``max_lora_rank``, ``lora_target_modules``, ``server_args``, ...).

        Raises:
            ConfigError: an option is not a field of the generator's config.
        """
        import dataclasses

        from rl_core.errors import ConfigError
        from rl_sglang import SGLangGenerator

        known = {f.name for f in dataclasses.fields(SGLangGenerator.Config)}
        bad = sorted(set(options) - known)
        if bad:
            raise ConfigError(
                f"sglang: {bad} are not SGLangGenerator.Config fields; use some of {sorted(known)}."
            )
        fields: dict[str, Any] = {
            "model_path": model_path,
            "enable_lora": True,
            "max_lora_rank": 64,
            "lora_target_modules": (
                "q_proj",
                "k_proj",
                "v_proj",
                "o_proj",
                "gate_proj",
                "up_proj",
                "down_proj",
            ),
            # SGLang's ignore_eos (stop_on_eos false) would ignore every stop id: the model's
            # EOS always ends a sample here, also when a request's stop list leaves it out.
            "stop_on_eos": True,
        }
        fields.update(options)
        if "python" not in fields:
            from rl_sglang._cpu_support import default_python

            if default_python().exists():
                fields["python"] = str(default_python())
        if isinstance(fields.get("lora_target_modules"), list):
            fields["lora_target_modules"] = tuple(fields["lora_target_modules"])
        self.generator = SGLangGenerator(SGLangGenerator.Config(**fields))
        """The SGLang generator."""
        self.targets = frozenset(fields["lora_target_modules"])
        """Modules its servers accept adapters on."""
        self.max_rank = int(fields["max_lora_rank"])
        """Largest adapter rank its servers accept."""
        self.tokenizer = tokenizer
        """The base model's tokenizer."""
        self.max_slots = max_slots
        """Snapshots kept loaded."""
        self.adapter_dir = Path(adapter_dir)
        """Where snapshot adapters are written."""
        self._slots: OrderedDict[str, str] = OrderedDict()
        self._names = itertools.count(1)
        self._requests = itertools.count(1)
        self._loop = asyncio.new_event_loop()

    @property
    def loaded(self) -> dict[str, str]:
        """Snapshot key -> adapter name on the servers, least recently used first."""
        return dict(self._slots)

    def adapter(
        self, key: str, rank: int, alpha: float, targets: Sequence[str], tensors: Mapping[str, Any]
    ) -> str:
        """The server adapter serving snapshot ``key`` (written and loaded when it is not).

        Raises:
            UserError: the snapshot's rank or targets are not ones the servers accept.
        """
        from rl_core.lora import LoRAConfig, save_adapter
        from rl_tinker.errors import UserError

        if key in self._slots:
            self._slots.move_to_end(key)
            return self._slots[key]
        extra = sorted(set(targets) - self.targets)
        if extra or rank > self.max_rank:
            raise UserError(
                f"sampler sglang: the servers serve adapters of rank <= {self.max_rank} on "
                f"{sorted(self.targets)}; this snapshot has rank {rank} on {sorted(targets)} "
                "(create the training client with train_unembed=False, or widen "
                "sglang.lora_target_modules / max_lora_rank)."
            )
        if len(self._slots) >= self.max_slots:
            _, old = self._slots.popitem(last=False)
            self._loop.run_until_complete(self.generator.unload_lora_adapter(old))
            shutil.rmtree(self.adapter_dir / old, ignore_errors=True)
        name = f"snap{next(self._names)}"
        lora = LoRAConfig(rank=rank, alpha=float(alpha), target_modules=tuple(targets), name=name)
        path = save_adapter(self.adapter_dir / name, tensors.items(), lora)
        self._loop.run_until_complete(self.generator.load_lora_adapter(name, str(path)))
        self._slots[key] = name
        return name

    def sample(
        self,
        prompt: np.ndarray,
        *,
        adapter: str | None,
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        stop_ids: set[int],
        stop_strs: Sequence[str],
        seed: int | None,
    ) -> list[tuple[list[int], list[float], str]]:
        """As :meth:`~rl_tinker.sampler.GeneratorSampler.sample`, on the SGLang servers."""
        if max_tokens < 1:
            return [([], [], "length") for _ in range(num_samples)]
        reqs = _requests(
            f"tinker-{next(self._requests)}",
            prompt,
            adapter=adapter,
            num_samples=num_samples,
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            stop_ids=stop_ids,
            seed=seed,
        )
        names: list[str | None] = [adapter] * num_samples
        results = self._loop.run_until_complete(self.generator.generate(reqs, lora_adapter=names))
        return _sequences(results, stop_strs, self.tokenizer)

    def close(self) -> None:
        """Stop the servers this generator launched."""
        self._loop.run_until_complete(self.generator.close())
        self._loop.close()
