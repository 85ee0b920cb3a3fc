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
    "MultiAdapters",
    "adapter_runs",
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
    "policy.lora: needs the peft library; install it with `pip install rlpost-hf[lora]` (or "
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
    adapter is reproducible; only the adapter parameters require gradients afterwards. With
    several adapters (``lora.adapters``) each is added in that order (``A`` drawn from the same
    RNG stream), all require gradients, and the default one is active.

    Raises:
        ConfigError: no linear layer of ``model`` matches ``lora.target_modules``.
    """
    peft = _peft()
    first = lora.adapter_names[0]
    with torch.random.fork_rng(devices=[]), _quiet_peft():
        torch.manual_seed(seed)
        try:
            peft_model = peft.get_peft_model(model, peft_lora_config(lora), adapter_name=first)
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
        if lora.multi:  # multi-LoRA: the others after the default, from the same RNG stream
            for other in lora.adapter_names:
                if other != first:
                    peft_model.add_adapter(other, peft_lora_config(lora))
            peft_model.base_model.set_adapter(lora.default_adapter)
            for name, param in model.named_parameters():
                param.requires_grad_(".lora_" in name)
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

    def load_update(self, info: Any, lora: LoRAConfig, tensors: Mapping[str, torch.Tensor]) -> None:
        """Load an adapter update (``info`` an :class:`~rl_core.lora.AdapterInfo`): one adapter
        (:meth:`load`), or with ``info.names`` every adapter it carries (all checked before
        any is loaded), ``info.name`` active after."""
        from rl_core.lora import split_adapters

        if not info.names:
            self.load(lora, tensors)
            return
        parts = split_adapters(tensors.items(), info.names)
        for name, part in parts.items():
            self.check(dataclasses.replace(lora, name=name), part)
        for name, part in parts.items():
            self.load(dataclasses.replace(lora, name=name), part)
        self.activate(info.name)

    def run_grouped(self, batch: list[Any], run: Any) -> dict[str, float]:
        """``run(part)`` for each part of ``batch`` (pending requests) that asks for one adapter
        (``request.adapter``; ``None`` is the active one), with that adapter active; the active
        adapter is restored after. Returns the summed stats of the parts."""
        names = [p.request.adapter or self.active for p in batch]
        if len(set(names)) <= 1:
            if names and names[0] is not None and names[0] != self.active:
                return self._run_with(names[0], batch, run)
            return run(batch)
        stats: dict[str, float] = {}
        for name in dict.fromkeys(names):  # in order of first appearance
            part = [p for p, n in zip(batch, names, strict=True) if n == name]
            for k, v in self._run_with(name, part, run).items():
                stats[k] = stats.get(k, 0.0) + v
        return stats

    def _run_with(self, name: str | None, part: list[Any], run: Any) -> dict[str, float]:
        active = self.active
        if name is None or name == active:
            return run(part)
        self.activate(name)
        try:
            return run(part)
        finally:
            if active is not None:
                self.activate(active)

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


# ---------------------------------------------------------------------------- multi-LoRA


def adapter_runs(batch: Any, default: str) -> list[tuple[str, Any]]:
    """``batch`` (a :class:`~rl_core.types.TrainBatch`) cut into runs of consecutive sequences
    with the same adapter (``batch.adapters``, ``None`` read as ``default``): ``[(adapter,
    sub_batch)]`` in order. Losses and metrics are sums over tokens, so the runs' sum is the
    batch's."""
    names = [a or default for a in batch.adapters] or [default] * batch.num_sequences
    if len(set(names)) <= 1:
        return [(names[0] if names else default, batch)]
    runs, start = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            runs.append((names[start], batch._sequences(start, i)))
            start = i
    return runs


class MultiAdapters:
    """The adapters of a multi-LoRA :class:`~rl_hf.HFPolicy` (``lora.adapters``) on its peft
    model: which one runs a forward, each one's tensors, its gradient norm and its checkpoint
    directory. Tensor names across adapters are :func:`rl_core.lora.adapter_tensor_name`."""

    def __init__(self, peft_model: Any, lora: LoRAConfig) -> None:
        self.peft = peft_model
        """The ``PeftModel`` holding every adapter."""
        self.lora = lora
        """The shared settings (``lora.adapters`` the names)."""

    def check(self, names: Iterator[str | None] | tuple[str | None, ...]) -> None:
        """Check every adapter named by a batch is one of this policy's.

        Raises:
            ConfigError: an unknown adapter name.
        """
        unknown = sorted({n for n in names if n is not None} - set(self.lora.adapter_names))
        if unknown:
            raise ConfigError(
                f"TrainBatch.adapters: {unknown} are not adapters of this policy "
                f"(policy.lora.adapters: {list(self.lora.adapter_names)}); check the prompts' "
                "rollout.adapter_key values."
            )

    def runs(self, batch: Any) -> Iterator[Any]:
        """The micro-batches of ``batch`` (a :class:`~rl_core.types.TrainBatch`), each cut into
        runs of one adapter (:func:`adapter_runs`), each run yielded with its adapter active.

        Raises:
            ConfigError: the batch names an adapter this policy does not have.
        """
        self.check(batch.adapters)
        for mb in batch.micro_batches():
            for name, run in adapter_runs(mb, self.lora.default_adapter):
                with self.active(name):
                    yield run

    @contextlib.contextmanager
    def active(self, name: str) -> Iterator[None]:
        """Forward passes inside run adapter ``name`` (every adapter keeps requiring gradients;
        only the active one enters the graph); the default adapter is active again after."""
        self._switch(name)
        try:
            yield
        finally:
            self._switch(self.lora.default_adapter)

    def _switch(self, name: str) -> None:
        self.peft.base_model.set_adapter(name)  # peft also freezes the others: undo that
        for pname, param in self.peft.base_model.model.named_parameters():
            if ".lora_" in pname:
                param.requires_grad_(True)

    def state(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s live tensors in peft naming (as ``get_peft_model_state_dict``
        names them; read here by exact name component, so no adapter name can match another's
        tensors)."""
        prefix = f"{name}/"
        live = self.live_state(self.peft.base_model.model.state_dict())
        return {k[len(prefix) :]: t for k, t in live.items() if k.startswith(prefix)}

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every adapter's tensors named ``<adapter>/<peft name>`` (detached views)."""
        from rl_core.lora import adapter_tensor_name

        for name in self.lora.adapter_names:
            for key, tensor in self.state(name).items():
                yield adapter_tensor_name(name, key), tensor.detach()

    def grad_norms(self) -> dict[str, float]:
        """``{"grad_norm/<adapter>": norm}`` of each adapter's current gradients (0 without)."""
        out = {}
        for name in self.lora.adapter_names:
            marker = f".{name}."
            grads = [
                p.grad
                for n, p in self.peft.base_model.model.named_parameters()
                if ".lora_" in n and marker in n and p.grad is not None
            ]
            norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
            out[f"grad_norm/{name}"] = float(norm)
        return out

    def live_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (the model's ``state_dict``) by the names ``load_weights`` takes: base
        weights under Hugging Face names, adapter tensors ``<adapter>/<peft name>``."""
        from rl_core.lora import PEFT_PREFIX, adapter_tensor_name

        live = {}
        for name, tensor in state.items():
            if ".lora_" not in name:
                live[name.replace(".base_layer.", ".")] = tensor
                continue
            head, _, rest = name.partition(".lora_")  # ...q_proj .lora_ A.<adapter>.weight
            which, adapter, leaf = rest.split(".", 2)
            live[adapter_tensor_name(adapter, f"{PEFT_PREFIX}{head}.lora_{which}.{leaf}")] = tensor
        return live

    def write_checkpoint(self, directory: Path, base_model: str) -> None:
        """One peft directory per adapter (``directory/<adapter>/``) plus :data:`BASE_FILE`."""
        for name in self.lora.adapter_names:
            save_adapter(
                directory / name,
                self.state(name).items(),
                self.lora.single(name),
                base_model=base_model,
            )
        (directory / BASE_FILE).write_text(json.dumps(base_identity(base_model), indent=2) + "\n")

    def read_checkpoint(self, directory: Path) -> dict[str, torch.Tensor]:
        """Every adapter's tensors of :meth:`write_checkpoint`, named ``<adapter>/<peft name>``.

        Raises:
            CheckpointError: an adapter's directory is missing or does not fit.
        """
        from rl_core.lora import adapter_tensor_name

        out = {}
        for name in self.lora.adapter_names:
            if not (directory / name).is_dir():
                raise CheckpointError(
                    f"{directory}: no directory {name!r} for adapter {name!r} of "
                    f"policy.lora.adapters {list(self.lora.adapter_names)}; was it written with "
                    "other adapters?"
                )
            tensors = read_adapter_checkpoint(directory / name, self.lora.single(name))
            out.update({adapter_tensor_name(name, k): t for k, t in tensors.items()})
        return out
