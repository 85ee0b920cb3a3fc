"""Checkpoints of :class:`~rl_megatron.policy.MegatronPolicy`: a Hugging Face directory plus,
optionally, a Megatron distributed checkpoint of weights and optimizer state."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError
from rl_megatron._policy_pipeline import _PolicyState

STATE_FILE = "rl_policy_state.pt"
"""File (next to the HF weights) holding version, schedule position and layout; written last."""
CHECKPOINT_FORMAT = 2
"""Version of the checkpoint layout in :data:`STATE_FILE`: 2 = optimizer state in
megatron-core's ``torch_dist`` format (1 = per-rank files under :data:`OPTIM_DIR`)."""
OPTIM_DIR = "megatron_optimizer"
"""Format 1's sub-directory of per-rank optimizer-state files (no longer written or read)."""


class _CheckpointMixin(_PolicyState):
    """``save`` / ``load`` (collective), with the state file written last."""

    def _layout_record(self) -> dict[str, Any]:
        return {
            "tp_size": self.layout.tp_size,
            "pp_size": self.layout.pp_size,
            "dp_size": self.layout.dp_size,
            "use_distributed_optimizer": self.config.use_distributed_optimizer,
        }

    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Write a Hugging Face model directory plus, optionally, a Megatron distributed
        checkpoint of the weights and optimizer state (collective).

        Global rank 0 writes ``config.json``, ``model.safetensors`` (full tensors, HF names,
        loadable by ``AutoModelForCausalLM`` and by this policy at any layout) and the tokenizer.
        With ``with_optimizer`` all ranks write the model and optimizer state in megatron-core's
        ``torch_dist`` format under :data:`~rl_megatron.checkpoint.DIST_DIR` (loadable at another
        TP/PP/DP layout, see :mod:`rl_megatron.checkpoint`). Rank 0 removes an older
        :data:`STATE_FILE` first and writes the new one (version, schedule position, layout)
        last, after a barrier, so a directory with a state file is a complete checkpoint.
        With ``policy.lora`` rank 0 writes the adapter alone (peft format, no base weights), the
        distributed checkpoint holds the adapters and their optimizer state, and the state file
        records the base model's identity (:mod:`rl_megatron._lora`).

        Raises:
            CheckpointError: (every rank, before the optimizer state is written, so no state
                file) the distributed optimizer's state would not load back as it is; see
                :func:`~rl_megatron.checkpoint.save_distributed`.
        """

        out = Path(directory)
        rank = self.layout.rank
        lora = getattr(self.config, "lora", None)
        if lora is not None:  # the adapter alone (peft format) + its base's identity
            self._save_lora(out)
        else:
            weights = {n: t.detach().cpu().contiguous().clone() for n, t in self.named_weights()}
        if rank == 0 and lora is None:
            self._write_hf_dir(out, weights)
        torch.distributed.barrier()
        self._finish_save(out, with_optimizer=with_optimizer, lora=lora)

    def save_merged(self, directory: str | Path) -> None:
        """Write the merged model (:meth:`~rl_megatron.MegatronPolicy.named_weights`: base plus
        ``scaling * B @ A``) as a Hugging Face directory that ``AutoModelForCausalLM`` (and this
        policy without ``lora``) loads, with a state file holding the version and no optimizer state
        (collective). Without ``policy.lora`` it is ``save(with_optimizer=False)``."""
        if getattr(self.config, "lora", None) is None:
            self.save(directory, with_optimizer=False)
            return
        out = Path(directory)
        weights = {n: t.detach().cpu().contiguous().clone() for n, t in self.named_weights()}
        if self.layout.rank == 0:
            self._write_hf_dir(out, weights)
        torch.distributed.barrier()
        self._finish_save(out, with_optimizer=False, lora=None)

    def _write_hf_dir(self, out: Path, weights: dict[str, torch.Tensor]) -> None:
        """(Rank 0) config, ``model.safetensors``, generation config and tokenizer into ``out``;
        an older state file and optimizer state there are removed first."""
        from safetensors.torch import save_file

        from rl_megatron.checkpoint import DIST_DIR

        out.mkdir(parents=True, exist_ok=True)
        (out / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(out / DIST_DIR, ignore_errors=True)
        shutil.rmtree(out / OPTIM_DIR, ignore_errors=True)  # format 1 (per-rank files)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        mask = os.umask(0)  # safetensors writes 0600; give it the mode of the run's other files
        os.umask(mask)
        (out / "model.safetensors").chmod(0o666 & ~mask)
        self.hf_config.save_pretrained(str(out))
        src_gen = Path(self.config.model_path) / "generation_config.json"
        if src_gen.is_file() and src_gen.resolve() != (out / src_gen.name).resolve():
            shutil.copyfile(src_gen, out / src_gen.name)
        self.tokenizer.save_pretrained(str(out))

    def _finish_save(self, out: Path, *, with_optimizer: bool, lora: Any) -> None:
        """The optimizer state (with ``with_optimizer``) and, last, the state file (collective)."""
        from rl_megatron.checkpoint import DIST_DIR, DISTOPT_SHARDING, save_distributed

        rank = self.layout.rank
        if with_optimizer:
            save_distributed(
                self.module,
                self.optimizer,
                out / DIST_DIR,
                distributed_optimizer=self.config.use_distributed_optimizer,
                keys=self._lora_model_keys if lora is not None else None,
            )
        torch.distributed.barrier()
        if rank == 0:
            state = {
                "format": CHECKPOINT_FORMAT,
                "version": self._version,
                "applied_steps": self._applied_steps,
                "with_optimizer": with_optimizer,
                "optimizer_format": "torch_dist" if with_optimizer else None,
                "distrib_optim_sharding_type": (
                    DISTOPT_SHARDING if self.config.use_distributed_optimizer else None
                ),
                "layout": self._layout_record(),
                "lora": self._lora_record() if lora is not None else None,
            }
            tmp = out / (STATE_FILE + ".tmp")
            torch.save(state, tmp)
            tmp.replace(out / STATE_FILE)
        torch.distributed.barrier()

    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore weights, version, schedule position and (if ``with_optimizer``) optimizer
        state (collective).

        ``with_optimizer=False`` reads the Hugging Face weights, at any layout.
        ``with_optimizer=True`` reads the weights and optimizer state from the Megatron
        distributed checkpoint, at any TP/PP/DP layout of the same model and the same
        ``use_distributed_optimizer`` setting; training then continues as if uninterrupted.

        Raises:
            CheckpointError: files are missing, a weight is missing or has the wrong shape, the
                optimizer state was asked for but not saved (or saved by an older version), or
                it was saved with the other ``use_distributed_optimizer`` setting.
        """
        from rl_megatron.checkpoint import DIST_DIR, load_distributed

        src = Path(directory)
        state_path = src / STATE_FILE
        if not state_path.is_file() or not list(src.glob("*.safetensors")):
            raise CheckpointError(
                f"{src}: not a policy checkpoint (needs *.safetensors and {STATE_FILE}); write one "
                "with MegatronPolicy.save."
            )
        state = torch.load(state_path, map_location="cpu", weights_only=True)
        lora = self._check_lora_checkpoint(state_path, state.get("lora"))
        if with_optimizer:
            self._check_optimizer_checkpoint(state_path, state)
            load_distributed(
                self.module,
                self.optimizer,
                src / DIST_DIR,
                distributed_optimizer=self.config.use_distributed_optimizer,
                keys=self._lora_model_keys if lora else None,
            )
        elif lora:
            self._load_lora_checkpoint(src)
        else:
            self._load_hf_dir(src, error=CheckpointError)
        self._version = int(state["version"])
        self._applied_steps = int(state["applied_steps"])

    def _check_optimizer_checkpoint(self, state_path: Path, state: dict[str, Any]) -> None:
        """Refuse, before reading any tensor, optimizer state this policy cannot restore."""
        if not state.get("with_optimizer"):
            raise CheckpointError(
                f"{state_path}: saved without optimizer state; load with with_optimizer=False."
            )
        if state.get("optimizer_format") != "torch_dist":
            raise CheckpointError(
                f"{state_path}: the optimizer state is in checkpoint format "
                f"{state.get('format')} (per-rank files), which this version no longer reads; "
                "load with with_optimizer=False (the weights and version load, Adam restarts)."
            )
        saved = bool(state["layout"]["use_distributed_optimizer"])
        if saved != self.config.use_distributed_optimizer:
            raise CheckpointError(
                f"{state_path}: optimizer state was saved with use_distributed_optimizer={saved}, "
                f"this policy runs use_distributed_optimizer={self.config.use_distributed_optimizer}"
                f"; set policy.use_distributed_optimizer={saved} to resume (TP, PP and DP sizes "
                "may differ), or load with with_optimizer=False."
            )
