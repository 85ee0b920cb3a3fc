"""Reference backends on plain PyTorch / transformers (extra ``rl-core[hf]``).

Real implementations, not fakes: the embedded default on one machine without a GPU, and the
oracle adapters are compared against. Names are imported lazily, so ``import rl_core.reference``
does not import transformers until one of them is used::

    from rl_core.reference import HFGenerator, HFPolicy, TinyModelSpec, build_tiny_model

    path = build_tiny_model("runs/tiny", TinyModelSpec(arch="qwen2", hidden_size=64))
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), lr=1e-3))
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "HFCritic",
    "HFGenerator",
    "HFPolicy",
    "TinyModelSpec",
    "build_tiny_model",
    "build_tokenizer",
]

_LAZY = {
    "HFCritic": "rl_core.reference.critic",
    "HFGenerator": "rl_core.reference.generator",
    "HFPolicy": "rl_core.reference.policy",
    "TinyModelSpec": "rl_core.reference.tiny",
    "build_tiny_model": "rl_core.reference.tiny",
    "build_tokenizer": "rl_core.reference.tokenizer",
}


def __getattr__(name: str) -> Any:
    """Import public names on first use (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'rl_core.reference' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (for tab completion)."""
    return sorted(__all__)
