"""HFPolicy is composed, not assembled from private mixins (STYLE.md section 6, issue #35): its
bases are rl-core's public contracts only, and the adapters are an object it owns."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from rl_core.interfaces import Policy
from rl_core.lora import LoRAConfig
from rl_core.offload import Offloadable
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model
from rl_hf._policy_lora import PolicyLoRA


def test_bases_are_public_rl_core_contracts_only() -> None:
    assert HFPolicy.__mro__ == (HFPolicy, Offloadable, Policy, *Policy.__mro__[1:])


def test_the_adapters_are_an_object_the_policy_owns(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    model = build_tiny_model(tmp_path / "m", TinyModelSpec(arch="llama", hidden_size=32))
    full = HFPolicy(HFPolicy.Config(model_path=str(model)))
    assert full._lora is None and full.lora is None
    lora = HFPolicy(HFPolicy.Config(model_path=str(model), lora=LoRAConfig(rank=2)))
    assert isinstance(lora._lora, PolicyLoRA)
    assert lora._lora.model is lora.model and lora.lora is lora.config.lora
