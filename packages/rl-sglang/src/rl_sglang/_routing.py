"""Mixture-of-experts routing returned by SGLang (``return_routed_experts`` on ``/generate``).

What SGLang 0.5.23 returns (read in ``sglang/srt/state_capturer/``, verified on CPU against
transformers' router on the same weights: every (token, layer) pair equal):

- the server records routing only when launched with ``--enable-return-routed-experts``;
- ``meta_info["routed_experts"]`` is base64 of a flat little-endian ``int32`` array, row-major
  ``[P + R - 1, num_hidden_layers, top_k]``: one row per token the model ran, prompt included
  (``routed_experts_start_len=0``), the last sampled token excluded (it never ran);
- rows are kept per KV-cache slot, so prompt tokens served from the prefix cache carry the routing
  recorded when they were computed (a weight update flushes the cache);
- every decoder layer has a row slot, dense ones too; :class:`RoutingLayout` keeps the MoE ones.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from rl_core.errors import ConfigError
from rl_core.routing import RoutingShape, pad_routing

__all__ = ["RoutingLayout", "check_servable", "decode_routing"]

# SGLang 0.5.23's model classes for these families build their own ``lm_head`` and never tie it
# to ``embed_tokens`` (sglang/srt/models/qwen3_moe.py, qwen2_moe.py): a checkpoint saved with
# ``tie_word_embeddings: true`` has no ``lm_head.weight``, so the served head stays at its
# random initialisation (found serving moe_demo: routing equal to the trainer's on every
# (token, layer), log-probs 4.6 nats apart). Real Qwen-MoE checkpoints are untied.
_UNTIED_ONLY = ("qwen3_moe", "qwen2_moe")


def check_servable(model_dir: Path) -> None:
    """Refuse a checkpoint SGLang 0.5.23 would serve wrongly: a Qwen-MoE family model with
    tied input and output embeddings (see ``_UNTIED_ONLY``). Unreadable configs pass (the
    server reports them)."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return
    cfg = cfg.get("text_config", cfg)
    kind = cfg.get("model_type")
    if kind in _UNTIED_ONLY and cfg.get("tie_word_embeddings"):
        raise ConfigError(
            f"SGLangGenerator.Config.model_path: {model_dir}/config.json is a {kind} model with "
            "tie_word_embeddings: true, which SGLang 0.5.23 serves with an untrained lm_head "
            "(its Qwen-MoE classes never tie it). Save the checkpoint untied (for rl-train's "
            "tiny models: model.init.tie_word_embeddings=false) or use the reference generator."
        )


@dataclass(frozen=True, slots=True)
class RoutingLayout:
    """Where a model's MoE layers sit among its decoder layers, and its routing shape."""

    shape: RoutingShape
    """``num_layers`` MoE layers, ``top_k`` of ``num_experts`` experts."""
    num_hidden_layers: int
    """Decoder layers (SGLang's row width)."""
    moe_layers: tuple[int, ...]
    """Indices of the MoE layers among the decoder layers, ascending."""

    @classmethod
    def from_model_dir(cls, model_dir: Path | None) -> RoutingLayout | None:
        """The layout from ``config.json`` of a Hugging Face MoE checkpoint; ``None`` for a dense
        model or an unreadable directory.

        MoE layers: Qwen-MoE rules (``mlp_only_layers``, ``decoder_sparse_step``) and
        DeepSeek/GLM rules (``first_k_dense_replace``, ``moe_layer_freq``); every layer
        otherwise.
        """
        if model_dir is None:
            return None
        try:
            cfg = json.loads((model_dir / "config.json").read_text())
        except (OSError, ValueError):
            return None
        cfg = cfg.get("text_config", cfg)
        experts = (
            cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
        )
        top_k = cfg.get("num_experts_per_tok")
        n_layers = cfg.get("num_hidden_layers")
        if not (experts and top_k and n_layers):
            return None
        dense_only = set(cfg.get("mlp_only_layers") or ())
        step = int(cfg.get("decoder_sparse_step") or 1)
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        moe = tuple(
            i
            for i in range(int(n_layers))
            if i not in dense_only
            and (i + 1) % step == 0
            and i >= first_dense
            and (i - first_dense) % freq == 0
        )
        if not moe:
            return None
        shape = RoutingShape(num_layers=len(moe), top_k=int(top_k), num_experts=int(experts))
        return cls(shape=shape, num_hidden_layers=int(n_layers), moe_layers=moe)


def decode_routing(payload: str, layout: RoutingLayout, num_tokens: int) -> torch.Tensor:
    """``meta_info["routed_experts"]`` as ``[num_tokens, L, K]`` in the compact dtype.

    The rows SGLang returns (``num_tokens - 1``: the last token never ran) are extended to
    ``num_tokens`` by repeating the last one (:func:`rl_core.routing.pad_routing`).

    Raises:
        ValueError: the payload is not base64 of ``int32`` rows of the layout's width, covers
            no token or more tokens than ``num_tokens``, or holds an expert id out of range.
    """
    raw = base64.b64decode(payload.encode("ascii"), validate=True)
    width = layout.num_hidden_layers * layout.shape.top_k
    flat = np.frombuffer(bytearray(raw), dtype="<i4")
    if flat.size == 0 or flat.size % width:
        raise ValueError(
            f"routed_experts holds {flat.size} ids, not a whole number of rows of "
            f"{layout.num_hidden_layers} layers x top_k {layout.shape.top_k}."
        )
    rows = flat.size // width
    if rows > num_tokens:
        raise ValueError(f"routed_experts covers {rows} tokens but the sequence has {num_tokens}.")
    all_SLK = torch.from_numpy(flat.reshape(rows, layout.num_hidden_layers, layout.shape.top_k))
    moe_SLK = all_SLK[:, list(layout.moe_layers)]
    lo, hi = int(moe_SLK.min()), int(moe_SLK.max())
    if lo < 0 or hi >= layout.shape.num_experts:
        raise ValueError(
            f"routed_experts holds expert ids in [{lo}, {hi}], outside "
            f"[0, {layout.shape.num_experts})."
        )
    return pad_routing(moe_SLK.to(layout.shape.dtype), num_tokens)
