"""The reference :class:`~rl_core.interfaces.Policy` on a Hugging Face causal LM.

Plain PyTorch + transformers on one device: padding-free packed forward with per-sequence
attention, token log-probs and entropy, gradient accumulation over the batch's micro-batch plan,
AdamW with warmup, and save/load in Hugging Face format. It is the embedded default on one
machine without a GPU and the oracle other policies are compared against::

    from rl_hf import HFPolicy, build_tiny_model

    policy = HFPolicy(HFPolicy.Config(model_path=str(build_tiny_model("runs/tiny")), lr=1e-3))
    out = policy.compute_logprobs(batch, with_entropy=True)   # out.logprobs [T], out.entropy [T]
    metrics = policy.train_step(batch, loss_fn)               # {"loss", "grad_norm", "lr", ...}
    transport.publish(policy.version, policy.named_weights())

Tensor-name legend: ``T`` packed tokens, ``S = T - 1`` shifted positions, ``N`` sequences,
``V`` vocabulary.

It is also a :class:`~rl_core.interfaces.WeightTarget` (``weight_version``, ``load_weights``), so a
second instance serves as the frozen reference model for KL losses.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch

from rl_core.config import NonNegInt, OptimizerConfig, PositiveFloat, Range, Seed
from rl_core.errors import CheckpointError, ConfigError, RLError, WeightSyncError
from rl_core.interfaces import LossFn, Policy
from rl_core.logprobs import linear_logprobs
from rl_core.lora import LoRAConfig
from rl_core.memory import HostMemoryTrim
from rl_core.offload import Offloadable, OffloadConfig, TrackedTensors
from rl_core.types import LogProbOutput, ModelShape, TrainBatch
from rl_hf._allocator import MMAP_THRESHOLD_MAX, set_mmap_threshold
from rl_hf._hf import enable_activation_checkpointing, hf_state_dict, token_logprobs
from rl_hf._offload import training_state
from rl_hf._policy_lora import PolicyLoRA

__all__ = ["HFPolicy", "token_logprobs"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

STATE_FILE = "rl_policy_state.pt"
"""File (next to the HF weights) holding the version and, optionally, optimizer and scheduler."""


class HFPolicy(Offloadable, Policy):
    """A trainable Hugging Face causal LM (``AutoModelForCausalLM``) on one device.

    Forward passes are padding-free: each micro-batch runs as one row of ``T`` packed tokens with
    positions reset per sequence and attention confined to each sequence (see
    :mod:`rl_hf._packed_attention`). Dropout is off (the model stays in eval mode).

    With ``Config.lora`` the model is adapted in place through peft (:mod:`rl_hf._lora`): only
    the adapters train, ``named_weights`` yields the merged weights and checkpoints hold the
    adapter (docs/lora.md).

    The policy owns its adapters as an object (:class:`rl_hf._policy_lora.PolicyLoRA`, with
    ``lora``); ``offload``/``onload`` come from :class:`~rl_core.offload.Offloadable`'s public
    contract, with :meth:`tracked_tensors` naming the state (:mod:`rl_hf._offload`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizerConfig):
        """Settings of :class:`HFPolicy` (AdamW settings from
        :class:`~rl_core.config.OptimizerConfig`)."""

        model_path: str
        """Hugging Face model directory (``config.json``, weights, tokenizer files)."""
        temperature: PositiveFloat = 1.0
        """Logits are divided by it before log-softmax, in ``compute_logprobs`` and
        ``train_step``; set it to the rollout sampling temperature."""
        top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
        """Log-probs (and entropy) are renormalised over the top-p candidate set of each
        position (rebuilt from the policy's own temperature-scaled logits), so they are those
        of the distribution a ``top_p`` sampler draws from; set it to the rollout's ``top_p``
        (``rl-train`` does) so importance ratios are unbiased. 1: the full distribution."""
        top_k: NonNegInt = 0
        """As ``top_p``, for the sampler's top-k cut (applied before top-p); 0: off."""
        dtype: Literal["float32", "bfloat16"] = "float32"
        """Parameter and compute dtype (log-softmax always runs in float32)."""
        attn_implementation: Literal["sdpa", "eager"] = "sdpa"
        """``"sdpa"``: packed SDPA of this package (fast, exact). ``"eager"``: transformers'
        eager attention with its own block-diagonal mask from ``position_ids`` (slow, a
        cross-check)."""
        device: str = "cpu"
        """Torch device for the model and optimizer state."""
        seed: Seed = 0
        """Seeds the (private) RNG of each ``train_step`` as ``seed + version``; with dropout
        off nothing random runs today, but stochastic layers stay reproducible."""
        offload: OffloadConfig = field(default_factory=OffloadConfig)
        """What ``offload()`` moves off the device (weights, grads, optimizer state)."""
        logprob_chunk_tokens: NonNegInt = 0
        """When > 0, log-probs and entropy come from the final hidden states through the LM head
        this many positions at a time (:func:`rl_core.logprobs.linear_logprobs`: each chunk's
        logits are recomputed in backward), so no ``[T, V]`` float32 logits are held for the
        whole micro-batch: set it (e.g. 1024) for real vocabularies at long context. 0 (the
        default): the model's own full logits (more memory; values equal within float
        rounding, which on the walkthrough's fixed-seed run changed its learning curve, so the
        default stays the path the learning tests were set on). Not used by ``HFCritic``."""
        logprob_positions: Literal["all", "loss_mask"] = "all"
        """Where log-probs (and entropy) are computed: ``"all"`` every token but sequence starts;
        ``"loss_mask"`` only tokens with ``loss_mask > 0`` (the response; others are 0), which
        saves the prompt's share of the head's work and memory. Every loss reads log-probs only
        under the mask, so training is unchanged."""
        activation_checkpointing: bool = False
        """Recompute each decoder layer's activations in backward (transformers' gradient
        checkpointing, non-reentrant) instead of keeping them: less memory, about one more
        forward of compute per step; gradients unchanged."""
        lora: LoRAConfig | None = None
        """Train low-rank adapters (through ``peft``) instead of every weight; the base stays
        frozen and AdamW holds adapter state only. ``named_weights`` then yields the merged
        weights, ``named_adapter_weights`` the adapter (peft names), ``compute_base_logprobs``
        the base model's log-probs, and checkpoints hold the adapter alone. ``None``: full
        fine-tuning."""
        adamw_impl: Literal["foreach", "fused", "for_loop"] = "foreach"
        """AdamW kernels: ``"foreach"`` (multi-tensor; bitwise ``"for_loop"``, torch's CPU
        default, and faster), ``"fused"`` (fastest, equal within float rounding; TRL's default)."""
        compile_model: bool = False
        """``torch.compile`` the model (inductor, dynamic shapes: packed token counts that change
        every step reuse the graph) at ``compile_scope``. Building the policy pays the compile
        (``compile_warmup``; else the first train step): on 2 CPU cores ~27 s cold, ~8-12 s with
        inductor's on-disk cache warm, for the demo model's layers; later steps are faster
        (docs/performance.md §7); values equal within float
        rounding, so fixed-seed curves differ from eager. Off by default: it wins on runs long
        enough to pay the compile back, so ``rl-train`` turns it on for an RL phase of enough
        steps when the recipe leaves it unset (:mod:`rl_trainer.defaults`)."""
        share_prefix: bool = True
        """Run each micro-batch with the prompt its sequences share (a GRPO group's samples)
        computed once (:class:`rl_hf._packed_attention.SharedPrefix`): every op outside
        attention runs on the prompt once plus each sample's own tokens instead of every
        sample's whole sequence, and the prompt's gradients sum over the group. Log-probs and
        gradients are those of the unshared forward within float rounding (attention reads the
        same values; the projections run on fewer rows), so fixed-seed curves differ slightly
        from ``false``. Used with ``attn_implementation: sdpa`` on dense models (a
        mixture-of-experts model replays routing per token and runs unshared)."""
        compile_warmup: bool = True
        """With ``compile_model``: compile when the policy is built (one forward and backward on
        a dummy batch, start-up time) instead of in the first train step."""
        compile_scope: Literal["layers", "model"] = "layers"
        """What ``compile_model`` compiles: ``"layers"`` each repeated decoder block (regional
        compilation: one block's compile, the faster step on the demo model), ``"model"`` the
        whole forward (one graph; slower to compile)."""
        trim_host_memory: bool = True
        """After a ``train_step``, return the memory the C allocator holds freed (the step's
        temporaries) to the system: glibc ``malloc_trim(0)`` on Linux, a no-op elsewhere. It
        trims after the first step and then whenever the process's resident memory grew by
        256 MiB or more since the last trim (:class:`rl_core.memory.HostMemoryTrim`): a large
        model's temporaries (1.4-1.8 GB on SmolLM2-135M) go back after every step, a tiny
        model's stay for the next step, which would otherwise fault them in again (~25% of the
        demo model's step). Values are unchanged. ``false``: glibc keeps the freed memory."""
        host_mmap_threshold: NonNegInt = 0
        """When > 0 (e.g. 131072), glibc maps every host allocation of at least this many bytes
        on its own and unmaps it when freed (``mallopt(M_MMAP_THRESHOLD)``, as
        ``MALLOC_MMAP_THRESHOLD_`` in the environment; at most 32 MiB), set when the policy is
        built, for the whole process: a step's large temporaries then leave the RSS as soon as
        they are freed instead of piling up in glibc's heap, which lowers the step's peak, not
        only the RSS between steps (SmolLM2-135M full fine-tuning, docs/performance.md §12),
        at the cost of a page fault per fresh page (steps ~20% slower there). Values are
        unchanged. 0 (default): glibc's own threshold. Linux with glibc only (a no-op
        elsewhere)."""

        def __post_init__(self) -> None:
            OptimizerConfig.__post_init__(self)
            if self.compile_scope not in ("layers", "model"):
                raise ConfigError(
                    f"policy.compile_scope: {self.compile_scope!r} is not 'layers' or 'model'."
                )
            if not 0 <= self.host_mmap_threshold <= MMAP_THRESHOLD_MAX:
                raise ConfigError(
                    f"policy.host_mmap_threshold: {self.host_mmap_threshold} is outside 0 (off) "
                    f"to {MMAP_THRESHOLD_MAX} (glibc's largest); e.g. 131072."
                )
            if self.adamw_impl not in ("foreach", "fused", "for_loop"):
                raise ConfigError(
                    f"policy.adamw_impl: {self.adamw_impl!r} is not 'foreach', 'fused' or "
                    "'for_loop'."
                )
            if not self.temperature > 0:
                raise ConfigError(
                    f"policy.temperature: must be > 0, got {self.temperature}; log-probs of "
                    "greedy (temperature 0) sampling are not defined, use 1.0."
                )
            if self.dtype not in ("float32", "bfloat16"):
                raise ConfigError(f"policy.dtype: {self.dtype!r} is not 'float32' or 'bfloat16'.")
            if self.attn_implementation not in ("sdpa", "eager"):
                raise ConfigError(
                    f"policy.attn_implementation: {self.attn_implementation!r} is not 'sdpa' or "
                    "'eager'."
                )
            if self.logprob_positions not in ("all", "loss_mask"):
                raise ConfigError(
                    f"policy.logprob_positions: {self.logprob_positions!r} is not 'all' or "
                    "'loss_mask'."
                )

    supports_offload: ClassVar[bool] = True
    """``offload``/``onload`` move weights, gradients and AdamW state to host memory and back
    bitwise (:mod:`rl_hf._offload`)."""
    supports_routing_replay: ClassVar[bool] = True
    """On a mixture-of-experts model, replays ``TrainBatch.routed_experts`` (a dense model given
    routing raises ``ConfigError``)."""

    def __init__(self, config: Config) -> None:
        """Load the model and tokenizer from ``config.model_path`` and build the optimizer.

        Raises:
            ConfigError: ``model_path`` is missing or is not a Hugging Face model directory.
        """
        from rl_hf._moe import RouterTap
        from rl_hf._packed_attention import load_for_training

        self.config = config
        """The settings this policy was built from (read-only)."""
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"policy.model_path: {str(path)!r} has no config.json; point it at a Hugging Face "
                "model directory (e.g. one written by rl_hf.build_tiny_model)."
            )
        self.device = torch.device(config.device)
        """Device of the model and optimizer state."""
        if config.host_mmap_threshold:
            set_mmap_threshold(config.host_mmap_threshold)
        model = load_for_training(path, getattr(torch, config.dtype), config.attn_implementation)
        self.model = model.to(self.device).eval()
        """The ``transformers`` causal LM (eval mode: dropout off)."""
        self.tokenizer = self._load_tokenizer(path)
        """The tokenizer saved with the model (``AutoTokenizer`` of ``model_path``)."""
        self._check_saveable(path)
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        self._router_tap = RouterTap.attach(self.model)  # None for a dense model
        self._routing_sink: list[torch.Tensor] | None = None
        self._check_head_for_hidden_path(path)
        self._lora: PolicyLoRA | None = None  # the adapters (LoRA only)
        if config.lora is not None:
            self._lora = PolicyLoRA(
                self.model, config.lora, seed=config.seed, base_model=config.model_path
            )
        if config.activation_checkpointing:
            enable_activation_checkpointing(self.model)
        self._version = 0
        self._trim = HostMemoryTrim()  # the allocator trim after train steps, when it pays
        self._params = self._trainable_parameters()
        # torch's foreach kernels cover CPU and CUDA tensors; elsewhere keep the per-tensor loop.
        self._foreach_ok = self.device.type in ("cpu", "cuda")
        self.optimizer = torch.optim.AdamW(  # state is allocated lazily, at the first step
            self._params,
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
            weight_decay=config.weight_decay,
            **self._adamw_impl(),
        )
        self.compiled_modules: list[str] = []
        """Names of the modules ``compile_model`` compiled (empty when off)."""
        self.compile_warmup_s = 0.0
        """Seconds the start-up compile (``compile_warmup``) took."""
        if config.compile_model:  # in place: parameter names, saving and weights unchanged
            from rl_hf._compile import compile_model

            self.compiled_modules = compile_model(self.model, config.compile_scope)
            if config.compile_warmup:
                self.compile_warmup_s = self._compile_warmup()
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0,
        )

    def _compile_warmup(self) -> float:
        """Compile the train forward and backward now (``compile_warmup``); seconds taken."""
        from rl_hf._compile import warm_up

        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            took = warm_up(
                lambda b: self._packed_logprobs(self._on_device(b), with_entropy=False)[0],
                self.model_shape.vocab_size,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return took

    def _adamw_impl(self) -> dict[str, Any]:
        """``foreach`` / ``fused`` of ``torch.optim.AdamW`` for ``config.adamw_impl``."""
        impl = self.config.adamw_impl
        return {"foreach": impl == "foreach", "fused": impl == "fused" or None}

    def _uses_hidden_path(self) -> bool:
        """Log-probs come from hidden states + the LM head (chunked or position-selected)."""
        return self.config.logprob_chunk_tokens > 0 or self.config.logprob_positions != "all"

    def _check_head_for_hidden_path(self, path: Path) -> None:
        """The hidden-state path applies the LM head itself: refuse heads it cannot reproduce
        (a bias, logit scaling or soft-capping the model's own forward applies)."""
        if not self._uses_hidden_path():
            return
        cfg = self.model.config.get_text_config()
        head = self.model.get_output_embeddings()
        extra = [
            name
            for name in ("logit_scale", "logits_scaling", "final_logit_softcapping")
            if getattr(cfg, name, None) not in (None, 1, 1.0)
        ]
        if not isinstance(head, torch.nn.Linear) or head.bias is not None or extra:
            why = f"its config sets {extra}" if extra else "its LM head is not a bias-free Linear"
            raise ConfigError(
                f"policy.logprob_chunk_tokens: the model in {str(path)!r} cannot be scored from "
                f"its hidden states ({why}); set policy.logprob_chunk_tokens: 0 and "
                "policy.logprob_positions: all to use the model's own logits."
            )

    def _trainable_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters the optimizer updates (subclasses add their heads)."""
        return [p for p in self.model.parameters() if p.requires_grad]

    def _check_saveable(self, path: Path) -> None:
        """Write the model's configs as :meth:`save` will, into a scratch directory, so a config
        transformers cannot serialise fails now rather than at the first checkpoint."""
        try:
            with tempfile.TemporaryDirectory() as scratch:
                self.model.config.save_pretrained(scratch)
                if self.model.can_generate():
                    self.model.generation_config.save_pretrained(scratch)
        except Exception as e:  # transformers raises TypeError, ValueError, OSError, ...
            raise ConfigError(
                f"policy.model_path: the config of the model in {str(path)!r} cannot be saved "
                f"({type(e).__name__}: {e}), so no checkpoint or final model could be written. "
                "Fix config.json / generation_config.json there (a value JSON cannot hold, or "
                "generation settings transformers rejects) and start again."
            ) from e

    def _load_tokenizer(self, path: Path) -> Any:
        from transformers import AutoTokenizer

        # transformers 5 silently builds an empty tokenizer when the files are missing.
        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(
                f"policy.model_path: {str(path)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                "save the tokenizer next to the model (tokenizer.save_pretrained(model_path))."
            )
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"policy.model_path: the tokenizer in {str(path)!r} does not load ({exc})."
            ) from exc
        vocab = int(self.model.config.get_text_config().vocab_size)
        if len(tokenizer) > vocab:
            raise ConfigError(
                f"policy.model_path: the tokenizer in {str(path)!r} has {len(tokenizer)} tokens but "
                f"the model's vocabulary has {vocab}; they do not belong together."
            )
        return tokenizer

    # ------------------------------------------------------------------ properties

    @property
    def version(self) -> int:
        """Optimizer steps applied since the initial weights (or the version loaded)."""
        return self._version

    @property
    def weight_version(self) -> int:
        """Same as :attr:`version` (the :class:`~rl_core.interfaces.WeightTarget` name)."""
        return self._version

    @property
    def model_shape(self) -> ModelShape:
        """Architecture numbers read from the Hugging Face config."""
        cfg = self.model.config.get_text_config()
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0
        shared = getattr(cfg, "n_shared_experts", None) or (
            1 if getattr(cfg, "shared_expert_intermediate_size", 0) else 0
        )
        return ModelShape(
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            num_attention_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
            num_experts=int(experts),
            moe_top_k=int(getattr(cfg, "num_experts_per_tok", 0) or 0) if experts else 0,
            num_shared_experts=int(shared) if experts else 0,
            moe_ffn_hidden_size=getattr(cfg, "moe_intermediate_size", None) if experts else None,
            tied_embeddings=self._tied,
        )

    @property
    def lora(self) -> LoRAConfig | None:
        """``config.lora``: the adapter this policy trains, or ``None`` (full fine-tuning)."""
        return self.config.lora

    # ------------------------------------------------------------------ offload

    def tracked_tensors(self) -> TrackedTensors:
        """``(kind, name, tensor)`` of every tensor of the policy's state, weights first
        (:func:`rl_hf._offload.training_state`)."""
        return training_state(self.model, self._params, self.optimizer, self.device)

    # ------------------------------------------------------------------ forward

    @property
    def shares_prefixes(self) -> bool:
        """``share_prefix``, except on a mixture-of-experts model (per-token routing replay)."""
        return self.config.share_prefix and self._router_tap is None

    def _packed_inputs(
        self, batch: TrainBatch
    ) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
        """:func:`rl_hf._packed_attention.packed_inputs` of ``batch`` for this model (prefixes
        shared with ``share_prefix``, except on a mixture-of-experts model)."""
        from rl_hf._packed_attention import packed_inputs

        return packed_inputs(
            batch,
            self.device,
            sdpa=self.config.attn_implementation == "sdpa",
            share_prefix=self.shares_prefixes,
        )

    def _packed_logprobs(
        self, batch: TrainBatch, *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed forward of one micro-batch; ``logp_T`` (and ``entropy_T``) on the model device."""
        tokens_T = batch.tokens.to(self.device)
        if tokens_T.shape[0] == 0:
            return token_logprobs(
                tokens_T.new_zeros(0, 1).float(),
                tokens_T,
                tokens_T.bool(),
                with_entropy=with_entropy,
            )
        position_ids_T, kwargs, expand_T = self._packed_inputs(batch)
        if not self._uses_hidden_path():
            logits_TV = self._forward(batch, lambda: self.model(**kwargs).logits)[0]
            return token_logprobs(
                logits_TV,  # [C, V] on the compact row with shared prefixes
                tokens_T,
                position_ids_T == 0,
                temperature=self.config.temperature,
                with_entropy=with_entropy,
                top_p=self.config.top_p,
                top_k=self.config.top_k,
                rows_T=expand_T,
            )
        # Score from the final hidden states: only the needed positions, in chunks.
        hidden_TH = self._forward(batch, lambda: self.model.base_model(**kwargs).last_hidden_state)[
            0
        ]
        scored_T = position_ids_T > 0
        if self.config.logprob_positions == "loss_mask":
            scored_T &= batch.loss_mask.to(self.device) > 0
        source_S = scored_T.nonzero()[:, 0] - 1  # the position before each scored token
        if expand_T is not None:
            source_S = expand_T[source_S]
        logp_S, ent_S = linear_logprobs(
            hidden_TH.index_select(0, source_S),
            self.model.get_output_embeddings().weight,
            tokens_T[scored_T],
            temperature=self.config.temperature,
            with_entropy=with_entropy,
            chunk_tokens=self.config.logprob_chunk_tokens,
            top_p=self.config.top_p,
            top_k=self.config.top_k,
        )
        zero_T = torch.zeros(tokens_T.shape[0], dtype=torch.float32, device=self.device)
        logp_T = zero_T.masked_scatter(scored_T, logp_S)
        return logp_T, (zero_T.masked_scatter(scored_T, ent_S) if ent_S is not None else None)

    def _forward(self, batch: TrainBatch, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``run()`` (the packed forward of one micro-batch: its logits ``[1, T, V]`` or final
        hidden states ``[1, T, H]``) under the router tap. On a mixture-of-experts model every
        MoE layer uses ``batch.routed_experts`` when given (routing replay, see
        :mod:`rl_hf._moe`), and the router's own choice goes to the routing sink when one is
        open (:meth:`compute_logprobs`)."""
        if self.compiled_modules:  # compiled layers: traced and called with float constants
            from rl_hf._compile import compiled_call

            inner = run
            run = lambda: compiled_call(inner)  # noqa: E731
        tap = self._router_tap
        if tap is None:
            if batch.routed_experts is not None:
                raise ConfigError(
                    "rollout.routing_replay: the batch carries routed_experts but the policy "
                    f"model ({type(self.model).__name__}) has no mixture-of-experts router to "
                    "replay them on; set rollout.routing_replay: off for a dense model."
                )
            return run()
        with tap.recording() as rec, tap.replaying(batch.routed_experts):
            out_1TX = run()
        if self._routing_sink is not None:
            self._routing_sink.append(rec.routing().to(tap.shape.dtype))
        return out_1TX

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` (and entropy ``[T]``) of ``batch.tokens``, without gradients.

        Runs one forward per micro-batch of ``batch.micro_batch_bounds`` (bounding memory) and
        returns float32 tensors on the device of ``batch.tokens``. On a mixture-of-experts model
        ``batch.routed_experts`` (when given) is replayed, and ``routed_experts`` of the output is
        the router's own choice ``[T, L, K]`` (compact dtype), replay or not.
        """
        logps, ents = [], []
        routing: list[torch.Tensor] = []
        self._routing_sink = routing if self._router_tap is not None else None
        try:
            with torch.no_grad():
                for mb in self._micro_batches(batch):
                    logp_T, ent_T = self._packed_logprobs(mb, with_entropy=with_entropy)
                    logps.append(logp_T)
                    if ent_T is not None:
                        ents.append(ent_T)
        finally:
            self._routing_sink = None
        out_device = batch.tokens.device
        logp_T = torch.cat(logps).to(out_device)
        ent_T = torch.cat(ents).to(out_device) if with_entropy else None
        routed_TLK = torch.cat(routing).to(out_device) if routing else None
        return LogProbOutput(logprobs=logp_T, entropy=ent_T, routed_experts=routed_TLK)

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One AdamW step over all micro-batches of ``batch`` (gradients accumulated, not averaged).

        The loss function gets the micro-batch's ``logprobs [T]`` (with gradients), the micro-batch
        itself and, if ``loss_fn.requires_entropy`` is true, the entropy ``[T]`` (else ``None``).

        Returns:
            ``loss`` (sum over micro-batches), ``grad_norm`` (before clipping), ``lr`` (used by
            this step), ``skipped_step`` (1.0 when the gradient norm was not finite: the weights
            and the learning-rate schedule are left unchanged, the version still advances) and the
            sums of the loss function's metrics.
        """
        needs_entropy = bool(getattr(loss_fn, "requires_entropy", False))
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = 0.0
        metric_sums: dict[str, float] = {}
        rng_devices = [self.device] if self.device.type == "cuda" else []
        dropout = self._lora.dropout() if self._lora is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=rng_devices), dropout:
            torch.manual_seed(self.config.seed + self._version)
            for mb in self._micro_batches(batch):
                mb_dev = self._on_device(mb)
                logp_T, ent_T = self._packed_logprobs(mb_dev, with_entropy=needs_entropy)
                out = loss_fn(logp_T, mb_dev, ent_T)
                if out.loss.requires_grad:  # a micro-batch with all-zero weights has none
                    out.loss.backward()
                loss_sum += float(out.loss.detach())
                for name, value in out.metrics.items():
                    metric_sums[name] = metric_sums.get(name, 0.0) + float(value)
        if self._lora is not None:  # each adapter's gradient norm (several), before clipping
            metric_sums.update(self._lora.grad_norms())
        if self.config.grad_clip > 0:
            # foreach: one multi-tensor norm and scale (bitwise equal to the per-tensor loop)
            grad_norm = torch.nn.utils.clip_grad_norm_(
                self._params, self.config.grad_clip, foreach=self._foreach_ok
            )
        else:
            grads = [p.grad for p in self._params if p.grad is not None]
            grad_norm = (
                torch.nn.utils.get_total_norm(grads, foreach=self._foreach_ok)
                if grads
                else torch.zeros(())
            )
        grad_norm_f = float(grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm_f)
        if not skipped:
            self.optimizer.step()
            self.scheduler.step()  # the schedule counts applied updates
        self.optimizer.zero_grad(set_to_none=True)
        self._version += 1
        if self.config.trim_host_memory:
            self._trim()
        metrics = {
            "loss": loss_sum,
            "grad_norm": grad_norm_f,
            "lr": lr,
            "skipped_step": float(skipped),
        }
        metrics.update(metric_sums)
        return metrics

    def _micro_batches(self, batch: TrainBatch) -> Iterator[TrainBatch]:
        """``batch.micro_batches()``, cut by adapter with several (``MultiAdapters.runs``)."""
        if self._lora is None:
            return iter(batch.micro_batches())
        return self._lora.micro_batches(batch)

    def _on_device(self, batch: TrainBatch) -> TrainBatch:
        if batch.tokens.device == self.device:
            return batch
        moved = {
            f.name: getattr(batch, f.name).to(self.device)
            for f in dataclasses.fields(batch)
            if isinstance(getattr(batch, f.name), torch.Tensor)
        }
        return dataclasses.replace(batch, **moved)

    # ------------------------------------------------------------------ weights

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, tensor)`` for every weight, in ``state_dict`` order and naming.

        With tied embeddings ``lm_head.weight`` is omitted: it is the same tensor as
        ``model.embed_tokens.weight``, and neither ``save_pretrained`` files nor SGLang's
        loaders carry it for tied models. Tensors are detached views of the live weights: copy
        them if you keep them across a ``train_step``.

        With ``lora`` the adapted weights are merged (``W + scaling * B @ A``, fresh tensors)
        under their Hugging Face names; neither adapter tensors nor peft's ``base_layer`` names
        appear.
        """
        if self._lora is not None:
            yield from self._lora.merged_weights(
                frozenset({"lm_head.weight"} if self._tied else ())
            )
            return
        for name, tensor in self.model.state_dict().items():
            if self._tied and name == "lm_head.weight":
                continue
            yield name, tensor.detach()

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy the named tensors into the model and set the version (``WeightTarget``).

        All names and shapes are checked before any weight changes. Names not given keep their
        values; for a tied model ``lm_head.weight`` is accepted and written to the shared matrix.

        With ``lora``, Hugging Face names write the frozen *base* weights (the merged view is
        then base plus adapter) and peft names (:meth:`named_adapter_weights`) the adapter.

        Raises:
            WeightSyncError: an unknown name or a shape mismatch (nothing is changed).
        """
        self._copy_in(dict(named_tensors), error=WeightSyncError, source="load_weights")
        self._version = int(version)

    def _copy_in(
        self, tensors: dict[str, torch.Tensor], *, error: type[RLError], source: str
    ) -> None:
        state = self._live_state()
        if self._tied and "lm_head.weight" in tensors:
            lm_head = tensors.pop("lm_head.weight")
            tensors.setdefault("model.embed_tokens.weight", lm_head)
        for name, tensor in tensors.items():
            if name not in state:
                raise error(
                    f"{source}: unknown weight {name!r}; expected Hugging Face names such as "
                    f"{next(iter(state))!r} of this {type(self.model).__name__}."
                )
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise error(
                    f"{source}: weight {name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(state[name].shape)}; is it from a different model config?"
                )
        with torch.no_grad():
            for name, tensor in tensors.items():
                state[name].copy_(tensor)

    def _live_state(self) -> dict[str, torch.Tensor]:
        """The live tensors by the names :meth:`load_weights` takes: the ``state_dict`` names,
        and with ``lora`` the base weights under Hugging Face names plus the adapter tensors
        under peft names."""
        state = self.model.state_dict()
        if self._lora is None:
            return state
        return self._lora.live_state(state)

    # ------------------------------------------------------------------ LoRA

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The adapter tensors in peft naming, exactly as ``peft.get_peft_model_state_dict``
        gives them (``base_model.model.<module>.lora_A.weight`` ``[r, in]``, ``lora_B``
        ``[out, r]``), detached views of the live tensors. With several adapters
        (``lora.adapters``): every adapter's, named ``<adapter>/<peft name>``
        (:func:`rl_core.lora.adapter_tensor_name`, the multi-adapter update's naming).

        Raises:
            ConfigError: the policy has no adapter (``lora`` is not set).
        """
        if self._lora is None:
            yield from Policy.named_adapter_weights(self)
            return
        yield from self._lora.named_adapter_weights()

    def compute_base_logprobs(self, batch: TrainBatch) -> LogProbOutput:
        """:meth:`compute_logprobs` of the frozen base model (adapters disabled through peft's
        ``disable_adapter()``): the KL reference without a second copy of the model.

        Raises:
            ConfigError: the policy has no adapter (``lora`` is not set).
        """
        if self._lora is None:
            return Policy.compute_base_logprobs(self, batch)
        with self._lora.base_view():
            return self.compute_logprobs(batch)

    # ------------------------------------------------------------------ checkpoints

    def save(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Write a Hugging Face model directory plus :data:`STATE_FILE`.

        ``directory`` gets ``config.json``, ``generation_config.json``, ``model.safetensors``,
        the tokenizer files, and ``rl_policy_state.pt`` with the version (and, if
        ``with_optimizer``, the AdamW and scheduler states). ``AutoModelForCausalLM`` loads it as
        is. The state file is written last.

        The weights go to disk first, as a plain safetensors state dict in Hugging Face naming
        (``model.safetensors``), before transformers converts anything: if ``save_pretrained``
        fails (say, a config that does not serialise), the trained weights are still there.

        With ``lora`` the directory holds the adapter alone, in peft format
        (``adapter_config.json``, ``adapter_model.safetensors``; ``peft.PeftModel.from_pretrained``
        loads it on the base), plus :data:`rl_hf._lora.BASE_FILE` naming the base model (path
        and checksum, checked by :meth:`load`) and the state file; :meth:`save_merged` writes
        the merged Hugging Face model. With several adapters (``lora.adapters``) each has its
        own peft directory, ``directory/<adapter>/``.

        Raises:
            CheckpointError: transformers could not write the model directory; the message
                names the weights file that was written and the cause.
        """
        out = Path(directory)
        if self._lora is not None:
            self._lora.write_checkpoint(out)  # one peft directory per adapter with several
        else:
            self._save_hf(out)
        self._save_state(out, with_optimizer=with_optimizer)

    def save_merged(self, directory: str | Path) -> None:
        """Write the model as :meth:`save` does without ``lora``: a Hugging Face directory of the
        merged weights (:meth:`named_weights`) that ``AutoModelForCausalLM`` loads, plus the state
        file (version only). Without ``lora`` it is ``save(with_optimizer=False)``.

        Raises:
            CheckpointError: transformers could not write the model directory.
        """
        out = Path(directory)
        self._save_hf(out)
        self._save_state(out, with_optimizer=False)

    def _save_hf(self, out: Path) -> None:
        """The Hugging Face model directory of :meth:`named_weights` (see :meth:`save`)."""
        from safetensors.torch import save_file

        from rl_hf._hf import quiet_progress

        out.mkdir(parents=True, exist_ok=True)
        raw = out / "model.safetensors"
        weights = {n: t.detach().to("cpu").contiguous() for n, t in self.named_weights()}
        save_file(weights, str(raw.with_suffix(".tmp")), metadata={"format": "pt"})
        raw.with_suffix(".tmp").replace(raw)
        # transformers writes into a side directory; its files replace the raw ones only once
        # all of them are written.
        hf_dir = out / ".hf-save"
        shutil.rmtree(hf_dir, ignore_errors=True)
        try:
            with quiet_progress():
                if self._lora is None:
                    self.model.save_pretrained(str(hf_dir))
                else:  # the merged weights, in the base model's layout
                    self.model.save_pretrained(str(hf_dir), state_dict=weights)
            self.tokenizer.save_pretrained(str(hf_dir))
        except Exception as e:  # transformers raises TypeError, ValueError, OSError, ...
            shutil.rmtree(hf_dir, ignore_errors=True)
            raise CheckpointError(
                f"{out}: the weights are saved in {raw} (a plain safetensors state dict with "
                f"Hugging Face names), but transformers failed to write the model directory: "
                f"{type(e).__name__}: {e}. Fix the model's config.json / generation_config.json "
                "so save_pretrained works, then load the weights with "
                "safetensors.torch.load_file and save again."
            ) from e
        # Saved configs must load with stock transformers: name the public implementation.
        cfg_path = hf_dir / "config.json"
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("_attn_implementation") or cfg.get("attn_implementation"):
            cfg.pop("_attn_implementation", None)
            cfg.pop("attn_implementation", None)
            cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        written = {f.name for f in hf_dir.iterdir()}
        for f in sorted(hf_dir.iterdir()):
            f.replace(out / f.name)
        hf_dir.rmdir()
        if raw.name not in written:  # transformers sharded the weights: its files replace ours
            raw.unlink()

    def _save_state(self, out: Path, *, with_optimizer: bool) -> None:
        """:data:`STATE_FILE` (version, optimizer and scheduler), written last."""
        state: dict[str, Any] = {"format": 1, "version": self._version}
        if with_optimizer:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        tmp = out / (STATE_FILE + ".tmp")
        torch.save(state, tmp)
        tmp.replace(out / STATE_FILE)
        _match_umask(out)

    def load(self, directory: str | Path, *, with_optimizer: bool = True) -> None:
        """Restore weights, version and (if ``with_optimizer``) optimizer state from :meth:`save`.

        Raises:
            CheckpointError: files are missing, a weight is missing or has the wrong shape, or
                the optimizer state was asked for but not saved.
        """
        from safetensors.torch import load_file

        src = Path(directory)
        state_path = src / STATE_FILE
        if self._lora is not None:  # an adapter checkpoint: its base must be this policy's base
            if not state_path.is_file():
                raise CheckpointError(
                    f"{src}: not a policy checkpoint (no {STATE_FILE}); write one with "
                    "HFPolicy.save."
                )
            adapter = self._lora.read_checkpoint(src)
            state = self._read_state(state_path, with_optimizer=with_optimizer)
            self._copy_in(adapter, error=CheckpointError, source=str(src))
            self._restore_state(state, with_optimizer=with_optimizer)
            return
        files = sorted(src.glob("*.safetensors"))
        if not files or not state_path.is_file():
            raise CheckpointError(
                f"{src}: not a policy checkpoint (needs *.safetensors and {STATE_FILE}); write one "
                "with HFPolicy.save."
            )
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        expected = {n for n, _ in self.named_weights()}
        missing = sorted(expected - set(tensors))
        if missing and (src / "config.json").is_file():
            # transformers saves some families in their hub layout (Qwen3-MoE: one tensor per
            # expert) and fuses them on load; let it convert back to the in-memory names.
            tensors = hf_state_dict(src, self.model.dtype)
            missing = sorted(expected - set(tensors))
        if missing:
            raise CheckpointError(
                f"{src}: weights {missing[:3]} missing from the checkpoint; was it saved from "
                "a different model?"
            )
        state = self._read_state(state_path, with_optimizer=with_optimizer)
        self._copy_in(tensors, error=CheckpointError, source=str(src))
        self._restore_state(state, with_optimizer=with_optimizer)

    def _read_state(self, state_path: Path, *, with_optimizer: bool) -> dict[str, Any]:
        state = torch.load(state_path, map_location=self.device, weights_only=True)
        if with_optimizer and "optimizer" not in state:
            raise CheckpointError(
                f"{state_path}: saved without optimizer state; load with with_optimizer=False."
            )
        return state

    def _restore_state(self, state: dict[str, Any], *, with_optimizer: bool) -> None:
        if with_optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            for group in self.optimizer.param_groups:  # the configured AdamW, not the saved one
                group.update(self._adamw_impl())
        self._version = int(state["version"])


def _match_umask(directory: Path) -> None:
    """Give the files of a saved model the mode the umask gives new files: safetensors writes
    ``model.safetensors`` ``0600`` (through a temporary file), unlike every other file."""
    mask = os.umask(0)
    os.umask(mask)
    mode = 0o666 & ~mask
    for p in directory.rglob("*"):
        if p.is_file() and not p.is_symlink() and (p.stat().st_mode & 0o777) != mode:
            p.chmod(mode)
