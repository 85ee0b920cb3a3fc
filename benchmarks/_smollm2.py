"""SmolLM2-135M's shape and a random model of it, shared by the memory and GPU benchmarks (no
download: the weights are random, the tokenizer is rl_hf's byte-level one)."""

from __future__ import annotations

from pathlib import Path

VOCAB = 49152
"""SmolLM2's vocabulary size."""

SMOLLM2_135M = {
    "vocab_size": VOCAB,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 8192,
}
"""The architecture of SmolLM2-135M (``num_hidden_layers`` 30 in the real model)."""


def build_model(directory: Path, layers: int, dtype: str) -> Path:
    """A random SmolLM2-135M-shaped Llama with ``layers`` layers, in ``dtype`` (a torch dtype
    name such as ``"float32"``), and the test tokenizer, saved to ``directory``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rl_hf.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(
        **SMOLLM2_135M,
        num_hidden_layers=layers,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory
