"""The compute side of the service: one Hugging Face base model, many LoRA tenants.

Every training client of the Tinker API is a :class:`Tenant`: its own peft adapter on the shared
frozen base model and its own AdamW (its own moments, step count and, per ``optim_step``, the
learning rate and betas of the request's ``AdamParams``). Sampler snapshots are frozen copies of
an adapter's tensors; sampling loads one into a sampler slot of the same peft model, so a
sampling client keeps the adapter version it was made from while its tenant trains on.

All methods run on the service's single compute thread (:class:`~rl_tinker.server.TinkerService`
submits them in each client's submission order); none is thread-safe on its own.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_core.errors import CheckpointError, ConfigError
from rl_tinker.errors import UserError

__all__ = [
    "LORA_ALPHA",
    "BaseModel",
    "DatumInput",
    "LoraSpec",
    "SampleResult",
    "Tenant",
]

LORA_ALPHA = 32
"""``lora_alpha`` of every adapter (peft scales the update by ``alpha / rank``)."""

_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """The LoRA settings a training client was created with (``LoraConfig`` of the SDK)."""

    rank: int
    """Adapter rank."""
    seed: int = 0
    """Seeds the draw of the adapter's ``A`` matrices (``B`` starts at zero)."""
    train_attn: bool = True
    """Adapters on the attention projections."""
    train_mlp: bool = True
    """Adapters on the MLP projections."""
    train_unembed: bool = True
    """An adapter on the LM head."""

    def targets(self, available: set[str]) -> list[str]:
        """Module names to adapt, among those the model has (``available``).

        Raises:
            UserError: nothing to adapt (every ``train_*`` off).
        """
        names = [*(_ATTN if self.train_attn else ()), *(_MLP if self.train_mlp else ())]
        if self.train_unembed:
            names.append("lm_head")
        out = [n for n in names if n in available]
        if not out:
            raise UserError(
                "lora_config: train_attn, train_mlp and train_unembed are all off (or the model "
                f"has none of those layers: it has {sorted(available)}); enable at least one."
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (checkpoint metadata)."""
        return {
            "rank": self.rank,
            "seed": self.seed,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LoraSpec:
        """Inverse of :meth:`to_json`."""
        return cls(**{k: data[k] for k in cls.__slots__ if k in data})


@dataclass(slots=True)
class DatumInput:
    """One datum of a ``forward``/``forward_backward`` request, decoded."""

    tokens: np.ndarray
    """The model input's token ids (int64)."""
    inputs: dict[str, np.ndarray]
    """``loss_fn_inputs`` by name (``target_tokens``, ``weights``, ``advantages``, ...)."""


@dataclass(slots=True)
class SampleResult:
    """What :meth:`BaseModel.sample` returns."""

    sequences: list[tuple[list[int], list[float], str]]
    """``(tokens, logprobs, stop_reason)`` per sample; ``stop_reason`` is ``stop`` or ``length``."""
    prompt_logprobs: list[float] | None
    """Log-prob of each prompt token given the ones before (NaN at position 0) when asked."""


@dataclass(eq=False)
class Tenant:
    """One training client: its adapter on a :class:`BaseModel` and its optimizer."""

    model_id: str
    """The Tinker model id (``<session>:train:<n>``)."""
    base: BaseModel
    """The base model it adapts."""
    adapter: str
    """Its peft adapter name."""
    lora: LoraSpec
    """Its LoRA settings."""
    params: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    """Its adapter parameters, by checkpoint name, in a fixed order."""
    optimizer: torch.optim.AdamW | None = None
    """Its AdamW (only its own parameters)."""
    steps: int = 0
    """``optim_step`` calls so far."""
    tokens_trained: int = 0
    """Tokens through ``forward_backward`` so far."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Adapter tensors by checkpoint name (copies)."""
        return {name: p.detach().clone() for name, p in self.params}


def _loss_and_outputs(
    loss_fn: str,
    logp: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss (a sum over tokens) of one datum and its per-token outputs.

    ``cross_entropy``: ``-sum(weights * logp)``; ``importance_sampling``:
    ``-sum(exp(logp - logprobs) * advantages)``; ``ppo``: the clipped surrogate with
    ``clip_low_threshold`` / ``clip_high_threshold`` (default 0.8 / 1.2) on the ratio.
    """

    def need(name: str) -> torch.Tensor:
        if name not in inputs:
            raise UserError(
                f"loss_fn {loss_fn!r}: every datum needs loss_fn_inputs[{name!r}] "
                f"(given: {sorted(inputs)})."
            )
        t = inputs[name].to(logp.dtype).reshape(-1)
        if t.numel() != logp.numel():
            raise UserError(
                f"loss_fn_inputs[{name!r}] has {t.numel()} values but target_tokens has "
                f"{logp.numel()}; give one value per target token."
            )
        return t

    outputs: dict[str, torch.Tensor] = {"logprobs": logp.detach()}
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        w = need("weights") if weights is not None else torch.ones_like(logp)
        elementwise = -(logp * w)
        outputs["elementwise_loss"] = elementwise.detach()
        return elementwise.sum(), outputs
    if loss_fn in ("importance_sampling", "ppo"):
        old = need("logprobs")
        adv = need("advantages")
        ratio = torch.exp(logp - old)
        if loss_fn == "importance_sampling":
            return -(ratio * adv).sum(), outputs
        low = float(config.get("clip_low_threshold", 0.8))
        high = float(config.get("clip_high_threshold", 1.2))
        clipped = torch.clamp(ratio, low, high)
        return -torch.minimum(ratio * adv, clipped * adv).sum(), outputs
    raise UserError(
        f"loss_fn {loss_fn!r} is not supported by this service; use cross_entropy, "
        "importance_sampling or ppo (or forward_backward_custom, computed on the client)."
    )


class BaseModel:
    """A frozen base model (``AutoModelForCausalLM`` from a local directory) wrapped in peft,
    holding every tenant's adapter and a few sampler slots."""

    def __init__(
        self,
        name: str,
        path: str | Path,
        *,
        device: str = "cpu",
        max_sampler_slots: int = 4,
        sampler: str = "hf",
        sampler_options: Mapping[str, Any] | None = None,
        adapter_dir: str | Path | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from rl_hf._hf import quiet_progress

        self.name = name
        """The name clients use (``base_model``)."""
        self.path = Path(path)
        """The local model directory."""
        if not (self.path / "config.json").is_file():
            raise ConfigError(
                f"models.{name}: {self.path} has no config.json; give a local Hugging Face model "
                "directory (e.g. one rl_hf.tiny.build_tiny_model or `rl-train convert --smollm2` "
                "wrote)."
            )
        self.device = torch.device(device)
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(str(self.path), dtype=torch.float32)
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        """The transformers model (peft adapts it in place on the first adapter)."""
        self.peft: Any = None
        """The ``PeftModel`` once an adapter exists."""
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.path))
        """Its tokenizer (stop strings, EOS)."""
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048) or 2048)
        """Longest sequence a request may hold."""
        # transformers 5 names the KV-cache argument ``cache`` (``past_key_values`` warns); 4.x
        # knows only ``past_key_values`` (as rl_hf.HFGenerator decides).
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._linear = {
            n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
        }
        self._counter = 0
        self._sampler_slots: OrderedDict[str, str] = OrderedDict()
        self._max_sampler_slots = max_sampler_slots
        eos = getattr(model.generation_config, "eos_token_id", None)
        if eos is None:
            eos = self.tokenizer.eos_token_id
        self.eos_ids: set[int] = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        """Token ids that end a sample when ``stop`` is not given."""
        self.generator: Any = None
        """With ``sampler="hf"`` the :class:`~rl_tinker.sampler.GeneratorSampler` (an
        :class:`~rl_hf.HFGenerator` sharing this model's weights) that samples; ``None``
        (``sampler="policy"``): :meth:`sample` decodes with its own loop on the peft model."""
        if sampler == "hf":
            from rl_tinker.sampler import GeneratorSampler

            self.generator = GeneratorSampler(
                model,
                self.tokenizer,
                model_path=str(self.path),
                device=device,
                max_slots=max_sampler_slots,
            )
        elif sampler == "sglang":
            from rl_tinker.sampler import SGLangSampler

            if adapter_dir is None:
                raise ConfigError("sampler sglang: needs adapter_dir (the service passes one).")
            self.generator = SGLangSampler(
                str(self.path),
                self.tokenizer,
                adapter_dir=str(adapter_dir),
                max_slots=max_sampler_slots,
                options=dict(sampler_options or {}),
            )
        elif sampler != "policy":
            raise ConfigError(f"sampler: unknown {sampler!r}; use 'hf', 'policy' or 'sglang'.")

    # adapters -------------------------------------------------------------------------------

    def _add_adapter(self, name: str, lora: LoraSpec) -> None:
        import peft

        config = peft.LoraConfig(
            r=lora.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=lora.targets(self._linear),
            bias="none",
        )
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft reads transformers 5's deprecated is_gradient_checkpointing, and notes that an
            # adapter on a tied LM head is not merged back into the embedding (never done here).
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing")
            warnings.filterwarnings("ignore", message=".*tie_word_embeddings")
            torch.manual_seed(lora.seed)
            if self.peft is None:
                self.peft = peft.get_peft_model(self.model, config, adapter_name=name)
                self.peft.eval()
            else:
                self.peft.add_adapter(name, config)
        for pname, p in self.peft.named_parameters():
            if f".{name}." in pname:
                p.requires_grad_(False)

    def _adapter_params(self, name: str) -> list[tuple[str, torch.nn.Parameter]]:
        marker = f".{name}."
        return [
            (pname.replace(marker, "."), p)
            for pname, p in self.peft.named_parameters()
            if marker in pname and ".lora_" in pname
        ]

    def new_tenant(self, model_id: str, lora: LoraSpec) -> Tenant:
        """Add an adapter (``A`` drawn from ``lora.seed``) with a fresh AdamW."""
        self._counter += 1
        adapter = f"t{self._counter}"
        self._add_adapter(adapter, lora)
        params = self._adapter_params(adapter)
        opt = torch.optim.AdamW(
            [p for _, p in params],
            lr=1e-4,
            betas=(0.9, 0.95),
            eps=1e-12,
            weight_decay=0.0,
            foreach=False,
        )
        return Tenant(
            model_id=model_id, base=self, adapter=adapter, lora=lora, params=params, optimizer=opt
        )

    def drop_tenant(self, tenant: Tenant) -> None:
        """Remove a tenant's adapter and optimizer state (their memory is freed; peft keeps the
        last adapter of a model, which then just stays unused)."""
        tenant.optimizer = None
        tenant.params = []
        peft = self.peft
        if peft is not None and tenant.adapter in peft.peft_config and len(peft.peft_config) > 1:
            peft.delete_adapter(tenant.adapter)

    @contextlib.contextmanager
    def _active(self, adapter: str | None, *, train: bool) -> Iterator[Any]:
        if adapter is None:
            if self.peft is None:
                yield self.model
            else:
                with self.peft.disable_adapter():
                    yield self.peft
            return
        self.peft.base_model.set_adapter(adapter)
        for pname, p in self.peft.named_parameters():
            if ".lora_" in pname:
                p.requires_grad_(train and f".{adapter}." in pname)
        yield self.peft

    # training -------------------------------------------------------------------------------

    def _check_tokens(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            raise UserError("model_input is empty; every datum needs at least one token.")
        if tokens.size > self.max_context:
            raise UserError(
                f"a datum has {tokens.size} tokens, more than {self.name}'s context "
                f"({self.max_context}); shorten it."
            )
        vocab = int(self.model.config.vocab_size)
        if int(tokens.min()) < 0 or int(tokens.max()) >= vocab:
            raise UserError(f"token ids must lie in [0, {vocab}) for {self.name}.")

    def forward_backward(
        self,
        tenant: Tenant,
        data: Sequence[DatumInput],
        loss_fn: str,
        config: Mapping[str, float],
        *,
        backward: bool,
    ) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        """Run ``data`` through ``tenant``'s adapter; with ``backward`` add the loss's
        gradients to the adapter's (they accumulate until :meth:`optim_step`).

        Returns:
            per datum ``{"logprobs": [...], ...}`` (float32, one value per target token) and
            the metrics ``loss:sum`` and ``tokens``.

        Raises:
            UserError: a datum does not fit the loss or the model.
        """
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        tokens = 0
        prepared = self.prepare(data)
        with self._active(tenant.adapter, train=backward) as model:
            for d, target in prepared:
                ids = torch.from_numpy(d.tokens.astype(np.int64)).to(self.device)[None]
                tgt = torch.from_numpy(target).to(self.device)
                inputs = {
                    k: torch.from_numpy(np.asarray(v)).to(self.device)
                    for k, v in d.inputs.items()
                    if k != "target_tokens"
                }
                with torch.set_grad_enabled(backward):
                    logits = model(input_ids=ids).logits[0].float()
                    logp = torch.log_softmax(logits, dim=-1).gather(-1, tgt[:, None])[:, 0]
                    loss, outs = _loss_and_outputs(loss_fn, logp, inputs, config)
                    if backward:
                        loss.backward()
                total += float(loss.detach())
                tokens += int(d.tokens.size)
                outputs.append({k: v.float().cpu().numpy() for k, v in outs.items()})
        if backward:
            tenant.tokens_trained += tokens
        return outputs, {"loss:sum": total, "tokens:sum": float(tokens)}

    def prepare(self, data: Sequence[DatumInput]) -> list[tuple[DatumInput, np.ndarray]]:
        """Check every datum (tokens in range and context, one target per input token).

        Raises:
            UserError: the first datum that does not fit, by index.
        """
        prepared = []
        for i, d in enumerate(data):
            self._check_tokens(d.tokens)
            target = d.inputs.get("target_tokens")
            if target is None:
                raise UserError(f"datum {i}: loss_fn_inputs needs 'target_tokens'.")
            target = target.reshape(-1).astype(np.int64)
            if target.size != d.tokens.size:
                raise UserError(
                    f"datum {i}: target_tokens has {target.size} ids for {d.tokens.size} input "
                    "tokens; give one target per input position."
                )
            self._check_tokens(target)
            prepared.append((d, target))
        return prepared

    def forward_backward_many(
        self,
        items: Sequence[tuple[Tenant, Sequence[DatumInput], str, Mapping[str, float]]],
        *,
        backward: bool,
    ) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        """Several tenants' requests ``(tenant, data, loss_fn, config)`` as ONE multi-LoRA
        batch: every datum a row (right-padded), each row through its own tenant's adapter
        (peft's mixed-adapter forward), one backward of the summed losses. Each adapter's
        gradient comes from its own rows only, so each tenant gets what
        :meth:`forward_backward` gives it alone, within float rounding (not bitwise: the base
        model's matrix products run on a different batch shape).

        Each item must have passed :meth:`prepare`.
        """
        rows: list[tuple[int, DatumInput, np.ndarray]] = []
        for j, (_, data, _, _) in enumerate(items):
            for d, target in self.prepare(data):
                rows.append((j, d, target))
        if not rows:
            return [([], {"loss:sum": 0.0, "tokens:sum": 0.0}) for _ in items]
        width = max(d.tokens.size for _, d, _ in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (_, d, _) in enumerate(rows):
            ids[r, : d.tokens.size] = torch.from_numpy(d.tokens.astype(np.int64))
            mask[r, : d.tokens.size] = 1
        names = [items[j][0].adapter for j, _, _ in rows]
        in_batch = {t.adapter for t, *_ in items}
        for pname, p in self.peft.named_parameters():
            if ".lora_" in pname:
                p.requires_grad_(backward and any(f".{a}." in pname for a in in_batch))
        results: list[tuple[list[dict[str, np.ndarray]], dict[str, float]]] = [
            ([], {"loss:sum": 0.0, "tokens:sum": 0.0}) for _ in items
        ]
        with torch.set_grad_enabled(backward):
            logits = self.peft(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                adapter_names=names,
            ).logits.float()
            losses = []
            for r, (j, d, target) in enumerate(rows):
                n = d.tokens.size
                tgt = torch.from_numpy(target).to(self.device)
                logp = torch.log_softmax(logits[r, :n], dim=-1).gather(-1, tgt[:, None])[:, 0]
                inputs = {
                    k: torch.from_numpy(np.asarray(v)).to(self.device)
                    for k, v in d.inputs.items()
                    if k != "target_tokens"
                }
                loss, outs = _loss_and_outputs(items[j][2], logp, inputs, items[j][3])
                losses.append(loss)
                results[j][0].append({k: v.float().cpu().numpy() for k, v in outs.items()})
                results[j][1]["loss:sum"] += float(loss.detach())
                results[j][1]["tokens:sum"] += float(n)
            if backward:
                torch.stack(losses).sum().backward()
        if backward:
            for j, (tenant, *_) in enumerate(items):
                tenant.tokens_trained += int(results[j][1]["tokens:sum"])
        return results

    def optim_step(self, tenant: Tenant, adam: Mapping[str, float]) -> dict[str, float]:
        """One AdamW step of ``tenant`` with the request's ``AdamParams``; gradients cleared.

        Returns:
            ``grad_norm`` (before clipping), ``learning_rate`` and ``step``.
        """
        assert tenant.optimizer is not None
        params = [p for _, p in tenant.params]
        grads = [p.grad for p in params if p.grad is not None]
        norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        clip = float(adam.get("grad_clip_norm", 0.0))
        if clip > 0 and grads:
            torch.nn.utils.clip_grads_with_norm_(params, clip, torch.tensor(norm))
        for group in tenant.optimizer.param_groups:
            group["lr"] = float(adam.get("learning_rate", 1e-4))
            group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            group["eps"] = float(adam.get("eps", 1e-12))
            group["weight_decay"] = float(adam.get("weight_decay", 0.0))
        tenant.optimizer.step()
        tenant.optimizer.zero_grad(set_to_none=True)
        tenant.steps += 1
        return {
            "grad_norm": norm,
            "learning_rate": float(adam.get("learning_rate", 1e-4)),
            "step": float(tenant.steps),
        }

    # checkpoints ----------------------------------------------------------------------------

    def save(self, tenant: Tenant, directory: Path, *, with_optimizer: bool) -> None:
        """Write ``tenant``'s adapter (and optimizer state) as safetensors + JSON."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in tenant.state_tensors().items()},
            str(directory / "adapter.safetensors"),
        )
        meta = {
            "format": "rl-tinker/1",
            "base_model": self.name,
            "lora": tenant.lora.to_json(),
            "steps": tenant.steps,
            "param_names": [n for n, _ in tenant.params],
            "has_optimizer": with_optimizer,
        }
        if with_optimizer:
            assert tenant.optimizer is not None
            state = tenant.optimizer.state_dict()
            tensors = {}
            for idx, st in state["state"].items():
                for key, value in st.items():
                    tensors[f"{idx}.{key}"] = torch.as_tensor(value).detach().clone().contiguous()
            save_file(tensors, str(directory / "optimizer.safetensors"))
            meta["param_groups"] = [
                {k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]
            ]
        (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    @staticmethod
    def read_meta(directory: Path) -> dict[str, Any]:
        """The ``meta.json`` of a checkpoint :meth:`save` wrote.

        Raises:
            CheckpointError: missing or not one of this service's checkpoints.
        """
        file = directory / "meta.json"
        try:
            meta = json.loads(file.read_text())
        except FileNotFoundError as e:
            raise CheckpointError(f"{file}: no such checkpoint (save it first).") from e
        except ValueError as e:
            raise CheckpointError(f"{file}: not JSON ({e}); the checkpoint is damaged.") from e
        if meta.get("format") != "rl-tinker/1":
            raise CheckpointError(f"{file}: format {meta.get('format')!r}, expected rl-tinker/1.")
        return meta

    def load(self, tenant: Tenant, directory: Path, *, with_optimizer: bool) -> None:
        """Load a checkpoint of :meth:`save` into ``tenant`` (same rank and targets).

        Raises:
            CheckpointError: the checkpoint does not fit the tenant, or holds no optimizer
                state when it is asked for.
        """
        from safetensors.torch import load_file

        meta = self.read_meta(directory)
        if meta["lora"]["rank"] != tenant.lora.rank:
            raise CheckpointError(
                f"{directory}: rank {meta['lora']['rank']} does not fit this training client's "
                f"rank {tenant.lora.rank}; create the client from the checkpoint instead."
            )
        tensors = load_file(str(directory / "adapter.safetensors"))
        names = [n for n, _ in tenant.params]
        if sorted(tensors) != sorted(names):
            raise CheckpointError(
                f"{directory}: its adapter tensors do not match this client's adapter "
                "(different targets); create the client from the checkpoint instead."
            )
        with torch.no_grad():
            for name, p in tenant.params:
                p.copy_(tensors[name].to(p.device, p.dtype))
        tenant.steps = int(meta.get("steps", 0))
        assert tenant.optimizer is not None
        if with_optimizer:
            if not meta.get("has_optimizer"):
                raise CheckpointError(
                    f"{directory}: was saved without optimizer state (save_weights_for_sampler "
                    "or load with optimizer=False); load its weights only."
                )
            saved = load_file(str(directory / "optimizer.safetensors"))
            state: dict[int, dict[str, torch.Tensor]] = {}
            for key, value in saved.items():
                idx, _, leaf = key.partition(".")
                state.setdefault(int(idx), {})[leaf] = value
            groups = [dict(g, params=list(range(len(tenant.params)))) for g in meta["param_groups"]]
            for g in groups:
                g["betas"] = tuple(g["betas"])
            tenant.optimizer.load_state_dict({"state": state, "param_groups": groups})
        else:
            tenant.optimizer.state.clear()

    # sampling -------------------------------------------------------------------------------

    def _sampler_slot(self, key: str, lora: LoraSpec, tensors: Mapping[str, torch.Tensor]) -> str:
        if key in self._sampler_slots:
            self._sampler_slots.move_to_end(key)
            return self._sampler_slots[key]
        if len(self._sampler_slots) >= self._max_sampler_slots:
            _, old = self._sampler_slots.popitem(last=False)
            self.peft.delete_adapter(old)
        self._counter += 1
        slot = f"s{self._counter}"
        self._add_adapter(slot, lora)
        params = self._adapter_params(slot)
        if sorted(n for n, _ in params) != sorted(tensors):
            self.peft.delete_adapter(slot)
            raise CheckpointError(f"sampler weights {key} do not fit {self.name}'s adapter.")
        with torch.no_grad():
            for name, p in params:
                p.copy_(tensors[name].to(p.device, p.dtype))
        self._sampler_slots[key] = slot
        return slot

    def close(self) -> None:
        """Stop the generator (``sampler="hf"`` or ``"sglang"``)."""
        if self.generator is not None:
            self.generator.close()
            self.generator = None

    def forget_sampler(self, key: str) -> None:
        """Drop the sampler slot of ``key`` if loaded."""
        slot = self._sampler_slots.pop(key, None)
        if slot is not None:
            self.peft.delete_adapter(slot)

    @torch.no_grad()
    def sample(
        self,
        prompt: np.ndarray,
        *,
        weights: tuple[str, LoraSpec, Mapping[str, torch.Tensor]] | None,
        num_samples: int,
        max_tokens: int,
        temperature: float,
        top_k: int,
        top_p: float,
        stop: Any,
        seed: int | None,
        prompt_logprobs: bool,
    ) -> SampleResult:
        """Sample ``num_samples`` continuations of ``prompt`` from the base model or a sampler
        snapshot (``weights``: key, LoRA settings and tensors).

        Log-probs are those of the distribution sampled from (temperature, top-k, top-p
        applied); ``temperature`` 0 is greedy (log-probs then at temperature 1).
        """
        self._check_tokens(prompt)
        if prompt.size + max_tokens > self.max_context:
            max_tokens = max(0, self.max_context - int(prompt.size))
        stop_ids: set[int] = set()
        stop_strs: list[str] = []
        if stop is None:
            stop_ids = set(self.eos_ids)
        elif isinstance(stop, str):
            stop_strs = [stop]
        else:
            for s in stop:
                if isinstance(s, str):
                    stop_strs.append(s)
                else:
                    stop_ids.add(int(s))
        if self.generator is not None:
            return self._sample_generator(
                prompt,
                weights=weights,
                num_samples=num_samples,
                max_tokens=max_tokens,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                stop_ids=stop_ids,
                stop_strs=stop_strs,
                seed=seed,
                prompt_logprobs=prompt_logprobs,
            )
        adapter = None
        if weights is not None:
            adapter = self._sampler_slot(weights[0], weights[1], weights[2])
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
        with self._active(adapter, train=False) as model:
            ids = torch.from_numpy(prompt.astype(np.int64)).to(self.device)[None]
            out = model(input_ids=ids.expand(num_samples, -1), use_cache=True)
            plp = None
            if prompt_logprobs:
                lp = torch.log_softmax(out.logits[0, :-1].float(), dim=-1)
                vals = lp.gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()
                plp = [math.nan, *vals]
            logits = out.logits[:, -1].float()
            past = out.past_key_values
            toks: list[list[int]] = [[] for _ in range(num_samples)]
            lps: list[list[float]] = [[] for _ in range(num_samples)]
            reasons = ["length"] * num_samples
            done = [False] * num_samples
            for _ in range(max_tokens):
                scaled = logits / (temperature if temperature > 0 else 1.0)
                if top_k and top_k > 0:
                    kth = torch.topk(scaled, min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
                    scaled = scaled.masked_fill(scaled < kth, -math.inf)
                if top_p < 1.0:
                    sorted_l, order = torch.sort(scaled, descending=True, dim=-1)
                    cum = torch.softmax(sorted_l, -1).cumsum(-1)
                    drop = cum - torch.softmax(sorted_l, -1) > top_p
                    sorted_l = sorted_l.masked_fill(drop, -math.inf)
                    scaled = torch.full_like(scaled, -math.inf).scatter(-1, order, sorted_l)
                logp = torch.log_softmax(scaled, dim=-1)
                if temperature > 0:
                    nxt = torch.multinomial(logp.exp().cpu(), 1, generator=gen)[:, 0]
                else:
                    nxt = logp.argmax(-1).cpu()
                chosen = logp.cpu().gather(-1, nxt[:, None])[:, 0]
                for r in range(num_samples):
                    if done[r]:
                        continue
                    t = int(nxt[r])
                    toks[r].append(t)
                    lps[r].append(float(chosen[r]))
                    if t in stop_ids or (
                        stop_strs and any(s in self.tokenizer.decode(toks[r]) for s in stop_strs)
                    ):
                        done[r] = True
                        reasons[r] = "stop"
                if all(done):
                    break
                out = model(
                    input_ids=nxt[:, None].to(self.device),
                    use_cache=True,
                    **{self._cache_arg: past},
                )
                past = out.past_key_values
                logits = out.logits[:, -1].float()
        return SampleResult(
            sequences=[(toks[r], lps[r], reasons[r]) for r in range(num_samples)],
            prompt_logprobs=plp,
        )

    def _prompt_logprobs(self, prompt: np.ndarray, adapter: str | None) -> list[float]:
        """Log-prob of each prompt token given the ones before (NaN first) under ``adapter``."""
        with self._active(adapter, train=False) as model:
            ids = torch.from_numpy(prompt.astype(np.int64)).to(self.device)[None]
            lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            return [math.nan, *lp.gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()]

    @torch.no_grad()
    def _sample_generator(
        self,
        prompt: np.ndarray,
        *,
        weights: tuple[str, LoraSpec, Mapping[str, torch.Tensor]] | None,
        prompt_logprobs: bool,
        **kw: Any,
    ) -> SampleResult:
        """:meth:`sample` served by :attr:`generator`: the snapshot is a named adapter of the
        generator (loaded once, adapter-only); prompt log-probs (``compute_logprobs``) come
        from a forward of this peft model with the snapshot in a sampler slot."""
        from rl_core.errors import WeightSyncError

        name = None
        if weights is not None:
            key, lora, tensors = weights
            try:
                name = self.generator.adapter(
                    key, lora.rank, LORA_ALPHA, lora.targets(self._linear), tensors
                )
            except WeightSyncError as e:
                raise CheckpointError(f"sampler weights {key} do not fit {self.name}: {e}") from e
        plp = None
        if prompt_logprobs:
            slot = None if weights is None else self._sampler_slot(*weights)
            plp = self._prompt_logprobs(prompt, slot)
        seqs = self.generator.sample(prompt, adapter=name, **kw)
        return SampleResult(sequences=seqs, prompt_logprobs=plp)
