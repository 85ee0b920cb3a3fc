"""Padding-free packed attention for Hugging Face causal LMs (used by ``HFPolicy``).

Tensor-name legend: ``T`` packed tokens, ``N`` sequences, ``L`` longest sequence, ``H`` query
heads, ``K`` key/value heads, ``D`` head width.

The model runs on ``input_ids [1, T]`` (sequences concatenated) with ``position_ids [1, T]`` reset
to 0 at every sequence start. Attention must not cross sequences. Two exact ways:

- ``"pad"``: scatter q/k/v into a padded ``[N, L]`` layout, run causal SDPA (``is_causal=True``,
  no mask tensor, so the fast kernel is used), gather the outputs back. Padding sits after the
  valid tokens of every row, so causal attention of a valid query never reaches it. Cost
  ``N * L^2`` per head.
- ``"mask"``: SDPA on ``[1, T]`` with a block-diagonal causal boolean mask ``[T, T]``. Cost
  ``T^2`` per head; wins when one long sequence is packed with many short ones.

:class:`PackingInfo` picks the cheaper one per micro-batch. The attention function is registered
in transformers' ``AttentionInterface`` as :data:`ATTN_NAME`; because that name has no mask
function, transformers builds no mask of its own (no ``[T, T]`` work outside attention).

Shared prefixes (:class:`SharedPrefix`, ``HFPolicy.Config.share_prefix``): the samples of a GRPO
group repeat their prompt. The model then runs on a compact row of ``C`` tokens holding each
group's prompt once, followed by every sample's own tokens (positions as in the sample); in the
padded layout every sample's row reads the prompt's q/k/v from the one copy, so each sample's
attention is exactly its own, and the gradients of the shared tokens sum over the group. Every
op outside attention (projections, MLP, norms, LM head) runs on ``C`` instead of ``T`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rl_core.errors import ConfigError, RLError
from rl_core.types import TrainBatch

__all__ = [
    "ATTN_NAME",
    "PackingInfo",
    "SharedPrefix",
    "packed_inputs",
    "register_packed_attention",
]

ATTN_NAME = "rl_packed_sdpa"
"""Name under which the packed attention is registered in transformers."""


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Which tokens of a packed micro-batch repeat another sequence's prefix (the prompt of a
    GRPO group), and the compact row of ``C`` tokens that holds each prefix once.

    A sequence's prefix is its tokens before its first ``loss_mask > 0`` token (the prompt);
    sequences with byte-equal prefixes form a group whose first sequence (the *leader*) keeps
    its prefix tokens and the others drop theirs. Exact for any causal model: a token's hidden
    states depend only on the tokens before it and its position.
    """

    keep_T: torch.Tensor
    """``[T]`` bool: the token is in the compact row (all but the followers' prefix tokens)."""
    expand_T: torch.Tensor
    """``[T]`` int64 index in the compact row of each token (a follower's prefix token maps to
    its leader's)."""
    group_T: torch.Tensor
    """``[T]`` int64 leader sequence of each token's sequence (its own index when alone)."""
    prefix_T: torch.Tensor
    """``[T]`` bool: the token is part of a shareable prefix."""
    num_compact: int
    """``C``."""

    @staticmethod
    def find(
        tokens_T: torch.Tensor,
        cu_seqlens_N1: torch.Tensor,
        loss_mask_T: torch.Tensor,
        seq_T: torch.Tensor,
        pos_T: torch.Tensor,
    ) -> SharedPrefix | None:
        """The shared prefixes of a packed micro-batch (``seq_T`` / ``pos_T``: each token's
        sequence index and position, ``TrainBatch.seq_index()`` / ``position_ids()``), or
        ``None`` when no two sequences share one (nothing to save)."""
        n = int(cu_seqlens_N1.shape[0]) - 1
        t = int(tokens_T.shape[0])
        if n < 2 or t == 0:
            return None
        device = tokens_T.device
        lengths_N = cu_seqlens_N1[1:] - cu_seqlens_N1[:-1]
        trained_T = loss_mask_T > 0
        first_N = lengths_N.clone()  # position of each sequence's first trained token
        first_N.scatter_reduce_(0, seq_T[trained_T], pos_T[trained_T], reduce="amin")
        prefix_N = torch.where((first_N >= 1) & (first_N < lengths_N), first_N, 0)
        tokens = tokens_T.cpu().numpy()
        starts, prefixes = cu_seqlens_N1[:-1].tolist(), prefix_N.tolist()
        leaders: dict[bytes, int] = {}
        leader = list(range(n))
        for i, (a, p) in enumerate(zip(starts, prefixes, strict=True)):
            if p:
                leader[i] = leaders.setdefault(tokens[a : a + p].tobytes(), i)
        if leader == list(range(n)):
            return None
        leader_N = torch.tensor(leader, dtype=torch.int64, device=device)
        group_T = leader_N[seq_T]
        prefix_T = pos_T < prefix_N[seq_T]
        keep_T = ~(prefix_T & (group_T != seq_T))
        compact_T = torch.cumsum(keep_T, 0) - 1  # compact index of each kept token
        source_T = torch.where(
            keep_T, torch.arange(t, device=device), cu_seqlens_N1[group_T] + pos_T
        )
        return SharedPrefix(
            keep_T=keep_T,
            expand_T=compact_T[source_T],
            group_T=group_T,
            prefix_T=prefix_T,
            num_compact=int(keep_T.sum()),
        )


@dataclass(frozen=True, slots=True)
class PackingInfo:
    """Index tensors describing one packed micro-batch, built once per forward.

    The model's row holds ``T'`` tokens: ``T`` (one per packed token) or, with a
    :class:`SharedPrefix`, its ``C`` compact tokens.
    """

    gather_index_S: torch.Tensor
    """``[N * L]`` int64: the row token each slot of the padded ``[N, L]`` layout reads (padding
    reads token 0: causal attention of a valid query never reaches it, so its values and
    gradients do not matter); empty in ``"mask"`` mode."""
    out_index_T: torch.Tensor
    """``[T']`` int64: the padded slot whose attention output each row token takes; empty in
    ``"mask"`` mode."""
    num_seqs: int
    """``N``."""
    max_len: int
    """``L``."""
    mode: str
    """``"pad"`` or ``"mask"``."""
    mask_TT: torch.Tensor | None
    """``[T', T']`` bool attention mask of the row (``"mask"`` mode only; True = attend)."""
    pos_T: torch.Tensor | None = None
    """``[T']`` position of each row token (``"mask"`` mode only: a sliding window is
    ``pos_q - pos_k < window``)."""

    @staticmethod
    def build(
        seq_index_T: torch.Tensor,
        position_ids_T: torch.Tensor,
        lengths_N: torch.Tensor,
        *,
        mode: str = "auto",
        shared: SharedPrefix | None = None,
    ) -> PackingInfo:
        """Index tensors for sequences of ``lengths_N`` packed as ``seq_index_T`` /
        ``position_ids_T``, the model running on the compact row of ``shared`` when given.

        ``mode="auto"`` picks the layout with fewer attention scores (``N*L^2`` vs ``T'^2``).
        """
        n = int(lengths_N.shape[0])
        max_len = int(lengths_N.max()) if n else 0
        t = int(seq_index_T.shape[0])
        rows = t if shared is None else shared.num_compact
        if mode == "auto":
            mode = "pad" if n * max_len * max_len <= rows * rows else "mask"
        device = seq_index_T.device
        # The padded layout's indices, in "pad" mode only ([N * L] can be large when "mask" wins).
        gather_S = out_index = torch.zeros(0, dtype=torch.int64, device=device)
        if mode == "pad":
            flat_index_T = seq_index_T * max_len + position_ids_T  # padded slot of each token
            gather_S = torch.zeros(n * max_len, dtype=torch.int64, device=device)
            if shared is None:
                gather_S[flat_index_T] = torch.arange(t, device=device)
                out_index = flat_index_T
            else:
                gather_S[flat_index_T] = shared.expand_T
                out_index = flat_index_T[shared.keep_T]
        mask = None
        if mode == "mask":
            seq, pos = seq_index_T, position_ids_T
            if shared is not None:
                keep = shared.keep_T
                seq, pos = seq[keep], pos[keep]
                group, prefix = shared.group_T[keep], shared.prefix_T[keep]
            causal = pos[:, None] >= pos[None, :]
            if shared is None:
                mask = (seq[:, None] == seq[None, :]) & causal
            else:  # the own sequence, or a shared prefix token of the same group
                own = (seq[:, None] == seq[None, :]) | prefix[None, :]
                mask = (group[:, None] == group[None, :]) & causal & own
        return PackingInfo(
            gather_index_S=gather_S,
            out_index_T=out_index,
            num_seqs=n,
            max_len=max_len,
            mode=mode,
            mask_TT=mask,
            pos_T=pos if mode == "mask" else None,
        )


def packed_inputs(
    batch: TrainBatch, device: torch.device, *, sdpa: bool, share_prefix: bool
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
    """``position_ids_T``, the keyword arguments of one packed forward of ``batch`` on
    ``device`` (one row of tokens, positions reset per sequence, attention confined to each
    sequence: ``rl_packing`` for :func:`packed_sdpa_forward` when ``sdpa``) and ``expand_T``:
    ``None``, or with ``share_prefix`` (and ``sdpa``) and a prompt two sequences share, the
    index ``[T]`` of each token in the compact row the model runs on (gather the model's
    per-token outputs with it)."""
    tokens_T = batch.tokens.to(device)
    position_ids_T = batch.position_ids().to(device)
    seq_T = batch.seq_index().to(device)
    cu_N1 = batch.cu_seqlens.to(device)
    shared = None
    if share_prefix and sdpa:
        shared = SharedPrefix.find(
            tokens_T, cu_N1, batch.loss_mask.to(device), seq_T, position_ids_T
        )
    row_tokens, row_positions = tokens_T, position_ids_T
    if shared is not None:
        row_tokens, row_positions = tokens_T[shared.keep_T], position_ids_T[shared.keep_T]
    kwargs: dict[str, Any] = {
        "input_ids": row_tokens[None],
        "position_ids": row_positions[None],
        "attention_mask": None,
        "use_cache": False,
    }
    if sdpa:
        kwargs["rl_packing"] = PackingInfo.build(
            seq_T, position_ids_T, cu_N1[1:] - cu_N1[:-1], shared=shared
        )
    return position_ids_T, kwargs, (None if shared is None else shared.expand_T)


def _repeat_kv(x_BKLD: torch.Tensor, n_rep: int) -> torch.Tensor:
    if n_rep == 1:
        return x_BKLD
    b, k, length, d = x_BKLD.shape
    return x_BKLD[:, :, None].expand(b, k, n_rep, length, d).reshape(b, k * n_rep, length, d)


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query [1, H, T', D]``, ``key/value [1, K, T', D]`` ->
    ``[1, T', H, D]``, attending only within each packed sequence (and its shared prefix), and
    to the last ``sliding_window`` positions when the layer passes one (Mistral, Qwen2's and
    Gemma's sliding layers; as transformers' masks: ``q - k < window``).

    Needs ``rl_packing=PackingInfo`` among the model's forward kwargs. Attention logit
    soft-capping (``softcap``) and attention sinks (``s_aux``) are not applied here:
    ``HFPolicy`` refuses such models with ``attn_implementation: sdpa``.
    """
    info: PackingInfo | None = kwargs.get("rl_packing")
    if info is None:
        raise RLError(
            f"attention implementation {ATTN_NAME!r} serves only HFPolicy's packed forward (it "
            "needs the rl_packing kwarg); load the model with attn_implementation='sdpa' for "
            "other uses."
        )
    for name in ("softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise RLError(
                f"attention implementation {ATTN_NAME!r}: the model passes {name}, which the "
                "packed attention does not apply; use policy.attn_implementation: eager."
            )
    window = kwargs.get("sliding_window")
    q_1HTD, k_1KTD, v_1KTD = query, key, value
    n_rep = q_1HTD.shape[1] // k_1KTD.shape[1]
    if info.mode == "mask":
        mask_TT = info.mask_TT
        if window is not None and info.pos_T is not None:
            mask_TT = mask_TT & (info.pos_T[:, None] - info.pos_T[None, :] < window)
        out_1HTD = torch.nn.functional.scaled_dot_product_attention(
            q_1HTD,
            _repeat_kv(k_1KTD, n_rep),
            _repeat_kv(v_1KTD, n_rep),
            attn_mask=mask_TT,
            dropout_p=dropout,
            scale=scaling,
        )
        return out_1HTD.transpose(1, 2), None

    n, length = info.num_seqs, info.max_len

    def to_padded(x_1XTD: torch.Tensor) -> torch.Tensor:
        x_TXD = x_1XTD[0].transpose(0, 1)
        h, d = x_TXD.shape[1], x_TXD.shape[2]
        pad_SXD = x_TXD.index_select(0, info.gather_index_S)
        return pad_SXD.view(n, length, h, d).transpose(1, 2)  # [N, X, L, D]

    q_NHLD = to_padded(q_1HTD)
    if window is not None and window < length:  # causal within the last `window` positions
        pos_L = torch.arange(length, device=q_NHLD.device)
        dist_LL = pos_L[:, None] - pos_L[None, :]
        out_NHLD = torch.nn.functional.scaled_dot_product_attention(
            q_NHLD,
            _repeat_kv(to_padded(k_1KTD), n_rep),
            _repeat_kv(to_padded(v_1KTD), n_rep),
            attn_mask=(dist_LL >= 0) & (dist_LL < window),
            dropout_p=dropout,
            scale=scaling,
        )
    elif q_NHLD.device.type == "cpu":
        # Grouped-query heads read their key/value head in the kernel (enable_gqa) instead of
        # from a repeated copy: the same values (bitwise on CPU's flash kernel at 2 query
        # heads per key head), without the copy in the forward and its sum in the backward.
        # CPU only: on CUDA, fp32 inputs would lose the memory-efficient kernel (no GQA there).
        out_NHLD = torch.nn.functional.scaled_dot_product_attention(
            q_NHLD,
            to_padded(k_1KTD),
            to_padded(v_1KTD),
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
            enable_gqa=n_rep > 1,
        )
    else:
        out_NHLD = torch.nn.functional.scaled_dot_product_attention(
            q_NHLD,
            _repeat_kv(to_padded(k_1KTD), n_rep),
            _repeat_kv(to_padded(v_1KTD), n_rep),
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
        )
    out_SHD = out_NHLD.transpose(1, 2).reshape(n * length, out_NHLD.shape[1], out_NHLD.shape[3])
    return out_SHD.index_select(0, info.out_index_T)[None], None


_UNSUPPORTED_FIX = (
    "set policy.attn_implementation: eager (the model's own attention over the packed positions)."
)


def check_config(config: Any) -> None:
    """Refuse, before loading, a model config whose attention :func:`packed_sdpa_forward` cannot
    reproduce: logit soft-capping (Gemma 2). ``ConfigError`` names the fix."""
    cfg = config.get_text_config()
    cap = getattr(cfg, "attn_logit_softcapping", None)
    if cap:
        raise ConfigError(
            f"policy.attn_implementation: the {cfg.model_type} model soft-caps attention logits "
            f"(attn_logit_softcapping={cap}), which the packed sdpa attention does not apply "
            f"(its log-probs would not be the model's); {_UNSUPPORTED_FIX}"
        )


def check_model(model: torch.nn.Module) -> None:
    """Refuse a loaded model with attention sinks (gpt-oss), which :func:`packed_sdpa_forward`
    does not apply; ``ConfigError`` names the fix."""
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        raise ConfigError(
            f"policy.attn_implementation: the {model.config.model_type} model has attention "
            f"sinks, which the packed sdpa attention does not apply; {_UNSUPPORTED_FIX}"
        )


def load_for_training(path: Path, dtype: torch.dtype, attn_implementation: str) -> Any:
    """The causal LM of ``path`` for a packed forward: with ``attn_implementation`` ``sdpa`` on
    :data:`ATTN_NAME` (after :func:`check_config`; refusals as ``ConfigError``s naming
    ``eager``), else on transformers' own ``eager`` attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_hf._hf import attention_refused, quiet_progress

    config = AutoConfig.from_pretrained(str(path))  # read once: checked here, loaded below
    packed = attn_implementation == "sdpa"
    if packed:
        check_config(config)
        register_packed_attention()
    try:
        with quiet_progress():
            model = AutoModelForCausalLM.from_pretrained(
                str(path),
                config=config,
                dtype=dtype,
                attn_implementation=ATTN_NAME if packed else attn_implementation,
            )
    except ValueError as e:
        error = attention_refused(e, "policy.attn_implementation", "the packed sdpa attention")
        if error is None or not packed:
            raise
        raise error from e
    if packed:
        check_model(model)
    return model


def register_packed_attention() -> None:
    """Register :func:`packed_sdpa_forward` under :data:`ATTN_NAME` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, packed_sdpa_forward)
