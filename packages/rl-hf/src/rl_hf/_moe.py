"""Mixture-of-experts routing in Hugging Face models: record it, replay it, perturb it.

Used by ``HFGenerator`` (record the engine's routing, optionally with noise on the router logits)
and ``HFPolicy`` (replay a recorded routing, report its own). Tensor-name legend: ``N`` tokens of
one forward (flattened batch), ``E`` experts, ``K`` experts per token, ``L`` MoE layers.

The routers are found through the model's own output recorder for ``router_logits``
(``PreTrainedModel._can_record_outputs``): transformers MoE families with the top-k router module
of transformers 5 (Qwen3-MoE, ...) name it there. A router's forward returns
``(router_logits [N, E], top_k_weights [N, K], top_k_index [N, K])``; a forward hook on it reads
the chosen experts from that output (the model's own choice, never recomputed) and, to replay,
replaces the weights and indices::

    tap = RouterTap.attach(model)           # None for a dense model
    with tap.recording() as rec:            # rec.routing() -> [N, L, K] after the forward
        model(...)
    with tap.replaying(routing_NLK):        # every MoE layer uses exactly these experts
        model(...)

Replay keeps the router's gradient: the top-k weights are the router's softmax probabilities
gathered at the forced indices, renormalised when the model renormalises
(``norm_topk_prob``), i.e. the weights the model would give those experts had it chosen them.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch

from rl_core.errors import DataError
from rl_core.routing import RoutingShape

__all__ = ["RouterTap", "find_routers"]


def find_routers(model: Any) -> list[torch.nn.Module]:
    """The MoE router modules of ``model`` in layer order (empty for a dense model)."""
    recorders = getattr(model, "_can_record_outputs", None) or {}
    rec = recorders.get("router_logits")
    cls = getattr(rec, "target_class", None)
    if cls is None:
        return []
    return [m for m in model.modules() if isinstance(m, cls)]


class _Recording:
    """The routing collected by one :meth:`RouterTap.recording` block."""

    def __init__(self, num_layers: int) -> None:
        self.per_layer: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def calls(self) -> int:
        """Forwards recorded so far (each router ran once per forward)."""
        return len(self.per_layer[0])

    def routing(self, call: int = -1) -> torch.Tensor:
        """``[N, L, K]`` int64 expert indices chosen in forward number ``call``."""
        return torch.stack([layer[call] for layer in self.per_layer], dim=1)

    def take(self) -> torch.Tensor:
        """``[N, L, K]`` of the last forward, forgetting every forward recorded so far."""
        out_NLK = self.routing()
        for layer in self.per_layer:
            layer.clear()
        return out_NLK


class RouterTap:
    """Forward hooks on every router of one model (see the module docstring)."""

    def __init__(self, routers: list[torch.nn.Module]) -> None:
        self.routers = routers
        """The router modules, one per MoE layer, in layer order."""
        first = routers[0]
        self.shape = RoutingShape(
            num_layers=len(routers), top_k=int(first.top_k), num_experts=int(first.num_experts)
        )
        """Layers, top-k and expert count of the routing."""
        self.noise_std = 0.0
        """Standard deviation of Gaussian noise added to the router logits (0 = none)."""
        self.noise_generator: torch.Generator | None = None
        """Generator the noise is drawn from (its device must be the model's)."""
        self._recording: _Recording | None = None
        self._forced_NLK: torch.Tensor | None = None
        self._handles = [
            r.register_forward_hook(self._hook_for(layer)) for layer, r in enumerate(routers)
        ]

    @classmethod
    def attach(cls, model: Any) -> RouterTap | None:
        """Hook the routers of ``model``; ``None`` when it has none (a dense model)."""
        routers = find_routers(model)
        return cls(routers) if routers else None

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[_Recording]:
        """Collect every router's chosen experts in the forwards run inside the block."""
        rec = _Recording(self.shape.num_layers)
        self._recording = rec
        try:
            yield rec
        finally:
            self._recording = None

    @contextlib.contextmanager
    def replaying(self, routing_NLK: torch.Tensor | None) -> Iterator[None]:
        """Make every MoE layer use the experts of ``routing_NLK`` (``[N, L, K]``, one row per
        token of the forward; ``None`` = no replay) in the forwards run inside the block."""
        if routing_NLK is not None:
            layers, k = routing_NLK.shape[1], routing_NLK.shape[2]
            if (layers, k) != (self.shape.num_layers, self.shape.top_k):
                raise DataError(
                    f"routed_experts has {layers} layers x top-{k}, the model routes "
                    f"{self.shape.num_layers} MoE layers x top-{self.shape.top_k}; the routing "
                    "was recorded on a different model."
                )
            if int(routing_NLK.max()) >= self.shape.num_experts:
                raise DataError(
                    f"routed_experts names expert {int(routing_NLK.max())} but the model has "
                    f"{self.shape.num_experts}; the routing was recorded on a different model."
                )
            routing_NLK = routing_NLK.to(torch.int64)
        self._forced_NLK = routing_NLK
        try:
            yield
        finally:
            self._forced_NLK = None

    def _hook_for(self, layer: int) -> Any:
        def hook(module: torch.nn.Module, inputs: Any, output: Any) -> Any:
            logits_NE, weights_NK, index_NK = output[0], output[1], output[2]
            changed = False
            if self.noise_std > 0:
                noise_NE = torch.randn(
                    logits_NE.shape,
                    generator=self.noise_generator,
                    device=logits_NE.device,
                    dtype=torch.float32,
                )
                logits_NE = (logits_NE.float() + self.noise_std * noise_NE).to(logits_NE.dtype)
                probs_NE = torch.softmax(logits_NE, dtype=torch.float, dim=-1)
                index_NK = torch.topk(probs_NE, index_NK.shape[-1], dim=-1).indices
                weights_NK = _topk_weights(module, logits_NE, index_NK)
                changed = True
            if self._recording is not None:
                self._recording.per_layer[layer].append(index_NK.detach())
            forced = self._forced_NLK
            if forced is not None:
                if forced.shape[0] != index_NK.shape[0]:
                    raise DataError(
                        f"routed_experts has {forced.shape[0]} rows but the forward routes "
                        f"{index_NK.shape[0]} tokens; give one row per token."
                    )
                index_NK = forced[:, layer].to(index_NK.device)
                weights_NK = _topk_weights(module, logits_NE, index_NK)
                changed = True
            if not changed:
                return None
            return (logits_NE, weights_NK, index_NK, *tuple(output[3:]))

        return hook


def _topk_weights(router: torch.nn.Module, logits_NE: torch.Tensor, index_NK: torch.Tensor):
    """The weights the router gives experts ``index_NK``: its softmax probabilities there,
    renormalised over the top-k when the model does (``norm_topk_prob``), in the logits' dtype
    (as transformers' top-k routers compute them)."""
    probs_NE = torch.softmax(logits_NE, dtype=torch.float, dim=-1)
    w_NK = probs_NE.gather(-1, index_NK)
    if getattr(router, "norm_topk_prob", False):
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
    return w_NK.to(logits_NE.dtype)


_PER_EXPERT = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)


def fuse_expert_tensors(
    named_tensors: list[tuple[str, torch.Tensor]], state: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]]:
    """Per-expert checkpoint names (``...experts.{e}.{gate,up,down}_proj.weight``, as
    ``save_pretrained`` and MegatronPolicy write them) turned into transformers 5's fused
    in-memory tensors (``...experts.gate_up_proj [E, 2I, H]``, ``...experts.down_proj [E, H, I]``)
    of the served model ``state``; other names pass through. Experts a partial update leaves out
    keep their current weights."""
    out: list[tuple[str, torch.Tensor]] = []
    fused: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        m = _PER_EXPERT.match(name)
        if m is None or f"{m['prefix']}.down_proj" not in state:
            out.append((name, t))
            continue
        e, proj = int(m["e"]), m["proj"]
        key = f"{m['prefix']}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        dst = state.get(key)
        if dst is None or e >= dst.shape[0]:
            out.append((name, t))  # left for the caller's name check to report
            continue
        buf = fused.get(key)
        if buf is None:
            buf = fused[key] = dst.detach().clone()
        if proj == "down_proj":
            rows = slice(None)
        else:
            half = buf.shape[1] // 2
            rows = slice(0, half) if proj == "gate_proj" else slice(half, None)
        if tuple(buf[e, rows].shape) != tuple(t.shape):
            raise ValueError(
                f"{name}: shape {tuple(t.shape)}, the served expert has {tuple(buf[e, rows].shape)}."
            )
        buf[e, rows] = t.to(buf.dtype)
    return out + list(fused.items())
