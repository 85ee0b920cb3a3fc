"""Hugging Face mixture-of-experts weight names: transformers 5 holds a Qwen3-MoE layer's experts
as two fused tensors, while checkpoints on the hub (``save_pretrained`` files), SGLang's loaders
and Megatron's converter name every expert separately.

- fused (in memory): ``...mlp.experts.gate_up_proj [E, 2F, H]`` (gate rows first, then up) and
  ``...mlp.experts.down_proj [E, H, F]``;
- per expert (checkpoint): ``...mlp.experts.{e}.gate_proj.weight [F, H]``,
  ``...up_proj.weight [F, H]`` and ``...down_proj.weight [H, F]``.

:func:`unfuse_expert_tensors` turns the first into the second; the inverse, which needs the
served model's tensors to fill, is ``rl_hf._moe.fuse_expert_tensors``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["has_fused_experts", "is_fused_expert_name", "unfuse_expert_tensors"]

_FUSED_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")


def is_fused_expert_name(name: str) -> bool:
    """Whether ``name`` is one of transformers' fused expert tensors of a MoE layer."""
    return name.endswith(_FUSED_SUFFIXES)


def has_fused_experts(names: Iterable[str]) -> bool:
    """Whether any of ``names`` is a fused expert tensor (see the module docstring)."""
    return any(is_fused_expert_name(n) for n in names)


def unfuse_expert_tensors(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, torch.Tensor]]:
    """The fused expert tensors of ``named_tensors`` split into per-expert checkpoint names
    (views, no copy); other names pass through in order."""
    out: list[tuple[str, torch.Tensor]] = []
    for name, t_EXY in named_tensors:
        if name.endswith(".mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            for e in range(t_EXY.shape[0]):
                gate_FH, up_FH = t_EXY[e].chunk(2, dim=0)
                out.append((f"{base}{e}.gate_proj.weight", gate_FH))
                out.append((f"{base}{e}.up_proj.weight", up_FH))
        elif name.endswith(".mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            out.extend((f"{base}{e}.down_proj.weight", t_EXY[e]) for e in range(t_EXY.shape[0]))
        else:
            out.append((name, t_EXY))
    return out
