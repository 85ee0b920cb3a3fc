"""rl-hf: the transformers backend on plain PyTorch (``pip install rlpost-hf``).

Real implementations, not fakes: the embedded default on one machine without a GPU, and the
oracle adapters are compared against. Names are imported lazily, so ``import rl_hf``
does not import transformers until one of them is used::

    from rl_hf import HFGenerator, HFPolicy, TinyModelSpec, build_tiny_model

    path = build_tiny_model("runs/tiny", TinyModelSpec(arch="qwen2", hidden_size=64))
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), lr=1e-3))

Without HFPolicy, :func:`packed_logprobs` scores packed sequences with a plain transformers model
(``rl_hf.packed``).
"""

from __future__ import annotations

import importlib
from typing import Any

from rl_hf.version import __version__

__all__ = [
    "TINY_MOE",
    "HFCritic",
    "HFGenerator",
    "HFPolicy",
    "TinyModelSpec",
    "__version__",
    "build_tiny_model",
    "build_tokenizer",
    "packed_logprobs",
]

_LAZY = {
    "HFCritic": "rl_hf.critic",
    "HFGenerator": "rl_hf.generator",
    "HFPolicy": "rl_hf.policy",
    "TINY_MOE": "rl_hf.tiny",
    "TinyModelSpec": "rl_hf.tiny",
    "build_tiny_model": "rl_hf.tiny",
    "build_tokenizer": "rl_hf.tokenizer",
    "packed_logprobs": "rl_hf.packed",
}


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_hf' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (for tab completion)."""
    return sorted(__all__)
