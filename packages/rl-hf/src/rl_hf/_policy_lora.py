"""HFPolicy's LoRA methods (:class:`PolicyLoRAMixin`): the adapter's config and tensors, the base
view (adapters off) for the KL reference, the merged export, adapter checkpoints, dropout inside
``train_step``. The peft plumbing itself is in :mod:`rl_hf._lora`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError
from rl_core.interfaces import Policy
from rl_core.lora import LoRAConfig
from rl_core.types import LogProbOutput, TrainBatch

__all__ = ["PolicyLoRAMixin"]


class PolicyLoRAMixin:
    """LoRA methods of :class:`~rl_hf.HFPolicy` (set up by its ``__init__``: ``_peft``, the peft
    model or ``None``; ``_multi``, the multi-adapter state or ``None``; ``_base_view``)."""

    config: Any
    model: Any
    _peft: Any
    _multi: Any
    _base_view: bool

    @contextlib.contextmanager
    def _lora_dropout(self, on: bool) -> Iterator[None]:
        """The adapters' dropout active inside (``train_step`` with ``lora.dropout > 0``);
        everywhere else the model stays in eval mode, so log-probs are deterministic."""
        if not on:
            yield
            return
        from rl_hf._lora import set_lora_dropout

        set_lora_dropout(self.model, True)
        try:
            yield
        finally:
            set_lora_dropout(self.model, False)

    @property
    def lora(self) -> LoRAConfig | None:
        """``config.lora``: the adapter this policy trains, or ``None`` (full fine-tuning)."""
        return self.config.lora

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter tensors in peft naming, exactly as ``peft.get_peft_model_state_dict``
        gives them (``base_model.model.<module>.lora_A.weight`` ``[r, in]``, ``lora_B``
        ``[out, r]``), detached views of the live tensors. With several adapters
        (``lora.adapters``): every adapter's, named ``<adapter>/<peft name>``
        (:func:`rl_core.lora.adapter_tensor_name`, the multi-adapter update's naming).

        Raises:
            ConfigError: the policy has no adapter (``lora`` is not set).
        """
        if self._peft is None:
            yield from Policy.named_adapter_weights(self)
            return
        if self._multi is not None:
            yield from self._multi.named_weights()
            return
        from peft import get_peft_model_state_dict

        state = get_peft_model_state_dict(self._peft, adapter_name=self.config.lora.name)
        for name, tensor in state.items():
            yield name, tensor.detach()

    def compute_base_logprobs(self, batch: TrainBatch) -> LogProbOutput:
        """:meth:`~rl_hf.HFPolicy.compute_logprobs` of the frozen base model (adapters disabled
        through peft's ``disable_adapter()``): the KL reference without a second copy of the model.

        Raises:
            ConfigError: the policy has no adapter (``lora`` is not set).
        """
        if self._peft is None:
            return Policy.compute_base_logprobs(self, batch)
        self._base_view = True
        try:
            with self._peft.disable_adapter():
                return self.compute_logprobs(batch)
        finally:
            self._base_view = False

    def save_merged(self, directory: str | Path) -> None:
        """Write the model as :meth:`~rl_hf.HFPolicy.save` does without ``lora``: a Hugging Face
        directory of the merged weights (:meth:`~rl_hf.HFPolicy.named_weights`) that
        ``AutoModelForCausalLM`` loads, plus the state file (version only). Without ``lora`` it is
        ``save(with_optimizer=False)``.

        Raises:
            CheckpointError: transformers could not write the model directory.
        """
        out = Path(directory)
        self._save_hf(out)
        self._save_state(out, with_optimizer=False)

    def _load_adapter_checkpoint(self, src: Path, *, with_optimizer: bool) -> None:
        """:meth:`~rl_hf.HFPolicy.load` of an adapter checkpoint: its base must be this policy's
        base."""
        from rl_hf._lora import check_base, read_adapter_checkpoint
        from rl_hf.policy import STATE_FILE

        state_path = src / STATE_FILE
        if not state_path.is_file():
            raise CheckpointError(
                f"{src}: not a policy checkpoint (no {STATE_FILE}); write one with HFPolicy.save."
            )
        check_base(src, self.config.model_path)
        if self._multi is not None:
            tensors = self._multi.read_checkpoint(src)
        else:
            tensors = dict(read_adapter_checkpoint(src, self.config.lora))
        expected = {n for n, _ in self.named_adapter_weights()}
        if set(tensors) != expected:
            raise CheckpointError(
                f"{src}: adapter tensors {sorted(set(tensors) ^ expected)[:3]} do not match "
                "this policy's adapter; was it saved with other policy.lora.target_modules?"
            )
        state = self._read_state(state_path, with_optimizer=with_optimizer)
        self._copy_in(tensors, error=CheckpointError, source=str(src))
        self._restore_state(state, with_optimizer=with_optimizer)
