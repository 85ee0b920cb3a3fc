"""A lean prefill and decode step for Llama-family models, used by :class:`~rl_hf.HFGenerator`.

One decode step through transformers costs far more than its FLOPs on a small model: every
module call, the mask and cache bookkeeping and the output records run Python per layer and per
token. :class:`LeanDecoder` runs the same math straight on the model's weight tensors (read
when a batch starts, so in-place weight updates between batches are seen) with a preallocated
KV cache::

    dec = LeanDecoder.build(model)                       # None: the model does not qualify
    cache = dec.cache(prompt_len=L, steps=T)             # None: not for this batch
    logits_UV = cache.prefill(ids_UL, mask_U1LL, pos_UL) # the distinct prompts
    cache.batch_select_indices(expand_A)                 # one row per sample, compaction
    logits_AV = cache.step(tok_A, mask_AS, pos_A)        # one token per row

Per layer: RMSNorm, q/k/v projections (with their biases, if any), Qwen3's per-head q/k norms,
RoPE from the model's own rotary embedding (a cos/sin table built once per batch), the keys and
values written into the static cache (a step's at column ``seen - 1``), SDPA under the rows'
boolean masks, o_proj and residual, RMSNorm, the gated MLP and residual; then the final norm and
the LM head on the last position. Grouped-query heads are laid out as transformers' SDPA path
lays them out (repeated for the prefill's many queries, packed as ``[A, Hkv, Hq/Hkv, D]`` for
a step's one query), so the results equal the transformers forward's within float rounding
(bitwise on CPU with ``sdpa``, in float32 and bfloat16, in the tests).

Qualifying models (:func:`unsupported_reason` says why not): ``model_type`` ``llama``,
``qwen2``, ``qwen3`` or ``mistral``; every layer full attention (no sliding window; a
Mistral ``sliding_window`` longer than the batch's sequences is full attention too); RoPE whose
frequencies do not depend on the sequence length (not ``dynamic`` / ``longrope``); plain
``torch.nn.Linear`` projections (a peft-adapted model does not qualify); and, batch by batch,
no forward hook on the model (:func:`hooked`: whoever hooks a module expects it to run). Names: ``A`` rows,
``H`` hidden size, ``Hq``/``Hkv`` query / key-value heads, ``R = Hq / Hkv``, ``D`` head dim,
``S`` attended cache columns, ``C`` cache columns, ``P`` positions, ``V`` vocab, ``I`` MLP width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rl_core.errors import GenerationError

__all__ = ["LeanCache", "LeanDecoder", "hooked", "unsupported_reason"]

FAMILIES = frozenset({"llama", "qwen2", "qwen3", "mistral"})
"""``model_type`` values whose decoder layer :class:`LeanDecoder` reimplements."""


def _projections(layer: Any) -> tuple[Any, ...]:
    """A decoder layer's q/k/v/o and gate/up/down projections, in that order (``None`` for a
    missing MLP projection)."""
    attn, mlp = layer.self_attn, layer.mlp
    return (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        *(getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")),
    )


def _plain(mods: tuple[Any, ...]) -> bool:
    """Whether every module is a plain ``torch.nn.Linear`` (not peft-wrapped, not missing)."""
    return all(type(m) is torch.nn.Linear for m in mods)


def unsupported_reason(model: Any) -> str | None:
    """Why ``model`` cannot run on :class:`LeanDecoder` (a sentence), or ``None`` if it can."""
    cfg = getattr(model, "config", None)
    kind = getattr(cfg, "model_type", None)
    if kind not in FAMILIES:
        return f"model_type {kind!r} is not one of {sorted(FAMILIES)}"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} is not 'sdpa' or 'eager'"
    layer_types = getattr(cfg, "layer_types", None) or ["full_attention"]
    if any(t != "full_attention" for t in layer_types):
        return "some layers use sliding-window attention"
    inner = getattr(model, "model", None)
    rope = getattr(inner, "rotary_emb", None)
    if rope is None or not hasattr(model, "lm_head"):
        return "no model.rotary_emb or lm_head (not a *ForCausalLM of the family)"
    rope_type = getattr(rope, "rope_type", "default")
    if not isinstance(rope_type, str) or "dynamic" in rope_type or rope_type == "longrope":
        return f"rope_type {rope_type!r} depends on the sequence length (or the layer)"
    if type(inner.embed_tokens) is not torch.nn.Embedding:
        return "the input embedding is not a plain torch.nn.Embedding"
    for i, layer in enumerate(inner.layers):
        if not _plain(_projections(layer)):
            return f"layer {i} has projections that are not plain torch.nn.Linear (adapters?)"
        if (getattr(layer.self_attn, "q_norm", None) is None) != (kind != "qwen3"):
            return f"layer {i}'s q_norm does not match model_type {kind!r}"
    if type(model.lm_head) is not torch.nn.Linear:
        return "lm_head is not a plain torch.nn.Linear"
    return None


def hooked(model: Any) -> bool:
    """Whether a forward hook (on any module of ``model``, or global) or an accelerate hook
    (``device_map`` dispatch) expects the model's modules to be called: then the lean step,
    which does not call them, must not run."""
    from torch.nn.modules import module as nn_module

    if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
        return True
    return any(
        m._forward_hooks or m._forward_pre_hooks or hasattr(m, "_hf_hook") for m in model.modules()
    )


@dataclass(frozen=True, slots=True)
class _Layer:
    """The tensors of one decoder layer, read when a batch starts: ``w*`` weights ``[out, in]``
    and ``b*`` biases ``[out]`` (``None``: none) of the q/k/v/o and gate/up/down projections, as
    ``torch.nn.Linear`` holds them; the norms' weights; the MLP activation; the softmax scale."""

    ln1_H: torch.Tensor
    wq: torch.Tensor
    bq: torch.Tensor | None
    wk: torch.Tensor
    bk: torch.Tensor | None
    wv: torch.Tensor
    bv: torch.Tensor | None
    wo: torch.Tensor
    bo: torch.Tensor | None
    qn_D: torch.Tensor | None
    kn_D: torch.Tensor | None
    ln2_H: torch.Tensor
    wg: torch.Tensor
    bg: torch.Tensor | None
    wu: torch.Tensor
    bu: torch.Tensor | None
    wd: torch.Tensor
    bd: torch.Tensor | None
    act: Any
    scale: float


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' Llama RMSNorm: in float32, cast back, then times the weight.

    ``F.rms_norm`` gives the same bits in float32 (checked in the tests) in one call; in lower
    precision it rounds differently, so there the composite runs."""
    if x.dtype == torch.float32 and w.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), w, eps)
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x_AHD: torch.Tensor, cos_A1D: torch.Tensor, sin_A1D: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin``, in transformers' order of operations."""
    half = x_AHD.shape[-1] // 2
    rot_AHD = torch.cat((-x_AHD[..., half:], x_AHD[..., :half]), dim=-1)
    return (x_AHD * cos_A1D) + (rot_AHD * sin_A1D)


def _mlp(lay: _Layer, h_NH: torch.Tensor) -> torch.Tensor:
    """``down(act(gate(h)) * up(h))``."""
    g_NI = lay.act(F.linear(h_NH, lay.wg, lay.bg))
    return F.linear(g_NI * F.linear(h_NH, lay.wu, lay.bu), lay.wd, lay.bd)


class LeanDecoder:
    """Decode steps of a qualifying Hugging Face causal LM without going through its modules.

    Build it with :meth:`build` (``None`` when :func:`unsupported_reason` finds a reason); each
    batch then gets a :class:`LeanCache` from :meth:`cache`.
    """

    def __init__(self, model: Any) -> None:
        """Wrap ``model`` (a qualifying ``*ForCausalLM``; see :func:`unsupported_reason`)."""
        self.model = model
        """The served model; its weights are read at every :meth:`cache`."""
        cfg = model.config
        self.num_heads: int = int(cfg.num_attention_heads)
        """Query heads ``Hq``."""
        self.num_kv_heads: int = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        """Key/value heads ``Hkv``."""
        self.head_dim: int = int(
            getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        )
        """Per-head width ``D``."""
        self.sliding_window: int | None = (
            getattr(cfg, "sliding_window", None) if cfg.model_type == "mistral" else None
        )
        """Mistral's attention window: batches longer than it take the transformers path."""

    @classmethod
    def build(cls, model: Any) -> LeanDecoder | None:
        """A decoder for ``model``, or ``None`` if it does not qualify."""
        return None if unsupported_reason(model) is not None else cls(model)

    def fits(self, length: int) -> bool:
        """Whether sequences of ``length`` tokens (prompt + new) see full causal attention."""
        return self.sliding_window is None or length <= self.sliding_window

    def _layers(self) -> list[_Layer] | None:
        inner = self.model.model
        act_name = getattr(self.model.config, "hidden_act", None)
        out = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            mods = _projections(layer)
            if not _plain(mods):
                return None  # adapted since build (peft wraps the projections in place)
            q, k, v, o, g, u, d = mods
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            out.append(
                _Layer(
                    ln1_H=layer.input_layernorm.weight,
                    wq=q.weight,
                    bq=q.bias,
                    wk=k.weight,
                    bk=k.bias,
                    wv=v.weight,
                    bv=v.bias,
                    wo=o.weight,
                    bo=o.bias,
                    qn_D=None if qn is None else qn.weight,
                    kn_D=None if kn is None else kn.weight,
                    ln2_H=layer.post_attention_layernorm.weight,
                    wg=g.weight,
                    bg=g.bias,
                    wu=u.weight,
                    bu=u.bias,
                    wd=d.weight,
                    bd=d.bias,
                    act=F.silu if act_name == "silu" else mlp.act_fn,
                    scale=float(getattr(attn, "scaling", self.head_dim**-0.5)),
                )
            )
        return out

    def cache(self, *, prompt_len: int, steps: int) -> LeanCache | None:
        """An empty static KV cache for prompts of ``prompt_len`` (padded) tokens and ``steps``
        new ones (fill it with :meth:`LeanCache.prefill`), or ``None`` when the model no longer
        qualifies (adapted since :meth:`build`, or :func:`hooked`) or the sequences outgrow a
        sliding window."""
        if hooked(self.model) or not self.fits(prompt_len + steps):
            return None
        layers = self._layers()
        if layers is None:
            return None
        inner = self.model.model
        C = prompt_len + steps
        # Positions stay below C (a row's position counts its real tokens); the rotary module
        # computes each position's cos/sin elementwise, so one table equals per-call ones.
        emb = inner.embed_tokens.weight
        pos_1P = torch.arange(C, device=emb.device)[None]
        cos_1PD, sin_1PD = inner.rotary_emb(emb[:1][None], pos_1P)
        return LeanCache(self, layers, cos_PD=cos_1PD[0], sin_PD=sin_1PD[0], columns=C)


class LeanCache:
    """Static per-layer KV cache ``[A, Hkv, C, D]`` of one batch, with its prefill and decode
    step.

    Duck-types the one ``DynamicCache`` method the generator calls on a cache
    (:meth:`batch_select_indices`).
    """

    def __init__(
        self,
        decoder: LeanDecoder,
        layers: list[_Layer],
        *,
        cos_PD: torch.Tensor,
        sin_PD: torch.Tensor,
        columns: int,
    ) -> None:
        """Built by :meth:`LeanDecoder.cache`."""
        self.decoder, self.layers = decoder, layers
        self.keys: list[torch.Tensor] = []
        """Per layer ``[A, Hkv, C, D]``; columns at and after :attr:`used` are unwritten."""
        self.values: list[torch.Tensor] = []
        """Per layer ``[A, Hkv, C, D]``, like :attr:`keys`."""
        self.cos_PD, self.sin_PD = cos_PD, sin_PD
        self.columns = columns
        """``C``: the prompt length plus the new tokens."""
        self.used = 0
        """Columns filled so far (the prompt length, plus one per step)."""
        m = decoder.model
        self.eps = float(getattr(m.config, "rms_norm_eps", 1e-6))
        self.embed_VH: torch.Tensor = m.model.embed_tokens.weight
        self.norm_H: torch.Tensor = m.model.norm.weight
        self.head_VH: torch.Tensor = m.lm_head.weight
        self.head_bias_V: torch.Tensor | None = m.lm_head.bias

    def batch_select_indices(self, idx_A: torch.Tensor) -> None:
        """Keep (or repeat) the rows ``idx_A``, in that order, of every layer's cache."""
        self.keys = [k.index_select(0, idx_A) for k in self.keys]
        self.values = [v.index_select(0, idx_A) for v in self.values]

    def prefill(
        self, ids_UL: torch.Tensor, mask_U1LL: torch.Tensor, pos_UL: torch.Tensor
    ) -> torch.Tensor:
        """Run the ``U`` left-padded prompts ``ids_UL`` at positions ``pos_UL`` under the
        boolean attention mask ``mask_U1LL`` (causal and padding, every query sees itself),
        filling the cache's first ``L`` columns; returns the last position's logits ``[U, V]``.

        As transformers' SDPA path does for several queries under a mask, the key/value heads
        are repeated for their query heads."""
        dec, eps = self.decoder, self.eps
        U, L = ids_UL.shape
        Hq, Hkv, D = dec.num_heads, dec.num_kv_heads, dec.head_dim
        R = Hq // Hkv
        cos_U1LD = self.cos_PD[pos_UL][:, None]
        sin_U1LD = self.sin_PD[pos_UL][:, None]
        x_ULH = F.embedding(ids_UL, self.embed_VH)
        for lay in self.layers:
            h_ULH = _norm(x_ULH, lay.ln1_H, eps)
            q_ULQD = F.linear(h_ULH, lay.wq, lay.bq).view(U, L, Hq, D)
            k_ULKD = F.linear(h_ULH, lay.wk, lay.bk).view(U, L, Hkv, D)
            v_UKLD = F.linear(h_ULH, lay.wv, lay.bv).view(U, L, Hkv, D).transpose(1, 2)
            if lay.qn_D is not None and lay.kn_D is not None:
                q_ULQD = _norm(q_ULQD, lay.qn_D, eps)
                k_ULKD = _norm(k_ULKD, lay.kn_D, eps)
            q_UQLD = _rope(q_ULQD.transpose(1, 2), cos_U1LD, sin_U1LD)
            k_UKLD = _rope(k_ULKD.transpose(1, 2), cos_U1LD, sin_U1LD)
            kc_UKCD = k_UKLD.new_empty((U, Hkv, self.columns, D))
            vc_UKCD = v_UKLD.new_empty((U, Hkv, self.columns, D))
            kc_UKCD[:, :, :L] = k_UKLD
            vc_UKCD[:, :, :L] = v_UKLD
            self.keys.append(kc_UKCD)
            self.values.append(vc_UKCD)
            o_UQLD = F.scaled_dot_product_attention(
                q_UQLD,
                k_UKLD[:, :, None].expand(U, Hkv, R, L, D).reshape(U, Hq, L, D),
                v_UKLD[:, :, None].expand(U, Hkv, R, L, D).reshape(U, Hq, L, D),
                attn_mask=mask_U1LL,
                scale=lay.scale,
            )
            x_ULH = x_ULH + F.linear(o_UQLD.transpose(1, 2).reshape(U, L, Hq * D), lay.wo, lay.bo)
            x_ULH = x_ULH + _mlp(lay, _norm(x_ULH, lay.ln2_H, eps))
        self.used = L
        # Norm every position, then the LM head on the [U, 1, H] view of the last, as
        # transformers does with logits_to_keep=1 (another input layout rounds differently).
        h_U1H = _norm(x_ULH, self.norm_H, eps)[:, -1:]
        return F.linear(h_U1H, self.head_VH, self.head_bias_V)[:, -1]

    def step(self, tok_A: torch.Tensor, mask_AS: torch.Tensor, pos_A: torch.Tensor) -> torch.Tensor:
        """Feed token ``tok_A`` of each row at position ``pos_A``, attending to the cache
        columns ``mask_AS`` marks (``S = used + 1``: the prompt, the past steps and this one);
        returns the next-token logits ``[A, V]``."""
        dec, eps = self.decoder, self.eps
        A = tok_A.shape[0]
        Hq, Hkv, D = dec.num_heads, dec.num_kv_heads, dec.head_dim
        c = self.used
        S = c + 1
        if mask_AS.shape[1] != S or self.columns < S:
            raise GenerationError(
                f"LeanCache.step: the mask covers {mask_AS.shape[1]} columns, expected {S} "
                f"(at most {self.columns}); call step once per token after prefill."
            )
        cos_A1D = self.cos_PD[pos_A][:, None]
        sin_A1D = self.sin_PD[pos_A][:, None]
        mask_A11S = mask_AS[:, None, None, :]
        x_AH = F.embedding(tok_A, self.embed_VH)
        for lay, kc_AKCD, vc_AKCD in zip(self.layers, self.keys, self.values, strict=True):
            h_AH = _norm(x_AH, lay.ln1_H, eps)
            q_AQD = F.linear(h_AH, lay.wq, lay.bq).view(A, Hq, D)
            k_AKD = F.linear(h_AH, lay.wk, lay.bk).view(A, Hkv, D)
            v_AKD = F.linear(h_AH, lay.wv, lay.bv).view(A, Hkv, D)
            if lay.qn_D is not None and lay.kn_D is not None:
                q_AQD = _norm(q_AQD, lay.qn_D, eps)
                k_AKD = _norm(k_AKD, lay.kn_D, eps)
            q_AQD = _rope(q_AQD, cos_A1D, sin_A1D)
            kc_AKCD[:, :, c] = _rope(k_AKD, cos_A1D, sin_A1D)
            vc_AKCD[:, :, c] = v_AKD
            # One query per row: group the query heads by their key/value head (no repeat),
            # the layout transformers' SDPA path uses for one query.
            o_AKRD = F.scaled_dot_product_attention(
                q_AQD.view(A, Hkv, Hq // Hkv, D),
                kc_AKCD[:, :, :S],
                vc_AKCD[:, :, :S],
                attn_mask=mask_A11S,
                scale=lay.scale,
            )
            x_AH = x_AH + F.linear(o_AKRD.reshape(A, Hq * D), lay.wo, lay.bo)
            x_AH = x_AH + _mlp(lay, _norm(x_AH, lay.ln2_H, eps))
        self.used = S
        return F.linear(_norm(x_AH, self.norm_H, eps), self.head_VH, self.head_bias_V)
