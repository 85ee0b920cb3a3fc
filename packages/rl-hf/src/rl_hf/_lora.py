"""LoRA through ``peft`` for :class:`~rl_hf.HFPolicy` and :class:`~rl_hf.HFGenerator`.

The Hugging Face model is adapted in place (``peft.get_peft_model`` injects ``lora_A``/``lora_B``
next to each targeted ``nn.Linear``, which becomes ``<module>.base_layer``), so the policy keeps
calling the same ``transformers`` model; the ``PeftModel`` wrapper is kept for the adapter state
dict and ``disable_adapter()``. Names: ``A`` ``[r, in]``, ``B`` ``[out, r]``, ``W`` ``[out, in]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import CheckpointError, ConfigError
from rl_core.lora import (
    ADAPTER_CONFIG_FILE,
    LoRAConfig,
    base_identity,
    load_adapter,
    lora_from_peft_config,
    peft_adapter_config,
    save_adapter,
)

__all__ = [
    "BASE_FILE",
    "check_base",
    "merged_named_weights",
    "peft_lora_config",
    "read_adapter_checkpoint",
    "set_lora_dropout",
    "wrap",
    "write_adapter_checkpoint",
]

BASE_FILE = "rl_lora_base.json"
"""File of an adapter checkpoint naming the base model it was trained on
(:func:`rl_core.lora.base_identity`)."""

_PEFT_MISSING = (
    "policy.lora: needs the peft library; install it with `pip install rl-hf[lora]` (or "
    "`pip install peft`), or remove policy.lora to fine-tune every weight."
)


def _peft() -> Any:
    try:
        import peft
    except ImportError as e:  # pragma: no cover - peft is an extra
        raise ConfigError(_PEFT_MISSING) from e
    return peft


def peft_lora_config(lora: LoRAConfig, *, inference: bool = False) -> Any:
    """The ``peft.LoraConfig`` of ``lora`` (its ``extra`` fields passed through)."""
    peft = _peft()
    known = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    extra = {k: v for k, v in lora.extra.items() if k in known}
    return peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(lora.target_modules),
        use_rslora=lora.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
        inference_mode=inference,
        **extra,
    )


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """Hide the FutureWarning peft triggers by reading transformers 5's deprecated
    ``is_gradient_checkpointing`` when it wraps a model."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        yield


def wrap(model: torch.nn.Module, lora: LoRAConfig, *, seed: int) -> Any:
    """Adapt ``model`` in place with ``lora`` and return the ``PeftModel`` around it.

    ``A`` is drawn from a private RNG seeded with ``seed`` (``B`` starts at zero), so the initial
    adapter is reproducible; only the adapter parameters require gradients afterwards.

    Raises:
        ConfigError: no linear layer of ``model`` matches ``lora.target_modules``.
    """
    peft = _peft()
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(seed)
        try:
            peft_model = peft.get_peft_model(model, peft_lora_config(lora), adapter_name=lora.name)
        except ValueError as e:  # peft: "Target modules ... not found in the base model"
            linear = sorted(
                {
                    n.rsplit(".", 1)[-1]
                    for n, m in model.named_modules()
                    if isinstance(m, torch.nn.Linear)
                }
            )
            raise ConfigError(
                f"policy.lora.target_modules: {list(lora.target_modules)} match no linear layer "
                f"of {type(model).__name__} ({e}); its linear layers are {linear}."
            ) from e
    return peft_model


def set_lora_dropout(model: torch.nn.Module, training: bool) -> None:
    """Switch the adapters' dropout modules on (``train_step``) or off (everything else)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 2)[-2:-1] == ["lora_dropout"]:
            module.train(training)


def merged_named_weights(
    model: torch.nn.Module, *, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` of ``model``'s weights with every active adapter merged.

    Hugging Face names (``<module>.base_layer.weight`` read as ``<module>.weight``; the adapter
    tensors themselves are not yielded), in ``state_dict`` order. An adapted weight is
    ``W + scaling * B @ A`` (computed in float32, returned in ``W``'s dtype, as
    :func:`rl_core.lora.merge_adapter`); other tensors are detached views of the live weights.
    """
    from peft.tuners.lora import LoraLayer

    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
    for name, tensor in model.state_dict().items():
        if ".lora_" in name:
            continue
        hf_name = name.replace(".base_layer.", ".")
        if hf_name in skip:
            continue
        module, _, leaf = hf_name.rpartition(".")
        layer = layers.get(module)
        if layer is None or leaf != "weight" or layer.disable_adapters or layer.merged:
            yield hf_name, tensor.detach()
            continue
        w_OI = tensor.detach()
        merged_OI = w_OI.float()
        for adapter in layer.active_adapters:
            if adapter not in layer.lora_A:
                continue
            a_RI = layer.lora_A[adapter].weight.detach().float()
            b_OR = layer.lora_B[adapter].weight.detach().float()
            merged_OI = merged_OI + layer.scaling[adapter] * (b_OR @ a_RI)
        yield hf_name, merged_OI.to(w_OI.dtype)


def write_adapter_checkpoint(
    directory: Path, peft_model: Any, lora: LoRAConfig, base_model: str
) -> None:
    """Write the adapter of ``peft_model`` as a peft directory plus :data:`BASE_FILE`."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, adapter_name=lora.name)
    save_adapter(directory, state.items(), lora, base_model=base_model)
    (directory / BASE_FILE).write_text(json.dumps(base_identity(base_model), indent=2) + "\n")


def check_base(directory: Path, base_model: str) -> None:
    """Check that the adapter checkpoint in ``directory`` was trained on ``base_model``.

    Raises:
        CheckpointError: the checkpoint names another base (path or checksum) or none.
    """
    base_file = directory / BASE_FILE
    if not base_file.is_file():
        raise CheckpointError(
            f"{directory}: no {BASE_FILE}; not an adapter checkpoint written by a LoRA policy "
            "(a full-weights checkpoint loads into a policy without policy.lora)."
        )
    saved = json.loads(base_file.read_text())
    here = base_identity(base_model)
    if saved.get("checksum") != here["checksum"]:
        raise CheckpointError(
            f"{directory}: the adapter was trained on the base model {saved.get('path')!r} "
            f"(checksum {saved.get('checksum')}), but this policy's base is {base_model!r} "
            f"(checksum {here['checksum']}); set policy.model_path (model.path) to the base it "
            "was trained on."
        )


def read_adapter_checkpoint(directory: Path, lora: LoRAConfig) -> Mapping[str, torch.Tensor]:
    """The adapter tensors (peft names) of an adapter checkpoint, checked against ``lora``.

    Raises:
        CheckpointError: the adapter directory is incomplete or its rank/alpha/targets differ.
    """
    if not (directory / ADAPTER_CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{directory}: no {ADAPTER_CONFIG_FILE}; not an adapter checkpoint of a LoRA policy."
        )
    try:
        tensors, saved = load_adapter(directory)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    ours = lora_from_peft_config(peft_adapter_config(lora))
    if (saved.rank, saved.scaling, set(saved.target_modules)) != (
        ours.rank,
        ours.scaling,
        set(ours.target_modules),
    ):
        raise CheckpointError(
            f"{directory}: the adapter has rank {saved.rank}, scaling {saved.scaling} and targets "
            f"{sorted(saved.target_modules)}, the policy rank {lora.rank}, scaling "
            f"{lora.scaling} and targets {sorted(lora.target_modules)}; set policy.lora as it "
            "was when the checkpoint was written."
        )
    return tensors


class GeneratorAdapters:
    """The LoRA adapters an :class:`~rl_hf.HFGenerator` serves on its model (in place, through
    peft), by name; generation uses :attr:`active` (the adapter loaded last, unless
    :meth:`activate` picked another). The caller holds the generator's weights lock."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        """The served Hugging Face model (adapted in place once the first adapter arrives)."""
        self.peft: Any = None
        """The ``PeftModel`` around :attr:`model`, or ``None`` before the first adapter."""
        self.configs: dict[str, LoRAConfig] = {}
        """The loaded adapters' settings, by name."""
        self.active: str | None = None
        """The adapter generation uses, or ``None`` (the base model)."""

    def _linear_modules(self) -> dict[str, tuple[int, int]]:
        """``{hf_module_name: (out, in)}`` of every (possibly already adapted) linear layer."""
        from peft.tuners.lora import LoraLayer

        out = {}
        for name, module in self.model.named_modules():
            if isinstance(module, LoraLayer) or (
                isinstance(module, torch.nn.Linear)
                and not name.split(".")[-1].startswith("lora_")
                and not name.endswith(".base_layer")
            ):
                out[name] = (module.out_features, module.in_features)
        return out

    def check(self, lora: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        """Check ``tensors`` (peft names) form a complete adapter ``lora`` of this model.

        Raises:
            WeightSyncError: a name is not a LoRA tensor, a module is missing or not a target,
                a shape does not fit, or an adapter of this name had other settings.
        """
        from rl_core.errors import WeightSyncError
        from rl_core.lora import module_of, peft_name

        known = self.configs.get(lora.name)
        if known is not None and peft_adapter_config(known) != peft_adapter_config(lora):
            raise WeightSyncError(
                f"adapter {lora.name!r}: served with rank {known.rank} and targets "
                f"{sorted(known.target_modules)}, the update has rank {lora.rank} and targets "
                f"{sorted(lora.target_modules)}; publish a changed adapter under a new name."
            )
        linear = self._linear_modules()
        targets = {m: shape for m, shape in linear.items() if lora.targets(m)}
        expected = {peft_name(m, ab) for m in targets for ab in ("A", "B")}
        for name, tensor in tensors.items():
            module, which = module_of(name)
            if module not in targets:
                raise WeightSyncError(
                    f"adapter {lora.name!r}: tensor {name!r} adapts {module!r}, which is not a "
                    f"linear layer named by its target_modules {sorted(lora.target_modules)} in "
                    "the served model; was it trained on another model?"
                )
            out_f, in_f = targets[module]
            want = (lora.rank, in_f) if which == "A" else (out_f, lora.rank)
            if tuple(tensor.shape) != want:
                raise WeightSyncError(
                    f"adapter {lora.name!r}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                    f"expected {want} (rank {lora.rank})."
                )
        missing = sorted(expected - set(tensors))
        if missing:
            raise WeightSyncError(
                f"adapter {lora.name!r}: the update lacks {len(missing)} tensor(s), e.g. "
                f"{missing[0]!r}; an adapter update carries every A and B of its targets."
            )

    def load(self, lora: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        """Add (or refresh) adapter ``lora.name`` with ``tensors`` (checked by :meth:`check`
        first) and make it the active one."""
        from peft import set_peft_model_state_dict

        self.check(lora, tensors)
        if self.peft is None:
            with _quiet_peft():
                self.peft = _peft().get_peft_model(
                    self.model, peft_lora_config(lora, inference=True), adapter_name=lora.name
                )
        elif lora.name not in self.configs:
            self.peft.add_adapter(lora.name, peft_lora_config(lora, inference=True))
        self.configs[lora.name] = lora
        device = next(self.model.parameters()).device
        set_peft_model_state_dict(
            self.peft, {n: t.to(device) for n, t in tensors.items()}, adapter_name=lora.name
        )
        self.model.eval()
        self.model.requires_grad_(False)
        self.activate(lora.name)

    def activate(self, name: str) -> None:
        """Serve adapter ``name`` from now on.

        Raises:
            ConfigError: no adapter of that name was loaded.
        """
        if name not in self.configs:
            raise ConfigError(
                f"adapter {name!r} is not loaded; loaded adapters: {sorted(self.configs)}."
            )
        self.peft.set_adapter(name)
        self.model.requires_grad_(False)
        self.active = name

    def base_state(self) -> dict[str, torch.Tensor]:
        """The model's live tensors by Hugging Face name (base weights, adapters left out)."""
        return {
            n.replace(".base_layer.", "."): t
            for n, t in self.model.state_dict(keep_vars=False).items()
            if ".lora_" not in n
        }
