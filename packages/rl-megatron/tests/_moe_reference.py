"""The plain-transformers reference for rl-megatron's mixture-of-experts tests (not a test).

* :func:`build_qwen3_moe_model`: a tiny random ``Qwen3MoeForCausalLM`` saved with the local
  test tokenizer (8 experts, top-2, renormalised top-k probabilities, a router with spread-out
  logits so that routing is not a tie);
* :func:`forced_routing`: patches every MoE router of a transformers model so that it records
  its own top-k and, when given routing ``[T, L, K]``, uses exactly those experts instead (the
  probabilities are the router's softmax at those experts, renormalised when
  ``norm_topk_prob``), consuming rows in call order (per-sequence forwards, or HFPolicy's
  packed micro-batches);
* :func:`hf_logprobs`: per-sequence, unpacked fp32 log-probs of a packed batch (with
  :func:`forced_routing`), and the router's own top-k ``[T, L, K]``.

Tensor-name legend: ``T`` packed tokens, ``L`` MoE layers, ``K`` experts per token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rl_core.types import TrainBatch


def build_qwen3_moe_model(
    save_dir: Path, *, seed: int = 3, num_layers: int = 2, **overrides: Any
) -> Path:
    """A tiny random Qwen3-MoE (QK-norm, 8 experts, top-2) with the local test tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_hf.tokenizer import build_tokenizer

    tok = build_tokenizer()
    fields: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "router_aux_loss_coef": 0.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": False,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        **overrides,
    }
    config = AutoConfig.for_model("qwen3_moe", **fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
                if name.endswith("mlp.gate.weight"):  # routers with distinct choices
                    p.normal_(0.0, 0.5)
    save_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(save_dir))
    tok.save_pretrained(str(save_dir))
    return save_dir


def moe_routers(model: Any) -> list[Any]:
    """The router (``mlp.gate``) of every MoE layer of a transformers Qwen3-MoE, in order."""
    inner = model.model if hasattr(model, "model") else model
    return [layer.mlp.gate for layer in inner.layers if hasattr(layer.mlp, "gate")]


@contextlib.contextmanager
def forced_routing(model: Any, routing_TLK: torch.Tensor | None) -> Iterator[list[list[Any]]]:
    """Inside the block every MoE router records its own top-k (yielded: per layer, one
    ``[n, K]`` tensor per call) and, with ``routing_TLK``, routes the next ``n`` tokens of a
    call to rows ``cursor .. cursor + n`` of it (its layer's column)."""
    import torch.nn.functional as F

    routers = moe_routers(model)
    own: list[list[Any]] = [[] for _ in routers]
    cursors = [0] * len(routers)
    saved = [r.forward for r in routers]

    def make(i: int, router: Any) -> Any:
        def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
            h = hidden_states.reshape(-1, router.hidden_dim)
            logits = F.linear(h, router.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            _, own_idx = torch.topk(probs, router.top_k, dim=-1)
            own[i].append(own_idx.detach())
            idx = own_idx
            if routing_TLK is not None:
                n = h.shape[0]
                idx = routing_TLK[cursors[i] : cursors[i] + n, i, :].long().to(h.device)
                cursors[i] += n
            top = probs.gather(1, idx)
            if router.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return logits, top.to(logits.dtype), idx

        return forward

    try:
        for i, r in enumerate(routers):
            r.forward = make(i, r)
        yield own
    finally:
        for r, f in zip(routers, saved):
            r.forward = f


def hf_logprobs(
    model: Any, batch: TrainBatch, routing_TLK: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logp_T, own_TLK)``: fp32 log-probs of ``batch`` by one unpacked forward per sequence
    (0 at each sequence's first token) and the router's own top-k, optionally replaying
    ``routing_TLK``."""
    model.eval()
    logps = []
    with torch.no_grad(), forced_routing(model, routing_TLK) as own:
        for a, b in zip(batch.cu_seqlens[:-1].tolist(), batch.cu_seqlens[1:].tolist()):
            ids = batch.tokens[a:b][None]
            logits = model(ids).logits[0].float().log_softmax(-1)
            lp = torch.zeros(b - a)
            lp[1:] = logits[:-1].gather(1, ids[0, 1:, None])[:, 0]
            logps.append(lp)
    own_TLK = torch.stack([torch.cat(calls) for calls in own], dim=1)
    return torch.cat(logps), own_TLK


def distinct_routing(own_TLK: torch.Tensor, num_experts: int, *, seed: int = 7) -> torch.Tensor:
    """Random top-k routing ``[T, L, K]`` (distinct experts per row) whose expert *set*
    differs from ``own_TLK``'s in every row."""
    gen = torch.Generator().manual_seed(seed)
    t, layers, k = own_TLK.shape
    out = torch.empty(t, layers, k, dtype=torch.long)
    for i in range(t):
        for j in range(layers):
            while True:
                pick = torch.randperm(num_experts, generator=gen)[:k]
                if set(pick.tolist()) != set(own_TLK[i, j].tolist()):
                    break
            out[i, j] = pick
    return out
