"""Low-rank adapters (LoRA): the settings, the peft file format and the adapter-only update.

Every layer of the stack speaks the same three things, defined here so that no backend depends
on another:

- :class:`LoRAConfig`: rank, alpha, dropout and the target modules, as ``policy.lora`` in a
  recipe (both ``HFPolicy`` and ``MegatronPolicy`` take it).
- **The peft format**: adapter tensors are named as ``peft`` saves them
  (``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight``
  ``[out, r]``, the module in Hugging Face naming), next to an ``adapter_config.json``
  (:func:`peft_adapter_config`). A directory written by :func:`save_adapter` loads with
  ``peft.PeftModel.from_pretrained`` and SGLang's ``/load_lora_adapter``.
- **Adapter-only weight updates**: a :class:`~rl_core.types.WeightUpdate` whose ``metadata``
  holds :data:`ADAPTER_KEY` carries adapter tensors (peft names) instead of full weights; any
  transport moves them unchanged (full, delta, broadcast), and a generator that receives one
  loads it as an adapter (:func:`adapter_of` reads it back; a generator without adapter support
  refuses it with a named error). :func:`merge_adapter` gives the merged full weights for a
  generator that can only take those.

The effective weight of an adapted linear layer is ``W + scaling * B @ A`` with
``scaling = alpha / rank`` (``alpha / sqrt(rank)`` with ``use_rslora``), exactly as ``peft``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_core.config import PositiveFloat, PositiveInt, Probability
from rl_core.errors import ConfigError, WeightSyncError
from rl_core.types import WeightUpdate

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_KEY",
    "ADAPTER_WEIGHTS_FILE",
    "PEFT_PREFIX",
    "SEQUENCE_ADAPTER_KEY",
    "AdapterInfo",
    "LoRAConfig",
    "adapter_of",
    "adapter_tensor_name",
    "base_identity",
    "load_adapter",
    "lora_from_peft_config",
    "merge_adapter",
    "module_of",
    "peft_adapter_config",
    "peft_name",
    "save_adapter",
    "split_adapters",
    "with_adapter",
]

ADAPTER_KEY = "lora_adapter"
"""Key of :class:`~rl_core.types.WeightUpdate` ``metadata`` marking an adapter-only update; its
value is :meth:`AdapterInfo.to_dict`."""
ADAPTER_CONFIG_FILE = "adapter_config.json"
"""peft's adapter settings file."""
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
"""peft's adapter tensors file."""
PEFT_PREFIX = "base_model.model."
"""Prefix peft puts before Hugging Face module names in a saved adapter."""
SEQUENCE_ADAPTER_KEY = "lora_adapter"
"""Key of ``Prompt.metadata`` and ``Rollout.metadata`` naming the adapter (multi-LoRA,
:attr:`LoRAConfig.adapters`) that samples and trains on that prompt's rollouts; absent: the
default adapter."""

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear layer of a Llama/Qwen decoder layer (attention and MLP)."""

_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters on a policy's linear layers (``policy.lora``); the base stays frozen.

    The adapted layer computes ``W x + scaling * B (A dropout(x))`` with ``A`` ``[rank, in]``
    (random init) and ``B`` ``[out, rank]`` (zeros), so a fresh adapter leaves the model
    unchanged.
    """

    rank: PositiveInt = 8
    """Adapter rank ``r``."""
    alpha: PositiveFloat = 16.0
    """Scale numerator: ``scaling = alpha / rank`` (``alpha / sqrt(rank)`` with
    ``use_rslora``)."""
    dropout: Probability = 0.0
    """Dropout on the adapter's input during ``train_step`` (never in ``compute_logprobs``)."""
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    """Linear layers to adapt, by the last component of their Hugging Face module name
    (``q_proj`` matches ``model.layers.3.self_attn.q_proj``), as peft's ``target_modules``."""
    use_rslora: bool = False
    """Rank-stabilised scaling ``alpha / sqrt(rank)``."""
    name: str = "default"
    """Adapter name: the name a generator serves it under (multi-LoRA picks adapters by it).
    With ``adapters`` set: the default adapter (one of them; ``"default"`` means the first)."""
    adapters: tuple[str, ...] = ()
    """Multi-LoRA: the names of several adapters on one base, all with these settings (rank,
    alpha, targets). Each trains only on its own prompts' rollouts (``rollout.adapter_key``
    picks it per prompt) and is served under its own name. Empty: one adapter, ``name``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further peft ``LoraConfig`` fields written into ``adapter_config.json`` as they are."""

    def __post_init__(self) -> None:
        if not self.target_modules:
            raise ConfigError(
                "policy.lora.target_modules: is empty; name the linear layers to adapt, e.g. "
                f"{list(DEFAULT_TARGETS)}."
            )
        bad = [t for t in self.target_modules if not re.fullmatch(r"[A-Za-z0-9_]+", t)]
        if bad:
            raise ConfigError(
                f"policy.lora.target_modules: {bad} are not module names (letters, digits, '_'); "
                "give the last component of a module name, e.g. 'q_proj'."
            )
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise ConfigError(
                f"policy.lora.name: {self.name!r} must be letters, digits, '_', '.', '-' (it "
                "names the adapter on the generator and in file paths)."
            )
        if self.adapters:
            bad = [a for a in self.adapters if not re.fullmatch(r"[A-Za-z0-9_.-]+", a)]
            if bad:
                raise ConfigError(
                    f"policy.lora.adapters: {bad} must be letters, digits, '_', '.', '-' (each "
                    "names an adapter on the generator and in file paths)."
                )
            dup = sorted({a for a in self.adapters if self.adapters.count(a) > 1})
            if dup:
                raise ConfigError(f"policy.lora.adapters: {dup} appear more than once.")
            if self.name != "default" and self.name not in self.adapters:
                raise ConfigError(
                    f"policy.lora.name: {self.name!r} is not one of policy.lora.adapters "
                    f"{list(self.adapters)}; with several adapters name names the default one "
                    "(or leave it 'default': the first)."
                )

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Every adapter trained: ``adapters``, or ``(name,)`` for one."""
        return self.adapters or (self.name,)

    @property
    def default_adapter(self) -> str:
        """The adapter of prompts and requests that name none: ``name``, or with ``adapters``
        and ``name`` left ``"default"`` the first adapter."""
        if self.adapters and self.name not in self.adapters:
            return self.adapters[0]
        return self.name

    @property
    def multi(self) -> bool:
        """Several adapters (``adapters`` set)."""
        return bool(self.adapters)

    def single(self, name: str) -> LoRAConfig:
        """The settings of adapter ``name`` alone (``adapters`` cleared)."""
        return dataclasses.replace(self, name=name, adapters=())

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def targets(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` (Hugging Face naming) gets an adapter."""
        return module_name.rsplit(".", 1)[-1] in self.target_modules


def peft_name(module: str, which: str) -> str:
    """The peft tensor name of ``module``'s ``A`` or ``B`` matrix (``which`` is ``"A"``/``"B"``)."""
    if which not in ("A", "B"):
        raise ValueError(f"which must be 'A' or 'B', got {which!r}")
    return f"{PEFT_PREFIX}{module}.lora_{which}.weight"


def module_of(name: str) -> tuple[str, str]:
    """``(module, "A"|"B")`` of a peft adapter tensor name (prefix optional).

    Raises:
        WeightSyncError: ``name`` is not a LoRA ``A``/``B`` tensor name.
    """
    m = _PEFT_NAME.match(name)
    if m is None:
        raise WeightSyncError(
            f"adapter tensor {name!r} is not named '<module>.lora_A.weight' or "
            "'<module>.lora_B.weight' (peft naming)."
        )
    return m["module"], m["ab"]


def peft_adapter_config(lora: LoRAConfig, base_model: str = "") -> dict[str, Any]:
    """The ``adapter_config.json`` contents peft and SGLang read for ``lora``."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
        "use_rslora": lora.use_rslora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
        **lora.extra,
    }


def lora_from_peft_config(
    data: Mapping[str, Any], *, where: str = "adapter_config.json"
) -> LoRAConfig:
    """The :class:`LoRAConfig` an ``adapter_config.json`` describes (unknown keys kept in
    ``extra``).

    Raises:
        ConfigError: it is not a LoRA adapter config, or its target modules are not a list.
    """
    if data.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{where}: peft_type is {data.get('peft_type')!r}, not 'LORA'.")
    targets = data.get("target_modules")
    if isinstance(targets, str) or not isinstance(targets, list | tuple):
        raise ConfigError(
            f"{where}: target_modules must be a list of module names (a regex string is not "
            f"supported), got {targets!r}."
        )
    for key in ("rank_pattern", "alpha_pattern"):
        if data.get(key):
            raise ConfigError(
                f"{where}: {key} is set ({data[key]!r}); per-module ranks or alphas are not "
                "supported, train with one rank and alpha."
            )
    for key in ("use_dora", "use_qalora", "lora_bias"):
        if data.get(key):
            raise ConfigError(f"{where}: {key} is true; only plain LoRA adapters are supported.")
    known = set(peft_adapter_config(LoRAConfig()))
    return LoRAConfig(
        rank=int(data["r"]),
        alpha=float(data.get("lora_alpha", 8)),
        dropout=float(data.get("lora_dropout", 0.0)),
        target_modules=tuple(targets),
        use_rslora=bool(data.get("use_rslora", False)),
        extra={k: v for k, v in data.items() if k not in known},
    )


def base_identity(model_path: str | Path) -> dict[str, str]:
    """The base model an adapter belongs to: its path and a checksum of its ``config.json`` and
    weight files' names and sizes (cheap; catches a different model, not a re-saved copy)."""
    path = Path(model_path)
    h = hashlib.sha256()
    for f in sorted(path.glob("*.json")) + sorted(path.glob("*.safetensors")):
        h.update(f.name.encode())
        h.update(str(f.stat().st_size).encode())
        if f.name == "config.json":
            h.update(f.read_bytes())
    return {"path": str(path), "checksum": h.hexdigest()[:16]}


def save_adapter(
    directory: str | Path,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    lora: LoRAConfig,
    *,
    base_model: str = "",
) -> Path:
    """Write a peft adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``).

    Tensor names may come with or without the peft prefix; they are written with it.
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        module, which = module_of(name)
        tensors[peft_name(module, which)] = tensor.detach().to("cpu").contiguous()
    if not tensors:
        raise ConfigError(
            f"policy.lora: no adapter tensors to save into {out}; do policy.lora.target_modules "
            "name linear layers of this model?"
        )
    save_file(tensors, str(out / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
    (out / ADAPTER_CONFIG_FILE).write_text(
        json.dumps(peft_adapter_config(lora, base_model), indent=2) + "\n"
    )
    return out


def load_adapter(directory: str | Path) -> tuple[dict[str, torch.Tensor], LoRAConfig]:
    """Read a peft adapter directory: tensors (peft names, prefix included) and its config.

    Raises:
        ConfigError: a file is missing or the config is not a LoRA config.
    """
    from safetensors.torch import load_file

    path = Path(directory)
    cfg_file, weights = path / ADAPTER_CONFIG_FILE, path / ADAPTER_WEIGHTS_FILE
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ConfigError(
                f"{path}: no {f.name}; a LoRA adapter directory holds {ADAPTER_CONFIG_FILE} and "
                f"{ADAPTER_WEIGHTS_FILE} (as peft's save_pretrained writes them)."
            )
    lora = lora_from_peft_config(json.loads(cfg_file.read_text()), where=str(cfg_file))
    tensors = {}
    for name, tensor in load_file(str(weights)).items():
        module, which = module_of(name)
        tensors[peft_name(module, which)] = tensor
    return tensors, lora


def merge_adapter(
    base: Mapping[str, torch.Tensor],
    adapter: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    lora: LoRAConfig,
) -> dict[str, torch.Tensor]:
    """The merged full weights of the adapted modules: ``{module.weight: W + scaling * B @ A}``
    (computed in float32, returned in ``W``'s dtype). Only the adapted weights are returned.

    Raises:
        WeightSyncError: an adapter module has no ``.weight`` in ``base``, lacks its ``A`` or
            ``B`` half, or the shapes do not compose.
    """
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    items = adapter.items() if isinstance(adapter, Mapping) else adapter
    for name, tensor in items:
        module, which = module_of(name)
        pairs.setdefault(module, {})[which] = tensor
    merged = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise WeightSyncError(f"adapter for {module!r} has only lora_{''.join(ab)}.")
        key = f"{module}.weight"
        if key not in base:
            raise WeightSyncError(
                f"adapter module {module!r} has no weight {key!r} in the base model; was the "
                "adapter trained on another model?"
            )
        w_OI = base[key]
        a_RI, b_OR = ab["A"].float(), ab["B"].float()
        if a_RI.shape[1] != w_OI.shape[1] or b_OR.shape[0] != w_OI.shape[0]:
            raise WeightSyncError(
                f"adapter for {module!r}: B {tuple(b_OR.shape)} @ A {tuple(a_RI.shape)} does not "
                f"match the base weight {tuple(w_OI.shape)}."
            )
        delta_OI = lora.scaling * (b_OR.to(w_OI.device) @ a_RI.to(w_OI.device))
        merged[key] = (w_OI.float() + delta_OI).to(w_OI.dtype)
    return merged


@dataclass(frozen=True, slots=True)
class AdapterInfo:
    """What an adapter-only :class:`~rl_core.types.WeightUpdate` carries besides its tensors."""

    name: str
    """The adapter's name on the generator (:attr:`LoRAConfig.name`)."""
    config: Mapping[str, Any]
    """Its ``adapter_config.json`` contents (:func:`peft_adapter_config`)."""
    names: tuple[str, ...] = ()
    """Multi-LoRA: the adapters the update carries (each tensor named
    :func:`adapter_tensor_name`), all with ``config``; ``name`` is the default one. Empty: one
    adapter, ``name``, with plain peft names."""

    @property
    def lora(self) -> LoRAConfig:
        """The config as a :class:`LoRAConfig` (its name included)."""
        return dataclasses.replace(lora_from_peft_config(self.config), name=self.name)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able form stored under :data:`ADAPTER_KEY`."""
        out: dict[str, Any] = {"name": self.name, "config": dict(self.config)}
        if self.names:
            out["names"] = list(self.names)
        return out


def adapter_tensor_name(adapter: str, name: str) -> str:
    """The name of adapter ``adapter``'s tensor ``name`` (peft naming) in a multi-adapter
    update: ``<adapter>/<peft name>``."""
    return f"{adapter}/{name}"


def split_adapters(
    named_tensors: Iterable[tuple[str, torch.Tensor]], names: Iterable[str]
) -> dict[str, dict[str, torch.Tensor]]:
    """The tensors of a multi-adapter update (:func:`adapter_tensor_name`), by adapter, under
    their peft names.

    Raises:
        WeightSyncError: a tensor belongs to none of ``names``, or an adapter has no tensors.
    """
    out: dict[str, dict[str, torch.Tensor]] = {n: {} for n in names}
    for full, tensor in named_tensors:
        adapter, sep, name = full.partition("/")
        if not sep or adapter not in out:
            raise WeightSyncError(
                f"multi-adapter update: tensor {full!r} is not named '<adapter>/<peft name>' "
                f"with an adapter of {sorted(out)}."
            )
        out[adapter][name] = tensor
    empty = sorted(n for n, t in out.items() if not t)
    if empty:
        raise WeightSyncError(f"multi-adapter update: no tensors for adapter(s) {empty}.")
    return out


def with_adapter(update: WeightUpdate, lora: LoRAConfig, base_model: str = "") -> WeightUpdate:
    """``update`` marked as carrying the adapter ``lora`` (the sender calls this on what its
    transport's ``publish`` returned for the adapter tensors). With several adapters
    (:attr:`LoRAConfig.adapters`) the update carries all of them, named
    :func:`adapter_tensor_name`, and the marker lists them."""
    info = AdapterInfo(
        lora.default_adapter,
        peft_adapter_config(lora.single(lora.default_adapter), base_model),
        names=lora.adapters,
    )
    return dataclasses.replace(update, metadata={**update.metadata, ADAPTER_KEY: info.to_dict()})


def adapter_of(update: WeightUpdate) -> AdapterInfo | None:
    """The adapter an update carries, or ``None`` for a full-weights update.

    Raises:
        WeightSyncError: the marker is malformed.
    """
    raw = update.metadata.get(ADAPTER_KEY)
    if raw is None:
        return None
    if not isinstance(raw, Mapping) or "name" not in raw or "config" not in raw:
        raise WeightSyncError(
            f"weight update v{update.version}: metadata[{ADAPTER_KEY!r}] must hold 'name' and "
            f"'config', got {raw!r}."
        )
    return AdapterInfo(
        str(raw["name"]), dict(raw["config"]), names=tuple(str(n) for n in raw.get("names", ()))
    )
