"""Checkpoints of :class:`~rl_megatron.policy.MegatronPolicy`: a Hugging Face directory (or,
with ``policy.lora``, a peft adapter directory) plus, optionally, a Megatron distributed checkpoint
of weights and optimizer state (:mod:`rl_megatron.checkpoint`), and a state file written last."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError, RLError
from rl_core.lora import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    LoRAConfig,
    base_identity,
    peft_adapter_config,
    save_adapter,
)
from rl_megatron._lora import PolicyLoRA, is_adapter_key, read_adapter
from rl_megatron._weights import HFWeights
from rl_megatron.checkpoint import DIST_DIR, DISTOPT_SHARDING, load_distributed, save_distributed
from rl_megatron.parallel import ParallelLayout

__all__ = ["CHECKPOINT_FORMAT", "OPTIM_DIR", "STATE_FILE", "PolicyCheckpoints"]

STATE_FILE = "rl_policy_state.pt"
"""File (next to the HF weights) holding version, schedule position and layout; written last."""
CHECKPOINT_FORMAT = 2
"""Version of the checkpoint layout in :data:`STATE_FILE`: 2 = optimizer state in
megatron-core's ``torch_dist`` format (1 = per-rank files under :data:`OPTIM_DIR`)."""
OPTIM_DIR = "megatron_optimizer"
"""Format 1's sub-directory of per-rank optimizer-state files (no longer written or read)."""


class PolicyCheckpoints:
    """``save`` / ``load`` of one policy's state (collective), with the state file written last.

    The version and schedule position stay the policy's: :meth:`save` is given them and
    :meth:`load` returns them.
    """

    def __init__(
        self,
        *,
        module: Any,
        optimizer: Any,
        weights: HFWeights,
        export: Callable[[], Iterable[tuple[str, torch.Tensor]]],
        lora: PolicyLoRA | None,
        layout: ParallelLayout,
        model_path: str,
        hf_config: Any,
        tokenizer: Any,
        use_distributed_optimizer: bool,
    ) -> None:
        """``module`` and ``optimizer``: the Megatron model and optimizer whose state goes into
        the distributed checkpoint; ``weights``: the HF weight exchange of ``module``;
        ``export``: the full HF tensors a saved model directory holds (the policy's
        ``named_weights``, adapters merged); ``lora``: the adapters (``None``: full
        fine-tuning); ``model_path``, ``hf_config`` and ``tokenizer``: the model the policy
        was built from."""
        self._module = module
        self._optimizer = optimizer
        self._weights = weights
        self._export = export
        self._lora = lora
        self._layout = layout
        self._model_path = model_path
        self._hf_config = hf_config
        self._tokenizer = tokenizer
        self._distributed_optimizer = use_distributed_optimizer

    @property
    def _lora_config(self) -> LoRAConfig | None:
        return self._lora.config if self._lora is not None else None

    def _layout_record(self) -> dict[str, Any]:
        return {
            "tp_size": self._layout.tp_size,
            "pp_size": self._layout.pp_size,
            "dp_size": self._layout.dp_size,
            "use_distributed_optimizer": self._distributed_optimizer,
        }

    def _reload_optimizer(self) -> None:
        """Refresh the optimizer's copy of the weights (its fp32 main weights) after a load."""
        reload = getattr(self._optimizer, "reload_model_params", None)
        if callable(reload):
            reload()

    # ------------------------------------------------------------------ save

    def save(
        self, out: Path, *, version: int, applied_steps: int, with_optimizer: bool = True
    ) -> None:
        """Write the checkpoint of :meth:`rl_megatron.policy.MegatronPolicy.save` into ``out``
        (collective).

        Raises:
            CheckpointError: (every rank, before the optimizer state is written, so no state
                file) the distributed optimizer's state would not load back as it is.
        """
        rank = self._layout.rank
        lora = self._lora_config
        if lora is not None:  # the adapter alone (peft format) + its base's identity
            self._save_adapter(out, lora)
        else:
            weights = {n: t.detach().cpu().contiguous().clone() for n, t in self._export()}
        if rank == 0 and lora is None:
            self._write_hf_dir(out, weights)
        torch.distributed.barrier()
        self._finish_save(
            out,
            version=version,
            applied_steps=applied_steps,
            with_optimizer=with_optimizer,
            lora=lora,
        )

    def save_merged(self, out: Path, *, version: int, applied_steps: int) -> None:
        """Write the merged model (base plus ``scaling * B @ A``) as a Hugging Face directory and
        a state file without optimizer state (collective); without ``policy.lora`` it is
        ``save(with_optimizer=False)``."""
        if self._lora is None:
            self.save(out, version=version, applied_steps=applied_steps, with_optimizer=False)
            return
        weights = {n: t.detach().cpu().contiguous().clone() for n, t in self._export()}
        if self._layout.rank == 0:
            self._write_hf_dir(out, weights)
        torch.distributed.barrier()
        self._finish_save(
            out, version=version, applied_steps=applied_steps, with_optimizer=False, lora=None
        )

    def _save_adapter(self, out: Path, lora: LoRAConfig) -> None:
        """Rank 0 writes the adapter (peft format) into ``out`` (collective: gathers it); an
        older state file, distributed checkpoint and adapter there are removed first."""
        assert self._lora is not None
        tensors = [(n, t.detach().cpu()) for n, t in self._lora.named_adapter_weights()]
        if self._layout.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / STATE_FILE).unlink(missing_ok=True)
            shutil.rmtree(out / DIST_DIR, ignore_errors=True)
            for f in (ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE):
                (out / f).unlink(missing_ok=True)
            save_adapter(out, tensors, lora, base_model=self._model_path)

    def _write_hf_dir(self, out: Path, weights: dict[str, torch.Tensor]) -> None:
        """(Rank 0) config, ``model.safetensors``, generation config and tokenizer into ``out``;
        an older state file and optimizer state there are removed first."""
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        (out / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(out / DIST_DIR, ignore_errors=True)
        shutil.rmtree(out / OPTIM_DIR, ignore_errors=True)  # format 1 (per-rank files)
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        mask = os.umask(0)  # safetensors writes 0600; give it the mode of the run's other files
        os.umask(mask)
        (out / "model.safetensors").chmod(0o666 & ~mask)
        self._hf_config.save_pretrained(str(out))
        src_gen = Path(self._model_path) / "generation_config.json"
        if src_gen.is_file() and src_gen.resolve() != (out / src_gen.name).resolve():
            shutil.copyfile(src_gen, out / src_gen.name)
        self._tokenizer.save_pretrained(str(out))

    def _lora_record(self, lora: LoRAConfig) -> dict[str, Any]:
        """What the state file says about the adapter: its settings and its base's identity."""
        return {
            "base": base_identity(self._model_path),
            "config": peft_adapter_config(lora, self._model_path),
        }

    def _finish_save(
        self,
        out: Path,
        *,
        version: int,
        applied_steps: int,
        with_optimizer: bool,
        lora: LoRAConfig | None,
    ) -> None:
        """The optimizer state (with ``with_optimizer``) and, last, the state file (collective)."""
        rank = self._layout.rank
        if with_optimizer:
            save_distributed(
                self._module,
                self._optimizer,
                out / DIST_DIR,
                distributed_optimizer=self._distributed_optimizer,
                keys=is_adapter_key if lora is not None else None,
            )
        torch.distributed.barrier()
        if rank == 0:
            state = {
                "format": CHECKPOINT_FORMAT,
                "version": version,
                "applied_steps": applied_steps,
                "with_optimizer": with_optimizer,
                "optimizer_format": "torch_dist" if with_optimizer else None,
                "distrib_optim_sharding_type": (
                    DISTOPT_SHARDING if self._distributed_optimizer else None
                ),
                "layout": self._layout_record(),
                "lora": self._lora_record(lora) if lora is not None else None,
            }
            tmp = out / (STATE_FILE + ".tmp")
            torch.save(state, tmp)
            tmp.replace(out / STATE_FILE)
        torch.distributed.barrier()

    # ------------------------------------------------------------------ load

    def load(self, src: Path, *, with_optimizer: bool = True) -> tuple[int, int]:
        """Restore what :meth:`save` wrote into the model (and, with ``with_optimizer``, the
        optimizer); returns the saved ``(version, applied_steps)`` (collective). See
        :meth:`rl_megatron.policy.MegatronPolicy.load`.

        Raises:
            CheckpointError: files are missing, a weight is missing or has the wrong shape, the
                optimizer state was asked for but not saved (or saved by an older version), it
                was saved with the other ``use_distributed_optimizer`` setting, or the adapter
                does not fit ``policy.lora``.
        """
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
                self._module,
                self._optimizer,
                src / DIST_DIR,
                distributed_optimizer=self._distributed_optimizer,
                keys=is_adapter_key if lora else None,
            )
        elif lora:
            self._load_adapter(src)
        else:
            self._weights.load_hf_dir(src, error=CheckpointError)
            self._reload_optimizer()
        return int(state["version"]), int(state["applied_steps"])

    def _load_adapter(self, src: Path) -> None:
        assert self._lora is not None
        try:
            tensors = read_adapter(str(src), self._lora.config)
            self._lora.load_adapter_weights(tensors.items())
        except RLError as exc:
            raise CheckpointError(f"{src}: cannot load the adapter: {exc}") from exc
        self._reload_optimizer()

    def _check_lora_checkpoint(self, state_path: Path, saved: dict[str, Any] | None) -> bool:
        """Refuse a LoRA checkpoint for a full policy (and back), another base model, or other
        adapter settings; True for a LoRA checkpoint."""
        lora = self._lora_config
        if (saved is None) != (lora is None):
            what = "a LoRA adapter" if saved else "full weights"
            raise CheckpointError(
                f"{state_path}: the checkpoint holds {what} but policy.lora is "
                f"{'set' if lora else 'not set'}; set policy.lora as when it was saved."
            )
        if saved is None or lora is None:
            return False
        mine = base_identity(self._model_path)
        if saved["base"]["checksum"] != mine["checksum"]:
            raise CheckpointError(
                f"{state_path}: the adapter was trained on the base model "
                f"{saved['base']['path']!r} (checksum {saved['base']['checksum']}), this policy's "
                f"policy.model_path {mine['path']!r} has checksum {mine['checksum']}; point "
                "policy.model_path at the adapter's base model."
            )
        cfg = saved["config"]
        theirs = (int(cfg["r"]), float(cfg["lora_alpha"]), sorted(cfg["target_modules"]))
        if theirs != (lora.rank, float(lora.alpha), sorted(lora.target_modules)):
            raise CheckpointError(
                f"{state_path}: the adapter has rank/alpha/targets {theirs}, policy.lora has "
                f"{(lora.rank, lora.alpha, sorted(lora.target_modules))}; set policy.lora to the "
                "adapter's settings."
            )
        return True

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
        if saved != self._distributed_optimizer:
            raise CheckpointError(
                f"{state_path}: optimizer state was saved with use_distributed_optimizer={saved}, "
                f"this policy runs use_distributed_optimizer={self._distributed_optimizer}"
                f"; set policy.use_distributed_optimizer={saved} to resume (TP, PP and DP sizes "
                "may differ), or load with with_optimizer=False."
            )
