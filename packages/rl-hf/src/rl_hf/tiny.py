"""Tiny random causal LMs, built from a config (no downloads), for tests and demos.

::

    path = build_tiny_model(tmp_path / "tiny")                     # qwen2, hidden 64, 2 layers
    path = build_tiny_model(tmp_path / "ll", TinyModelSpec(arch="llama", hidden_size=32))
    model = AutoModelForCausalLM.from_pretrained(path)             # what HFPolicy loads

The directory holds ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32)
and the tokenizer files of :func:`~rl_hf.tokenizer.build_tokenizer` (or the one
passed in). The same spec (seed included) gives bitwise-identical weights.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from rl_core.config import PositiveInt, Seed
from rl_core.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TINY_MOE", "TinyModelSpec", "build_tiny_model", "tiny_model_config"]


@dataclass(frozen=True, slots=True, kw_only=True)
class TinyModelSpec:
    """Architecture and seed of a tiny random model."""

    arch: Literal["qwen2", "llama", "qwen3_moe"] = "qwen2"
    """Hugging Face ``model_type``: ``"qwen2"`` (q/k/v biases), ``"llama"`` (no biases) or
    ``"qwen3_moe"`` (Qwen3 mixture-of-experts: every layer's MLP is ``num_experts`` routed
    experts, ``moe_top_k`` per token, top-k probabilities renormalised)."""
    hidden_size: PositiveInt = 64
    """Model width."""
    num_layers: PositiveInt = 2
    """Transformer layers."""
    num_heads: PositiveInt = 4
    """Query heads; ``hidden_size`` must be divisible by it."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention when fewer than ``num_heads``)."""
    intermediate_size: PositiveInt = 128
    """SwiGLU MLP width."""
    tie_word_embeddings: bool = True
    """Share the embedding matrix with the LM head."""
    max_position_embeddings: PositiveInt = 4096
    """Longest sequence the rotary embedding is configured for."""
    seed: Seed = 0
    """Seed of the random initialisation."""
    num_experts: PositiveInt = 8
    """Routed experts per MoE layer (``qwen3_moe`` only)."""
    moe_top_k: PositiveInt = 2
    """Experts each token is sent to (``qwen3_moe`` only)."""
    moe_intermediate_size: PositiveInt = 64
    """SwiGLU width of one expert (``qwen3_moe`` only)."""
    router_init_std: float | None = None
    """Standard deviation of the router weights at initialisation (``qwen3_moe`` only);
    ``None`` = the model's ``initializer_range`` (0.02), which leaves the router near uniform."""

    def __post_init__(self) -> None:
        if self.arch not in ("qwen2", "llama", "qwen3_moe"):
            raise ConfigError(
                f"TinyModelSpec.arch: {self.arch!r} is not 'qwen2', 'llama' or 'qwen3_moe'."
            )
        if self.moe_top_k > self.num_experts:
            raise ConfigError(
                f"TinyModelSpec.moe_top_k: {self.moe_top_k} exceeds num_experts="
                f"{self.num_experts}; a token cannot go to more experts than exist."
            )
        if self.hidden_size % self.num_heads:
            raise ConfigError(
                f"TinyModelSpec.hidden_size: {self.hidden_size} is not divisible by num_heads="
                f"{self.num_heads}; pick a multiple."
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"TinyModelSpec.num_kv_heads: {self.num_kv_heads} does not divide num_heads="
                f"{self.num_heads}."
            )


def tiny_model_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerBase) -> Any:
    """The ``transformers`` config of ``spec`` with ids taken from ``tokenizer``."""
    from transformers import AutoConfig

    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    moe: dict[str, Any] = {}
    if spec.arch == "qwen3_moe":
        moe = {
            "num_experts": spec.num_experts,
            "num_experts_per_tok": spec.moe_top_k,
            "moe_intermediate_size": spec.moe_intermediate_size,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
        }
    return AutoConfig.for_model(
        spec.arch,
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **moe,
    )


def build_tiny_model(
    save_dir: str | Path,
    spec: TinyModelSpec = TinyModelSpec(),
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Build a random float32 causal LM from ``spec`` and save it, with its tokenizer, to ``save_dir``.

    Args:
        save_dir: output directory (created if missing; existing model files are overwritten).
        spec: architecture and seed.
        tokenizer: tokenizer to save alongside (its length sets the vocabulary size); default
            :func:`~rl_hf.tokenizer.build_tokenizer`.

    Returns:
        ``save_dir`` as a :class:`~pathlib.Path`, loadable by ``AutoModelForCausalLM`` and
        ``AutoTokenizer`` and usable as ``HFPolicy.Config.model_path``.
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from rl_hf._hf import quiet_progress
    from rl_hf.tokenizer import build_tokenizer

    out = Path(save_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else build_tokenizer()
    config = tiny_model_config(spec, tok)

    # Seed a private generator state so building a model does not disturb the caller's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if spec.arch == "qwen3_moe" and spec.router_init_std is not None:
            from rl_hf._moe import find_routers

            with torch.no_grad():
                for router in find_routers(model):
                    router.weight.normal_(0.0, spec.router_init_std)
    model.eval()
    with quiet_progress():
        model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    (out / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out


TINY_MOE = TinyModelSpec(
    arch="qwen3_moe",
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    num_experts=8,
    moe_top_k=2,
    moe_intermediate_size=64,
    router_init_std=0.5,
)
"""A tiny Qwen3-MoE: 2 layers, 8 experts, top-2 (renormalised), expert width 64. The router
weights start at std 0.5 so its logits are not near-uniform (with the stock 0.02 every routing
is a near tie and any float round-off flips it)."""
