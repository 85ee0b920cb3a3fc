"""The peft file format of rl_core.lora against the real peft library on a tiny model."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_core.lora import LoRAConfig, load_adapter, merge_adapter, save_adapter
from rl_hf import build_tiny_model


def test_peft_reads_what_we_write_and_we_read_peft(tmp_path):
    peft = pytest.importorskip("peft")
    build_tiny_model(tmp_path / "base")
    lora = LoRAConfig(rank=4, alpha=8, target_modules=("q_proj", "down_proj"))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    pm = peft.get_peft_model(
        model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    for p in pm.parameters():
        if p.requires_grad:
            torch.nn.init.normal_(p)
    pm.save_pretrained(tmp_path / "peft")
    tensors, back = load_adapter(tmp_path / "peft")
    assert back.scaling == lora.scaling and set(back.target_modules) == set(lora.target_modules)
    ours = tmp_path / "ours"
    save_adapter(ours, tensors.items(), back, base_model=str(tmp_path / "base"))
    again = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ours
    )
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(again(x).logits, pm(x).logits)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
        merged = merge_adapter(base, tensors, back)
        assert len(merged) == 2 * 2  # two layers x two targets in the tiny model
