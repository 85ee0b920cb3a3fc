"""The LoRA part :class:`~rl_hf.HFPolicy` owns (:class:`PolicyLoRA`): the peft wrapper of its model
and, with several adapters, their state; the adapter tensors, the base view (adapters off) for the
KL reference, the merged weights, adapter checkpoints and dropout inside ``train_step``. The peft
plumbing itself is in :mod:`rl_hf._lora`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError
from rl_core.lora import LoRAConfig
from rl_core.types import TrainBatch

__all__ = ["PolicyLoRA"]


class PolicyLoRA:
    """The adapters of one policy's model: built by :class:`~rl_hf.HFPolicy` when
    ``config.lora`` is set, which wraps ``model`` in place through peft.

    Its state: :attr:`peft` (the ``PeftModel`` wrapper), :attr:`multi` (the
    :class:`~rl_hf._lora.MultiAdapters` of ``lora.adapters``, or ``None``) and whether the base
    view is on (inside :meth:`base_view`: adapters disabled, none to pick per sequence).
    """

    def __init__(self, model: torch.nn.Module, lora: LoRAConfig, *, seed: int, base_model: str):
        """Inject ``lora``'s adapters into ``model`` (initialised from ``seed``); ``base_model``
        is the model directory adapter checkpoints name as their base."""
        from rl_hf import _lora

        self.config = lora
        """The adapter settings (``policy.lora``)."""
        self.model = model
        """The ``transformers`` model the adapters are injected into."""
        self.base_model = base_model
        """The base model's directory (written into and checked against adapter checkpoints)."""
        self.peft: Any = _lora.wrap(model, lora, seed=seed)
        """The peft wrapper of :attr:`model`."""
        model.eval()  # the injected adapter modules are built in training mode
        self.multi: Any = _lora.MultiAdapters(self.peft, lora) if lora.multi else None
        """:class:`~rl_hf._lora.MultiAdapters` with several adapters, else ``None``."""
        self._base_view = False

    @contextlib.contextmanager
    def dropout(self) -> Iterator[None]:
        """The adapters' dropout active inside when ``lora.dropout > 0`` (``train_step``);
        everywhere else the model stays in eval mode, so log-probs are deterministic."""
        if not self.config.dropout > 0:
            yield
            return
        from rl_hf._lora import set_lora_dropout

        set_lora_dropout(self.model, True)
        try:
            yield
        finally:
            set_lora_dropout(self.model, False)

    @contextlib.contextmanager
    def base_view(self) -> Iterator[None]:
        """Inside, the model is the frozen base (peft's ``disable_adapter()``) and micro-batches
        are not cut by adapter."""
        self._base_view = True
        try:
            with self.peft.disable_adapter():
                yield
        finally:
            self._base_view = False

    def micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        """``batch.micro_batches()``, cut by adapter with several (``MultiAdapters.runs``)."""
        if self.multi is None or self._base_view:
            return iter(batch.micro_batches())
        return self.multi.runs(batch)

    def grad_norms(self) -> dict[str, float]:
        """Each adapter's gradient norm with several adapters (metrics), else nothing."""
        return self.multi.grad_norms() if self.multi is not None else {}

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter tensors (see :meth:`rl_hf.HFPolicy.named_adapter_weights`)."""
        if self.multi is not None:
            yield from self.multi.named_weights()
            return
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.peft, adapter_name=self.config.name)
        for name, tensor in state.items():
            yield name, tensor.detach()

    def merged_weights(self, skip: frozenset[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The merged weights (``W + scaling * B @ A``) under Hugging Face names, ``skip`` left
        out."""
        from rl_hf._lora import merged_named_weights

        yield from merged_named_weights(self.model, skip=skip)

    def live_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The model's ``state_dict`` renamed as ``load_weights`` takes it: base weights under
        Hugging Face names, adapter tensors under peft names."""
        if self.multi is not None:
            return self.multi.live_state(state)
        adapter = f".{self.config.name}."
        live = {}
        for name, tensor in state.items():
            if ".lora_" in name:  # model...q_proj.lora_A.<adapter>.weight -> peft name
                live["base_model.model." + name.replace(adapter, ".")] = tensor
            else:
                live[name.replace(".base_layer.", ".")] = tensor
        return live

    def write_checkpoint(self, out: Path) -> None:
        """The adapter in peft format into ``out`` (one directory per adapter with several)."""
        from rl_hf._lora import write_adapter_checkpoint

        out.mkdir(parents=True, exist_ok=True)
        if self.multi is not None:
            self.multi.write_checkpoint(out, self.base_model)
        else:
            write_adapter_checkpoint(out, self.peft, self.config, self.base_model)

    def read_checkpoint(self, src: Path) -> dict[str, torch.Tensor]:
        """The adapter tensors of the checkpoint in ``src`` (peft names).

        Raises:
            CheckpointError: it was trained on another base, or its tensors are not this
                adapter's.
        """
        from rl_hf._lora import check_base, read_adapter_checkpoint

        check_base(src, self.base_model)
        if self.multi is not None:
            tensors = self.multi.read_checkpoint(src)
        else:
            tensors = dict(read_adapter_checkpoint(src, self.config))
        expected = {n for n, _ in self.named_adapter_weights()}
        if set(tensors) != expected:
            raise CheckpointError(
                f"{src}: adapter tensors {sorted(set(tensors) ^ expected)[:3]} do not match "
                "this policy's adapter; was it saved with other policy.lora.target_modules?"
            )
        return tensors
