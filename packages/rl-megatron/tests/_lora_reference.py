"""The LoRA reference of rl-megatron's tests: a transformers model + ``peft`` adapter (not a test
file). Used in-process by ``test_lora.py`` and by the multi-rank worker ``_lora_worker.py``."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch

from rl_core.testing.policy import sft_loss
from rl_core.types import TrainBatch
from rl_hf.policy import token_logprobs

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA = 4, 8.0


def make_peft_adapter(
    model_path: Path, out: Path, *, targets: list[str] = TARGETS, seed: int = 0
) -> Path:
    """A peft adapter with random non-zero ``A`` and ``B`` on ``model_path``, saved with
    ``save_pretrained`` into ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model = get_peft_model(
        base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out))
    return out


def peft_model(model_path: Path, adapter: Path | None) -> Any:
    """The transformers model at ``model_path`` with the peft adapter (trainable) or none."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    if adapter is None:
        return base
    return PeftModel.from_pretrained(base, str(adapter), is_trainable=True)


def logprobs(model: Any, batch: TrainBatch) -> torch.Tensor:
    """``logp_T`` of ``batch`` under ``model`` (one forward per sequence)."""
    cu = batch.cu_seqlens.tolist()
    out = []
    for s, e in itertools.pairwise(cu):
        tokens_T = batch.tokens[s:e]
        logits_TV = model(input_ids=tokens_T[None]).logits[0]
        starts_T = torch.zeros_like(tokens_T, dtype=torch.bool)
        starts_T[0] = True
        out.append(token_logprobs(logits_TV, tokens_T, starts_T)[0])
    return torch.cat(out)


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """peft's saved state dict (``base_model.model....lora_A.weight`` names)."""
    from peft import get_peft_model_state_dict

    return {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}


def reference_step(
    model_path: Path, adapter: Path, batch: TrainBatch, *, lr: float, grad_clip: float = 1.0
) -> dict[str, Any]:
    """One AdamW step of the adapter on ``sft_loss`` over ``batch`` (as ``HFPolicy.train_step``:
    gradients summed over micro-batches, norm clipped): loss, grad norm, adapter before/after."""
    model = peft_model(model_path, adapter)
    before = adapter_state(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loss_sum = 0.0
    for mb in batch.micro_batches():
        out = sft_loss(logprobs(model, mb), mb, None)
        out.loss.backward()
        loss_sum += float(out.loss.detach())
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    opt.step()
    return {
        "loss": loss_sum,
        "grad_norm": grad_norm,
        "before": before,
        "after": adapter_state(model),
    }
