"""rl_core.lora: the config, the peft file format, merging and adapter-only updates."""

from __future__ import annotations

import json

import pytest
import torch

from rl_core.errors import ConfigError, WeightSyncError
from rl_core.lora import (
    ADAPTER_CONFIG_FILE,
    LoRAConfig,
    adapter_of,
    load_adapter,
    merge_adapter,
    module_of,
    peft_name,
    save_adapter,
    with_adapter,
)
from rl_core.types import WeightUpdate

Q = "model.layers.0.self_attn.q_proj"


def test_scaling_and_targets():
    assert LoRAConfig(rank=8, alpha=16).scaling == 2.0
    assert LoRAConfig(rank=16, alpha=8, use_rslora=True).scaling == 2.0
    cfg = LoRAConfig(target_modules=("q_proj",))
    assert cfg.targets(Q) and not cfg.targets("model.layers.0.self_attn.k_proj")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"target_modules": ()}, "target_modules"),
        ({"target_modules": ("a.b",)}, "target_modules"),
        ({"name": "a/b"}, "name"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"policy.lora.{field}"):
        LoRAConfig(**kwargs)


def test_names_round_trip_with_or_without_prefix():
    assert module_of(peft_name(Q, "A")) == (Q, "A")
    assert module_of(f"{Q}.lora_B.weight") == (Q, "B")
    with pytest.raises(WeightSyncError, match="peft naming"):
        module_of(f"{Q}.weight")


def test_save_load_merge(tmp_path):
    lora = LoRAConfig(rank=2, alpha=6, target_modules=("q_proj",))
    a_RI, b_OR, w_OI = torch.randn(2, 4), torch.randn(3, 2), torch.randn(3, 4)
    save_adapter(tmp_path, [(f"{Q}.lora_A.weight", a_RI), (f"{Q}.lora_B.weight", b_OR)], lora)
    tensors, back = load_adapter(tmp_path)
    assert back.rank == 2 and back.alpha == 6 and back.target_modules == ("q_proj",)
    assert torch.equal(tensors[peft_name(Q, "A")], a_RI)
    merged = merge_adapter({f"{Q}.weight": w_OI}, tensors, back)
    torch.testing.assert_close(merged[f"{Q}.weight"], w_OI + 3 * b_OR @ a_RI)
    with pytest.raises(WeightSyncError, match="another model"):
        merge_adapter({}, tensors, back)
    with pytest.raises(WeightSyncError, match="does not match"):
        merge_adapter({f"{Q}.weight": torch.zeros(3, 5)}, tensors, back)


def test_peft_patterns_are_refused(tmp_path):
    save_adapter(tmp_path, [(f"{Q}.lora_A.weight", torch.zeros(1, 2))], LoRAConfig(rank=1))
    data = json.loads((tmp_path / ADAPTER_CONFIG_FILE).read_text())
    (tmp_path / ADAPTER_CONFIG_FILE).write_text(json.dumps({**data, "rank_pattern": {"q": 4}}))
    with pytest.raises(ConfigError, match="rank_pattern"):
        load_adapter(tmp_path)
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load_adapter(tmp_path / "missing")


def test_update_marker_round_trips():
    plain = WeightUpdate(version=3, base_version=None, transport="disk_full")
    assert adapter_of(plain) is None
    marked = with_adapter(plain, LoRAConfig(rank=4, name="solver"), base_model="/m")
    info = adapter_of(marked)
    assert info is not None and info.name == "solver" and info.lora.rank == 4
    assert info.config["base_model_name_or_path"] == "/m" and marked.version == 3
    bad = WeightUpdate(version=3, base_version=None, transport="x", metadata={"lora_adapter": 1})
    with pytest.raises(WeightSyncError, match="lora_adapter"):
        adapter_of(bad)


def test_multi_adapter_update_marker_round_trips_and_splits() -> None:
    """Multi-LoRA: one update names every adapter; its tensors split back by adapter."""
    from rl_core.errors import WeightSyncError
    from rl_core.lora import (
        LoRAConfig,
        adapter_of,
        adapter_tensor_name,
        split_adapters,
        with_adapter,
    )
    from rl_core.types import WeightUpdate

    lora = LoRAConfig(rank=2, adapters=("solver", "critic"), name="critic")
    info = adapter_of(with_adapter(WeightUpdate(version=3, base_version=None, transport="t"), lora))
    assert info is not None and info.names == ("solver", "critic") and info.name == "critic"
    assert info.lora.rank == 2 and info.lora.adapters == ()
    a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    tensors = [(adapter_tensor_name(n, a), torch.zeros(2, 4)) for n in ("solver", "critic")]
    parts = split_adapters(tensors, info.names)
    assert set(parts) == {"solver", "critic"} and list(parts["critic"]) == [a]
    with pytest.raises(WeightSyncError, match="no tensors for adapter"):
        split_adapters(tensors[:1], info.names)
    with pytest.raises(WeightSyncError, match="<adapter>/<peft name>"):
        split_adapters([(a, torch.zeros(2, 4))], info.names)
