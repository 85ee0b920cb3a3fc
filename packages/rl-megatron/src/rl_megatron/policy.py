"""A :class:`~rl_core.interfaces.Policy` on megatron-core: tensor, pipeline and data parallel.

Every rank of the job builds the policy with the same config and calls the same methods in the
same order (they are collective)::

    # torchrun --nproc-per-node 4 train.py   (or any launcher that sets RANK, WORLD_SIZE, ...)
    policy = MegatronPolicy(MegatronPolicy.Config(model_path="runs/tiny", tp_size=2, lr=1e-5))
    batch = my_shard_of_the_step(policy.layout.dp_rank)       # a TrainBatch per DP rank
    out = policy.compute_logprobs(batch, with_entropy=True)   # [T] on every rank of the DP group
    metrics = policy.train_step(batch, loss_fn)               # summed over micro-batches and DP
    weights = dict(policy.named_weights())                    # full HF tensors on every rank

Ranks of one tensor-parallel group and of one pipeline must get the same batch; data-parallel
ranks get different batches whose ``loss_weights`` were computed over the whole step, because
gradients are *summed* across data-parallel ranks (the loss of a step is ``sum_t x_t w_t`` over
all ranks).

How it runs: the model is a Megatron ``GPTModel`` (local layer spec) built from the Hugging Face
``config.json`` (:mod:`rl_megatron.convert`), wrapped in Megatron's ``DistributedDataParallel``
and trained with ``get_megatron_optimizer`` (Adam with decoupled weight decay, optionally the
distributed optimizer). Each micro-batch of a packed :class:`~rl_core.types.TrainBatch` is run
padded, one sequence per row (``[N, L]``, causal attention; the padding sits after each row's
tokens so no valid token attends to it): megatron-core's local attention has no packed
(``thd``) path, and padded rows are exact. Log-probs and entropy come from the vocabulary-parallel
logits (:mod:`rl_megatron.logprobs`); the full vocabulary is never gathered. With
``pp_size > 1`` micro-batches run through Megatron's 1F1B schedule (shapes exchanged per
micro-batch); the loss function runs on the last stage only, and log-probs and metrics are
broadcast from it so every rank returns the same values.

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``L`` longest sequence, ``S`` scored
positions, ``V`` this rank's vocabulary slice.

Structure: this module holds the config, model construction, the forward and the train step.
The policy owns its other concerns as parts, each an object with its own state built from what it
needs: the pipeline schedule (:class:`rl_megatron._pipeline.PipelineSchedule`), the HF weight
exchange (:class:`rl_megatron._weights.HFWeights`), routing replay of a mixture-of-experts model
(:class:`rl_megatron._routing.RoutingReplay`), the LoRA adapters
(:class:`rl_megatron._lora.PolicyLoRA`, with ``policy.lora``) and checkpoints
(:class:`rl_megatron._checkpoints.PolicyCheckpoints`); offload lists its tensors with
:func:`rl_megatron._offload.tracked_tensors`. The public methods below delegate to them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import torch

from rl_core.config import (
    NonNegFloat,
    NonNegInt,
    OptimizerConfig,
    PositiveFloat,
    PositiveInt,
    Range,
    Seed,
)
from rl_core.errors import ConfigError, WeightSyncError
from rl_core.interfaces import LossFn, Policy
from rl_core.lora import LoRAConfig
from rl_core.offload import Offloadable, OffloadConfig, TrackedTensors
from rl_core.types import LogProbOutput, ModelShape, TrainBatch
from rl_megatron._checkpoints import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT  # re-export
from rl_megatron._checkpoints import OPTIM_DIR as OPTIM_DIR  # re-export
from rl_megatron._checkpoints import STATE_FILE as STATE_FILE  # re-export
from rl_megatron._checkpoints import PolicyCheckpoints
from rl_megatron._lora import PolicyLoRA, read_adapter
from rl_megatron._moe import MoESettings
from rl_megatron._offload import tracked_tensors
from rl_megatron._pipeline import PipelineSchedule, to_device
from rl_megatron._routing import RoutingReplay
from rl_megatron._weights import HFWeights
from rl_megatron.convert import (
    HFWeightMap,
    padded_vocab_size,
    split_megatron_args,
    transformer_config_from_hf,
)
from rl_megatron.logprobs import (
    chunked_vocab_parallel_logprobs,
    emit_hidden_states,
    vocab_parallel_logprobs,
)
from rl_megatron.parallel import ParallelLayout, current_device, init_parallel

__all__ = ["MegatronPolicy"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_RECOMPUTE_FIELDS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


class MegatronPolicy(Offloadable, Policy):
    """A trainable Llama / Qwen2 / Qwen3 / Qwen3-MoE causal LM on megatron-core (see the module
    docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizerConfig):
        """Settings of :class:`MegatronPolicy` (Adam settings from
        :class:`~rl_core.config.OptimizerConfig`, the same as ``HFPolicy``'s)."""

        model_path: str
        """Hugging Face model directory (``config.json``, safetensors weights, tokenizer)."""
        temperature: PositiveFloat = 1.0
        """Logits are divided by it before log-softmax; set it to the sampling temperature."""
        top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
        """Log-probs and entropy are renormalised over each position's top-p candidate set
        (rebuilt from the policy's own logits, :func:`rl_core.logprobs.truncate_logits`); set
        it to the rollout's ``top_p`` (``rl-train`` does). 1: off. Needs ``tp_size: 1``."""
        top_k: NonNegInt = 0
        """As ``top_p``, for the sampler's top-k cut; 0: off. Needs ``tp_size: 1``."""
        tp_size: PositiveInt = 1
        """Tensor-parallel size; must divide the key/value heads."""
        pp_size: PositiveInt = 1
        """Pipeline-parallel size; must divide the number of layers (even split)."""
        dp_size: NonNegInt = 0
        """Data-parallel size; 0 derives it as world size / (tp_size * pp_size), any other
        value must equal that."""
        expert_model_parallel_size: Annotated[int, Range(ge=1)] = 1
        """Expert-parallel size of a mixture-of-experts model: each group of this many ranks
        splits the experts of every MoE layer evenly (must divide ``num_experts``); tokens
        travel to their experts by all-to-all. 1 for a dense model."""
        expert_tensor_parallel_size: Annotated[int, Range(ge=0)] = 0
        """Tensor-parallel size inside each expert; 0 = ``tp_size`` (must divide
        ``moe_intermediate_size``)."""
        moe_aux_loss_coeff: NonNegFloat | None = None
        """Load-balancing (auxiliary) loss coefficient of the MoE routers; ``None`` takes
        ``router_aux_loss_coef`` from config.json, 0 turns the loss off."""
        use_distributed_optimizer: bool = False
        """Shard optimizer state across data-parallel ranks (Megatron's distributed optimizer)."""
        dtype: Literal["float32", "bfloat16"] = "float32"
        """Parameter dtype; ``bfloat16`` (fp32 main weights in the optimizer) needs a GPU."""
        make_vocab_size_divisible_by: PositiveInt = 128
        """The vocabulary is padded to a multiple of this times ``tp_size`` (padding is masked
        out of every softmax and trimmed from exported weights)."""
        megatron_args: dict[str, Any] = field(default_factory=dict)
        """Megatron-native options, each a field of megatron-core's ``TransformerConfig``,
        ``DistributedDataParallelConfig`` or ``OptimizerConfig`` (e.g.
        ``{"recompute_granularity": "selective"}``); validated when the policy is built.
        Architecture fields come from ``config.json`` and are refused here."""
        seed: Seed = 0
        """Seed of Megatron's model-parallel RNG tracker."""
        offload: OffloadConfig = field(default_factory=OffloadConfig)
        """What ``offload()`` moves off the device (weights, grad buffers, optimizer state)."""
        logprob_chunk_tokens: NonNegInt = 1024
        """The model returns final hidden states and log-probs/entropy come from this rank's
        vocabulary slice of the LM head this many positions at a time
        (:func:`rl_megatron.logprobs.chunked_vocab_parallel_logprobs`; logits recomputed in
        backward), so no ``[T, V/tp]`` float32 logits are held for a whole micro-batch. 0: the
        output layer's full vocabulary-parallel logits (more memory, same values)."""
        recompute_granularity: Literal["none", "selective", "full"] = "none"
        """Activation recomputation (megatron-core's ``recompute_granularity``): ``"selective"``
        recomputes core attention, ``"full"`` whole layers (see ``recompute_method``); less
        memory for more compute, gradients unchanged."""
        recompute_method: Literal["uniform", "block"] = "uniform"
        """With ``"full"``: ``"uniform"`` checkpoints groups of ``recompute_num_layers`` layers,
        ``"block"`` the first ``recompute_num_layers`` layers of each pipeline stage."""
        recompute_num_layers: PositiveInt = 1
        """Layers per checkpointed group (``"uniform"``) or checkpointed layers per stage
        (``"block"``), with ``recompute_granularity="full"``."""
        lora: LoRAConfig | None = None
        """Train LoRA adapters on the decoder layers' linear layers, the base frozen
        (:mod:`rl_megatron._lora`; TP, PP and DP, not sequence parallel or MoE); ``None``: full
        fine-tuning."""
        lora_init: str | None = None
        """A peft adapter directory to start the adapters from (needs ``lora`` with its rank,
        alpha and targets); ``None``: a fresh adapter (``B = 0``, the base model's outputs)."""

        def __post_init__(self) -> None:
            OptimizerConfig.__post_init__(self)
            if not self.temperature > 0:
                raise ConfigError(
                    f"policy.temperature: must be > 0, got {self.temperature}; use the sampling "
                    "temperature (1.0 for greedy rollouts)."
                )
            if self.tp_size < 1:
                raise ConfigError(f"policy.tp_size: must be >= 1, got {self.tp_size}.")
            if (self.top_p < 1 or self.top_k > 0) and self.tp_size > 1:
                raise ConfigError(
                    f"policy.top_p/top_k (from rollout.sampling: top_p={self.top_p}, "
                    f"top_k={self.top_k}): top-p/top-k-aware log-probs are not supported with "
                    f"tensor parallelism (policy.tp_size={self.tp_size}; the candidate threshold "
                    "would need the global sorted vocabulary). Use policy.tp_size: 1, or sample "
                    "with top_p: 1.0 and top_k: 0."
                )
            if self.pp_size < 1:
                raise ConfigError(f"policy.pp_size: must be >= 1, got {self.pp_size}.")
            if self.expert_model_parallel_size < 1:
                raise ConfigError(
                    "policy.expert_model_parallel_size: must be >= 1, got "
                    f"{self.expert_model_parallel_size}."
                )
            if self.expert_tensor_parallel_size < 0:
                raise ConfigError(
                    "policy.expert_tensor_parallel_size: must be >= 0 (0 = tp_size), got "
                    f"{self.expert_tensor_parallel_size}."
                )
            if self.moe_aux_loss_coeff is not None and not self.moe_aux_loss_coeff >= 0:
                raise ConfigError(
                    f"policy.moe_aux_loss_coeff: must be >= 0 (or null for config.json's "
                    f"router_aux_loss_coef), got {self.moe_aux_loss_coeff}."
                )
            if self.dp_size < 0:
                raise ConfigError(f"policy.dp_size: must be >= 0 (0 = derive), got {self.dp_size}.")
            if self.dtype not in ("float32", "bfloat16"):
                raise ConfigError(f"policy.dtype: {self.dtype!r} is not 'float32' or 'bfloat16'.")
            if self.make_vocab_size_divisible_by < 1:
                raise ConfigError(
                    "policy.make_vocab_size_divisible_by: must be >= 1, got "
                    f"{self.make_vocab_size_divisible_by}."
                )
            if not isinstance(self.megatron_args, dict):
                raise ConfigError(
                    f"policy.megatron_args: expected a mapping of Megatron option names to values, "
                    f"got {type(self.megatron_args).__name__}."
                )
            if self.recompute_granularity not in ("none", "selective", "full"):
                raise ConfigError(
                    f"policy.recompute_granularity: {self.recompute_granularity!r} is not "
                    "'none', 'selective' or 'full'."
                )
            if self.recompute_method not in ("uniform", "block"):
                raise ConfigError(
                    f"policy.recompute_method: {self.recompute_method!r} is not 'uniform' or "
                    "'block'."
                )
            if self.lora is not None and self.lora.adapters:
                raise ConfigError(
                    f"policy.lora.adapters: {list(self.lora.adapters)}: MegatronPolicy trains one "
                    "adapter; multi-LoRA runs on HFPolicy (policy.type: hf), or drop "
                    "policy.lora.adapters."
                )
            if self.lora_init is not None and self.lora is None:
                raise ConfigError(
                    "policy.lora_init: is set but policy.lora is not; set policy.lora (rank, "
                    "alpha, target_modules of the adapter) to train from an adapter."
                )
            clash = sorted(set(self.megatron_args) & set(_RECOMPUTE_FIELDS))
            if clash:
                raise ConfigError(
                    f"policy.megatron_args: {clash} are set by policy.recompute_granularity / "
                    "recompute_method / recompute_num_layers; set them there instead."
                )

        def recompute_overrides(self) -> dict[str, Any]:
            """The ``TransformerConfig`` fields of the recompute settings (none when off)."""
            if self.recompute_granularity == "none":
                return {}
            if self.recompute_granularity == "selective":
                return {"recompute_granularity": "selective"}
            return {
                "recompute_granularity": "full",
                "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers,
            }

    supports_offload: ClassVar[bool] = True
    """``offload``/``onload`` move this rank's weights, gradient buffers and optimizer state
    (fp32 master weights and Adam moments, sharded or not) to host memory and back bitwise
    (:mod:`rl_megatron._offload`)."""
    supports_routing_replay: ClassVar[bool] = True
    """A mixture-of-experts model replays ``TrainBatch.routed_experts`` through megatron-core's
    router replay and reports its own routing (a dense model refuses routing)."""

    def __init__(self, config: Config) -> None:
        """Initialise the process groups, build the model from ``config.model_path``, load its
        weights into this rank's shards, and build DDP and the optimizer (collective).

        Raises:
            ConfigError: a bad path, an unsupported model, a bad layout or Megatron option.
        """
        from transformers import AutoConfig

        self.config = config
        """The settings this policy was built from (read-only)."""
        path = Path(config.model_path)
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"policy.model_path: {str(path)!r} has no config.json; point it at a Hugging Face "
                "model directory (e.g. one written by rl_hf.build_tiny_model)."
            )
        if config.dtype == "bfloat16" and not torch.cuda.is_available():
            raise ConfigError(
                "policy.dtype: 'bfloat16' needs a CUDA device (Megatron's mixed-precision "
                "optimizer is GPU-only); use 'float32' on CPU."
            )
        split = split_megatron_args(config.megatron_args)
        self.layout: ParallelLayout = init_parallel(
            config.tp_size,
            config.pp_size,
            config.dp_size or None,
            config.seed,
            ep_size=config.expert_model_parallel_size,
            etp_size=config.expert_tensor_parallel_size or None,
        )
        """This rank's place in the tensor/pipeline/data-parallel layout."""
        self.hf_config = AutoConfig.from_pretrained(str(path))
        """The Hugging Face model config the Megatron model was built from."""
        self._params_dtype = getattr(torch, config.dtype)
        moe = MoESettings(
            ep_size=self.layout.ep_size,
            etp_size=self.layout.etp_size,
            ep_rank=self.layout.ep_rank,
            etp_rank=self.layout.etp_rank,
            aux_loss_coeff=config.moe_aux_loss_coeff,
        )
        self.tconfig, gpt_kwargs = transformer_config_from_hf(
            self.hf_config,
            tp_size=config.tp_size,
            pp_size=config.pp_size,
            params_dtype=self._params_dtype,
            overrides={**split["transformer"], **config.recompute_overrides()},
            moe=moe,
        )
        num_layers = int(self.tconfig.num_layers)
        if num_layers % config.pp_size:
            raise ConfigError(
                f"policy.pp_size: {config.pp_size} does not divide the {num_layers} layers of "
                "config.json; pick a pp_size that divides num_hidden_layers."
            )
        self._vocab = gpt_kwargs["vocab_size"]
        self._padded_vocab = padded_vocab_size(
            self._vocab, config.tp_size, config.make_vocab_size_divisible_by
        )
        self.tokenizer = self._load_tokenizer(path)
        """The tokenizer saved with the model (``AutoTokenizer`` of ``model_path``)."""
        self.module = self._build_model(gpt_kwargs)
        """The unwrapped Megatron ``GPTModel`` of this rank."""
        if config.logprob_chunk_tokens > 0 and self.module.post_process:
            from megatron.core import parallel_state as ps

            emit_hidden_states(self.module.output_layer, ps.get_tensor_model_parallel_group())
        self._routing = RoutingReplay(self.module, self.hf_config, self.layout)
        """Routing replay and recording of a mixture-of-experts model (no-ops when dense)."""
        self._weights = HFWeights(
            self.module,
            self.hf_config,
            self.layout,
            num_layers=num_layers,
            padded_vocab=self._padded_vocab,
            moe=moe,
            params_dtype=self._params_dtype,
        )
        """Full Hugging Face tensors out of and into this rank's shards."""
        self.weight_map: HFWeightMap = self._weights.weight_map
        """The HF <-> Megatron weight mapping of this rank's stage."""
        self._freeze_padding_embedding()
        self._weights.load_hf_dir(path, error=ConfigError)
        self._lora: PolicyLoRA | None = None
        """The adapters (``policy.lora``); ``None`` for full fine-tuning."""
        if config.lora is not None:
            self._lora = PolicyLoRA(
                config.lora,
                self.module,
                self.hf_config,
                self.tconfig,
                self.layout,
                seed=config.seed,
                params_dtype=self._params_dtype,
            )
            if config.lora_init:
                self._lora.load_adapter_weights(read_adapter(config.lora_init, config.lora).items())
        self._build_ddp_and_optimizer(split)
        self._pipeline = PipelineSchedule(
            self.model, prepare=self._prepare, head=self._logits_to_logp, routing=self._routing
        )
        """The 1F1B schedule over the pipeline stages (used with ``pp_size > 1``)."""
        self._checkpoints = PolicyCheckpoints(
            module=self.module,
            optimizer=self.optimizer,
            weights=self._weights,
            export=self.named_weights,
            lora=self._lora,
            layout=self.layout,
            model_path=config.model_path,
            hf_config=self.hf_config,
            tokenizer=self.tokenizer,
            use_distributed_optimizer=config.use_distributed_optimizer,
        )
        """``save`` / ``load`` of this policy's state."""
        self._version = 0
        self._applied_steps = 0

    # ------------------------------------------------------------------ construction

    def _load_tokenizer(self, path: Path) -> Any:
        from transformers import AutoTokenizer

        if not any((path / f).is_file() for f in _TOKENIZER_FILES):
            raise ConfigError(
                f"policy.model_path: {str(path)!r} has no tokenizer files "
                f"({', '.join(_TOKENIZER_FILES)}); save the tokenizer next to the model."
            )
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        if len(tokenizer) > self._vocab:
            raise ConfigError(
                f"policy.model_path: the tokenizer in {str(path)!r} has {len(tokenizer)} tokens but "
                f"the model's vocabulary has {self._vocab}; they do not belong together."
            )
        return tokenizer

    def _build_model(self, gpt_kwargs: dict[str, Any]) -> Any:
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_layer_local_spec,
        )

        if self.tconfig.num_moe_experts:
            from rl_megatron._moe import patch_missing_te_gemm, use_sequence_parallel_norms

            patch_missing_te_gemm()
            spec = use_sequence_parallel_norms(
                get_gpt_decoder_block_spec(
                    self.tconfig, use_transformer_engine=False, normalization="RMSNorm"
                )
            )
        else:
            spec = get_gpt_layer_local_spec(
                normalization="RMSNorm", qk_layernorm=bool(self.tconfig.qk_layernorm)
            )
        with torch.random.fork_rng(devices=[]):
            model = GPTModel(
                config=self.tconfig,
                transformer_layer_spec=spec,
                vocab_size=self._padded_vocab,
                max_sequence_length=gpt_kwargs["max_sequence_length"],
                pre_process=ps.is_pipeline_first_stage(),
                post_process=ps.is_pipeline_last_stage(),
                parallel_output=True,
                share_embeddings_and_output_weights=gpt_kwargs[
                    "share_embeddings_and_output_weights"
                ],
                position_embedding_type=gpt_kwargs["position_embedding_type"],
                rotary_base=gpt_kwargs["rotary_base"],
            )
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        return model

    def _freeze_padding_embedding(self) -> None:
        """Match ``nn.Embedding(padding_idx=pad_token_id)`` of the HF model: the lookup of the
        pad token passes no gradient to its embedding row (the LM head still does when tied)."""
        pad = getattr(self.hf_config.get_text_config(), "pad_token_id", None)
        if pad is None or not self.module.pre_process:
            return

        tp_rank = self.layout.tp_rank

        def block_pad_gradient(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> Any:
            input_ids = args[0]
            is_pad = (input_ids == pad).unsqueeze(-1)
            if input_ids.shape[:2] != output.shape[:2]:  # [s, b, h] layout
                is_pad = is_pad.transpose(0, 1)
                rows = output.shape[0]
                if is_pad.shape[0] != rows:  # sequence parallel: this TP rank's rows
                    is_pad = is_pad[tp_rank * rows : (tp_rank + 1) * rows]
            return torch.where(is_pad, output.detach(), output)

        self.module.embedding.word_embeddings.register_forward_hook(block_pad_gradient)

    def _build_ddp_and_optimizer(self, split: dict[str, dict[str, Any]]) -> None:
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
        )
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.config
        ddp_kwargs: dict[str, Any] = {
            "grad_reduce_in_fp32": True,
            "overlap_grad_reduce": False,
            "use_distributed_optimizer": cfg.use_distributed_optimizer,
            **split["ddp"],
        }
        try:
            ddp_config = DistributedDataParallelConfig(**ddp_kwargs)
            self.model = DistributedDataParallel(
                config=self.tconfig, ddp_config=ddp_config, module=self.module
            )
            """The DDP-wrapped model (what forward and backward run on)."""
            opt_kwargs: dict[str, Any] = {
                "optimizer": "adam",
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
                "adam_beta1": cfg.adam_beta1,
                "adam_beta2": cfg.adam_beta2,
                "adam_eps": cfg.adam_eps,
                "clip_grad": cfg.grad_clip,
                "params_dtype": self._params_dtype,
                "bf16": self._params_dtype == torch.bfloat16,
                "use_distributed_optimizer": cfg.use_distributed_optimizer,
                **split["optimizer"],
            }
            self.optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kwargs), [self.model])
            """The Megatron optimizer (a ``ChainedOptimizer`` over Adam)."""
        except (AssertionError, TypeError, ValueError) as exc:
            raise ConfigError(
                f"policy.megatron_args: megatron-core rejects the DDP/optimizer settings ({exc})."
            ) from exc

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
        """Architecture numbers read from the Hugging Face config (true, unpadded vocabulary;
        experts, top-k and expert width of a mixture-of-experts model)."""
        cfg = self.hf_config.get_text_config()
        heads = int(cfg.num_attention_heads)
        moe: dict[str, Any] = {}
        if self.is_moe:
            moe = {
                "num_experts": int(cfg.num_experts),
                "moe_top_k": int(cfg.num_experts_per_tok),
                "num_shared_experts": 0,
                "moe_ffn_hidden_size": int(cfg.moe_intermediate_size),
            }
        return ModelShape(
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            num_attention_heads=heads,
            num_kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
            ffn_hidden_size=int(cfg.intermediate_size),
            vocab_size=self._vocab,
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        """Whether the model has mixture-of-experts layers."""
        return self._routing.is_moe

    @property
    def lora(self) -> LoRAConfig | None:
        """The adapter settings this policy trains with (``policy.lora``), or ``None``."""
        return self.config.lora

    # ------------------------------------------------------------------ weights

    def _reload_optimizer(self) -> None:
        """Refresh the optimizer's copy of the weights (its fp32 main weights) after a load."""
        reload = getattr(getattr(self, "optimizer", None), "reload_model_params", None)
        if callable(reload):
            reload()

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full tensor)`` for every weight, in Hugging Face ``state_dict`` order.

        Tensor-parallel shards are gathered and the vocabulary padding trimmed, so every rank
        yields the same full tensors: a collective, every rank must consume the iterator to the
        end. With tied embeddings ``lm_head.weight`` is omitted (as ``HFPolicy``). At TP=1 the
        tensors are detached views of the live weights: copy them if you keep them across a
        ``train_step``. With ``policy.lora`` the adapted ones are merged (``W + scaling * B @
        A``), so a generator without adapter support serves the trained model.
        """
        if self._lora is None:
            yield from self._weights.named_weights()
            return
        yield from self._lora.merged(self._weights.named_weights())

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None:
        """Copy Hugging Face-named full tensors into this rank's shards and set the version.

        Collective (every rank passes the same tensors). Names and shapes are checked before any
        weight changes; names not given keep their values (a fused Megatron tensor such as qkv
        is completed from the current weights); for a tied model ``lm_head.weight`` is accepted
        and written to the shared matrix.

        Raises:
            WeightSyncError: an unknown name or a shape mismatch (nothing is changed).
        """
        self._weights.copy_in(named_tensors, error=WeightSyncError, source="load_weights")
        self._reload_optimizer()
        self._version = int(version)

    # ------------------------------------------------------------------ checkpoints

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
        records the base model's identity.

        Raises:
            CheckpointError: (every rank, before the optimizer state is written, so no state
                file) the distributed optimizer's state would not load back as it is; see
                :func:`~rl_megatron.checkpoint.save_distributed`.
        """
        self._checkpoints.save(
            Path(directory),
            version=self._version,
            applied_steps=self._applied_steps,
            with_optimizer=with_optimizer,
        )

    def save_merged(self, directory: str | Path) -> None:
        """Write the merged model (:meth:`named_weights`: base plus ``scaling * B @ A``) as a
        Hugging Face directory that ``AutoModelForCausalLM`` (and this policy without ``lora``)
        loads, with a state file holding the version and no optimizer state (collective).
        Without ``policy.lora`` it is ``save(with_optimizer=False)``."""
        if self._lora is None:
            self.save(directory, with_optimizer=False)
            return
        self._checkpoints.save_merged(
            Path(directory), version=self._version, applied_steps=self._applied_steps
        )

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
        self._version, self._applied_steps = self._checkpoints.load(
            Path(directory), with_optimizer=with_optimizer
        )

    # ------------------------------------------------------------------ LoRA

    def _need_lora(self) -> PolicyLoRA:
        if self._lora is None:
            raise ConfigError(
                f"{type(self).__name__} has no LoRA adapter: set policy.lora (e.g. {{rank: 8}}) "
                "to train one."
            )
        return self._lora

    def named_adapter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full adapter tensors in peft naming (``base_model.model.model.layers.0.self_attn.
        q_proj.lora_A.weight`` ...), in peft's order: gathered over TP and broadcast from the
        stage that holds each layer, so every rank yields every tensor (collective; consume it
        to the end on every rank).

        Raises:
            ConfigError: the policy has no adapter (``policy.lora`` is not set).
        """
        if self._lora is None:
            yield from super().named_adapter_weights()  # raises the named error
            return
        yield from self._lora.named_adapter_weights()

    def load_adapter(self, directory: str) -> None:
        """Load a peft adapter directory (``adapter_config.json`` + safetensors, as peft's
        ``save_pretrained`` or :func:`rl_core.lora.save_adapter` write it) into the adapters
        (every rank, same directory). Rank, alpha, rslora and targets must equal ``policy.lora``.

        Raises:
            ConfigError: the policy has no adapter, or the adapter's settings differ.
            WeightSyncError: a tensor is missing, unknown or of the wrong shape.
        """
        tensors = read_adapter(directory, self.config.lora)
        self._need_lora().load_adapter_weights(tensors.items())
        self._reload_optimizer()

    def load_adapter_weights(self, named_tensors: Any) -> None:
        """Copy full peft-named adapter tensors into this rank's shards (all of them, checked
        before anything changes).

        Raises:
            ConfigError: the policy has no adapter (``policy.lora`` is not set).
            WeightSyncError: a tensor is missing, unknown or of the wrong shape.
        """
        self._need_lora().load_adapter_weights(named_tensors)
        self._reload_optimizer()

    def adapters_disabled(self) -> contextlib.AbstractContextManager[None]:
        """A context within which the model runs as the frozen base (adapters skipped; a no-op
        without ``policy.lora``)."""
        return self._lora.disabled() if self._lora is not None else contextlib.nullcontext()

    def compute_base_logprobs(self, batch: TrainBatch) -> LogProbOutput:
        """Log-probs ``[T]`` of the frozen base (adapters disabled): the KL reference without a
        second copy of the base (collective, as :meth:`compute_logprobs`).

        Raises:
            ConfigError: the policy has no adapter (``policy.lora`` is not set).
        """
        if self._lora is None:
            return super().compute_base_logprobs(batch)
        with self._lora.disabled():
            return self.compute_logprobs(batch)

    # ------------------------------------------------------------------ offload

    def tracked_tensors(self) -> TrackedTensors:
        """``(kind, name, tensor)`` of this rank's state, weights first (a storage's first
        kind decides whether it moves; see :mod:`rl_megatron._offload`)."""
        return tracked_tensors(self.module, self.model, self.optimizer, current_device().type)

    # ------------------------------------------------------------------ forward

    def _forward(
        self, batch: TrainBatch, *, with_entropy: bool, routing: list[torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Padded forward of one micro-batch: ``logp_T`` (and ``entropy_T``) on the model device.

        A MoE model replays ``batch.routed_experts`` when given and appends its routers' own
        choice ``[T, L_stage, K]`` to ``routing``."""
        prep = self._prepare(batch)
        if prep is None:
            zero_T = torch.zeros(0, dtype=torch.float32, device=current_device())
            return zero_T, (zero_T if with_entropy else None)
        self._routing.begin(batch, prep)
        logits_NLV = self.model(
            prep["tokens_NL"], prep["positions_NL"], None, runtime_gather_output=False
        )
        own_TLK = self._routing.end(prep)
        if routing is not None and own_TLK is not None:
            routing.append(own_TLK)
        return self._logits_to_logp(logits_NLV, prep, with_entropy=with_entropy)

    def _prepare(self, batch: TrainBatch) -> dict[str, torch.Tensor] | None:
        """Padded ``[N, L]`` inputs and the index tensors to score ``[T]`` (``None`` if empty)."""
        device = current_device()
        tokens_T = batch.tokens.to(device)
        if tokens_T.shape[0] == 0:
            return None
        cu_N1 = batch.cu_seqlens.to(device)
        lengths_N = cu_N1[1:] - cu_N1[:-1]
        n, max_len = int(lengths_N.shape[0]), int(lengths_N.max())
        if self.tconfig.sequence_parallel:  # the sequence axis is split over the TP ranks
            max_len = -(-max_len // self.layout.tp_size) * self.layout.tp_size
        seq_T = batch.seq_index().to(device)
        pos_T = batch.position_ids().to(device)
        flat_T = seq_T * max_len + pos_T
        tokens_NL = tokens_T.new_zeros(n * max_len).index_copy(0, flat_T, tokens_T).view(n, max_len)
        positions_NL = torch.arange(max_len, device=device).expand(n, max_len)
        scored_T = pos_T > 0
        return {
            "tokens_T": tokens_T,
            "tokens_NL": tokens_NL,
            "positions_NL": positions_NL,
            "scored_T": scored_T,
            "source_S": flat_T[scored_T] - 1,  # the position before each scored token
            "seq_T": seq_T,
            "pos_T": pos_T,
        }

    def _logits_to_logp(
        self, logits_NLV: torch.Tensor, prep: dict[str, torch.Tensor], *, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from megatron.core import parallel_state as ps

        tokens_T, scored_T = prep["tokens_T"], prep["scored_T"]
        zero_T = torch.zeros(tokens_T.shape[0], dtype=torch.float32, device=tokens_T.device)
        if self.config.logprob_chunk_tokens > 0:  # the model returned hidden states [N, L, H]
            module = self.module
            weight_VH = (
                module.shared_embedding_or_output_weight()
                if module.share_embeddings_and_output_weights
                else module.output_layer.weight
            )
            hidden_NLH = logits_NLV
            logp_S, ent_S = chunked_vocab_parallel_logprobs(
                hidden_NLH.reshape(-1, hidden_NLH.shape[-1]).index_select(0, prep["source_S"]),
                weight_VH,
                tokens_T[scored_T],
                vocab_start=self.layout.tp_rank * weight_VH.shape[0],
                vocab_size=self._vocab,
                group=ps.get_tensor_model_parallel_group(),
                chunk_tokens=self.config.logprob_chunk_tokens,
                temperature=self.config.temperature,
                with_entropy=with_entropy,
                top_p=self.config.top_p,
                top_k=self.config.top_k,
            )
            logp_T = zero_T.masked_scatter(scored_T, logp_S)
            ent_T = zero_T.masked_scatter(scored_T, ent_S) if ent_S is not None else None
            return logp_T, ent_T
        width = logits_NLV.shape[-1]
        logits_SV = logits_NLV.reshape(-1, width).index_select(0, prep["source_S"])
        logp_S, ent_S = vocab_parallel_logprobs(
            logits_SV,
            tokens_T[scored_T],
            vocab_start=self.layout.tp_rank * width,
            vocab_size=self._vocab,
            group=ps.get_tensor_model_parallel_group(),
            temperature=self.config.temperature,
            with_entropy=with_entropy,
            top_p=self.config.top_p,
            top_k=self.config.top_k,
        )
        logp_T = zero_T.masked_scatter(scored_T, logp_S)
        ent_T = zero_T.masked_scatter(scored_T, ent_S) if ent_S is not None else None
        return logp_T, ent_T

    def compute_logprobs(self, batch: TrainBatch, *, with_entropy: bool = False) -> LogProbOutput:
        """Log-probs ``[T]`` (and entropy ``[T]``) of ``batch.tokens``, without gradients.

        One forward per micro-batch; float32 results on ``batch.tokens``' device, identical on
        every rank of a tensor/pipeline-parallel group (collective over that group). A
        mixture-of-experts model replays ``batch.routed_experts`` when given and always returns
        its routers' own choice (``routed_experts`` ``[T, L, K]``, compact dtype).

        Raises:
            ConfigError: ``batch.routed_experts`` on a dense model, or of the wrong shape.
        """
        self._routing.check(batch)
        routing: list[torch.Tensor] = []
        out = batch.tokens.device
        if self.layout.pp_size > 1:
            with torch.no_grad():
                logp_T, ent_T = self._pipeline.logprobs(
                    batch, with_entropy=with_entropy, routing=routing
                )
            return LogProbOutput(
                logprobs=logp_T.to(out),
                entropy=ent_T.to(out) if ent_T is not None else None,
                routed_experts=self._routing.join(routing, batch.num_tokens),
            )
        logps, ents = [], []
        with torch.no_grad():
            for mb in batch.micro_batches():
                logp_T, ent_T = self._forward(mb, with_entropy=with_entropy, routing=routing)
                logps.append(logp_T)
                if ent_T is not None:
                    ents.append(ent_T)
        return LogProbOutput(
            logprobs=torch.cat(logps).to(out),
            entropy=torch.cat(ents).to(out) if with_entropy else None,
            routed_experts=self._routing.join(routing, batch.num_tokens),
        )

    # ------------------------------------------------------------------ training

    def _lr_now(self) -> float:
        warmup = self.config.warmup_steps
        scale = min(1.0, (self._applied_steps + 1) / warmup) if warmup > 0 else 1.0
        return self.config.lr * scale

    def train_step(self, batch: TrainBatch, loss_fn: LossFn) -> dict[str, float]:
        """One optimizer step over the micro-batches of ``batch`` (collective over all ranks).

        Gradients are accumulated over micro-batches and summed over data-parallel ranks (never
        averaged). The returned ``loss`` and loss-function metrics are sums over micro-batches
        *and* data-parallel ranks (the step values, the same on every rank); ``grad_norm`` is the
        global norm before clipping; ``lr`` the rate of this step; ``skipped_step`` 1.0 when the
        norm was not finite (weights and schedule unchanged, version still advances). With
        pipeline parallelism ``loss_fn`` is called on the last stage only. A mixture-of-experts
        model replays ``batch.routed_experts`` when given and adds its load-balancing loss
        (``moe_aux_loss_coeff`` times the mean over micro-batches) to the gradients.

        Raises:
            ConfigError: ``batch.routed_experts`` on a dense model, or of the wrong shape.
        """
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        self._routing.check(batch)
        needs_entropy = bool(getattr(loss_fn, "requires_entropy", False))
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        sums: dict[str, float] = {"loss": 0.0}

        def record(out_loss: Any) -> None:
            sums["loss"] += float(out_loss.loss.detach())
            for name, value in out_loss.metrics.items():
                sums[name] = sums.get(name, 0.0) + float(value)

        with self._routing.aux_loss_scale(len(batch.micro_batches())):
            if self.layout.pp_size > 1:
                self._pipeline.train(batch, loss_fn, needs_entropy=needs_entropy, record=record)
            else:
                for mb in batch.micro_batches():
                    logp_T, ent_T = self._forward(mb, with_entropy=needs_entropy)
                    out_loss = loss_fn(logp_T, to_device(mb, logp_T.device), ent_T)
                    if out_loss.loss.requires_grad:
                        out_loss.loss.backward()
                    record(out_loss)
        finalize_model_grads([self.model])

        lr = self._lr_now()
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group.get("lr_mult", 1.0)
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            if self.config.grad_clip > 0:
                for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
                    params = opt.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, self.config.grad_clip, grad_norm)
            self.optimizer.step_with_ready_grads()
            self._applied_steps += 1
        self._version += 1

        is_last = ps.is_pipeline_last_stage()
        totals = _sum_step_values(
            sums if is_last else {}, count=is_last and self.layout.tp_rank == 0
        )
        metrics = {
            "loss": totals.pop("loss"),
            "grad_norm": grad_norm,
            "lr": lr,
            "skipped_step": float(skipped),
        }
        metrics.update(totals)
        return metrics


def _sum_step_values(values: dict[str, float], *, count: bool) -> dict[str, float]:
    """Sum named floats over the ranks with ``count`` True (one per data-parallel replica: TP
    rank 0 of the last pipeline stage); every rank gets the same result."""
    world = torch.distributed.get_world_size()
    if world == 1:
        return dict(values)
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, values if count else {})
    names = sorted({k for d in gathered for k in d})
    # Sum in rank order so every rank reports the same value.
    return {k: float(sum(float(d.get(k, 0.0)) for d in gathered)) for k in names}
