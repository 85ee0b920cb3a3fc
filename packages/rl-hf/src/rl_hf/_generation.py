"""HFGenerator's batch plumbing: the pending-request record and the module-level helpers of its
decode loop (routing of the prefill, emitting finished rows, per-row sampling, resolving futures on
the event loop)."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from rl_core.logprobs import truncate_logits
from rl_core.routing import pad_routing
from rl_core.types import FinishReason, GenerationRequest, GenerationResult


@dataclass(slots=True)
class _Pending:
    """One queued request and where its answer goes."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[GenerationResult]
    seed: int


def _prefill_routing(
    reqs: list[GenerationRequest], prefill_NLK: torch.Tensor, L: int, dtype: torch.dtype
) -> torch.Tensor:
    """The routing of the prefill (``[U * L, layers, K]``, one row per distinct prompt, in
    :meth:`HFGenerator._prefill`'s order, and position) as ``[B, L, layers, K]``, one row per
    request, left-padded like the prompts, in the compact ``dtype``."""
    first: dict[tuple[int, ...], int] = {}
    for b, r in enumerate(reqs):
        first.setdefault(r.input_ids, b)
    row_of = {b: u for u, b in enumerate(sorted(first.values()))}
    expand_B = torch.tensor([row_of[first[r.input_ids]] for r in reqs], dtype=torch.long)
    route_ULNK = prefill_NLK.to("cpu", dtype).view(len(first), L, *prefill_NLK.shape[1:])
    return route_ULNK[expand_B]


def _emit(
    batch: list[_Pending],
    st: dict[str, torch.Tensor],
    a_rows: list[int],
    n: int,
    stop_A: torch.Tensor,
    hit_A: torch.Tensor | None,
    version: int,
    prompt_len: int,
) -> None:
    """Post the results of rows ``a_rows`` (indices into the rows still in the batch), each with
    its first ``n`` tokens and why it ended: a stop token, an abort, or its length.

    Routing (requests with ``return_routing``): the prompt's rows from the prefill, then one row
    per output token the model was run on (all but the last), padded to ``P + n`` rows
    (:func:`rl_core.routing.pad_routing`)."""
    stop_l = stop_A.tolist()
    hit_l = hit_A.tolist() if hit_A is not None else None
    rows_l = st["row"].tolist()
    # Tokens and log-probs of the ended rows to Python in one conversion each.
    ids_l = st["ids"][a_rows, :n].tolist()
    lp_l = st["lp"][a_rows, :n].tolist()
    # One wake-up per caller's event loop for all rows ending now (not one per row).
    done: dict[asyncio.AbstractEventLoop, list[tuple[Any, GenerationResult]]] = {}
    for i, a in enumerate(a_rows):
        if stop_l[a]:
            reason = FinishReason.STOP
        elif hit_l is not None and hit_l[a]:
            reason = FinishReason.ABORT
        else:
            reason = FinishReason.LENGTH
        p = batch[rows_l[a]]
        routed = None
        if p.request.return_routing and "route" in st:
            P = len(p.request.input_ids)
            prompt_PLK = st["prompt_route"][a, prompt_len - P :]
            routed = pad_routing(torch.cat([prompt_PLK, st["route"][a, : n - 1]]), P + n).clone()
        res = GenerationResult(
            request_id=p.request.request_id,
            output_ids=tuple(ids_l[i]),
            output_logprobs=tuple(lp_l[i]),
            finish_reason=reason,
            weight_version=version,
            routed_experts=routed,
        )
        done.setdefault(p.loop, []).append((p.future, res))
    for loop, results in done.items():
        _post(loop, _resolve_all, results)


def _sample_rows(
    logits_AV: torch.Tensor,
    *,
    scale_A: torch.Tensor,
    greedy_A: torch.Tensor | None,
    top_p_A: torch.Tensor,
    top_k_A: torch.Tensor,
    u_A: torch.Tensor,
    filter_any: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row; returns ``(tokens [A], log-probs [A])``.

    Log-probs are those of the distribution sampled from: ``log_softmax(logits / T)`` over the
    row's top-k / top-p candidate set (``T = 1`` for greedy rows; top-k first, then top-p on the
    renormalised top-k mass, as SGLang and HF do; ties at the cut are all kept, see
    :func:`rl_core.logprobs.truncate_logits`). Sampling is by inverse CDF, in vocabulary order,
    with the row's uniform ``u_A`` in [0, 1), so a row samples the same token whether or not
    other rows of its batch truncate.
    """
    dev = logits_AV.device
    z_AV = logits_AV / scale_A.to(dev)[:, None]
    if filter_any:
        z_AV = truncate_logits(z_AV, top_p=top_p_A.to(dev), top_k=top_k_A.to(dev))
    logp_AV = torch.log_softmax(z_AV, dim=-1)
    V = logp_AV.shape[-1]
    p_AV = logp_AV.exp()
    cdf_AV = p_AV.double().cumsum(-1)
    j_A = torch.searchsorted(cdf_AV, (u_A.to(dev) * cdf_AV[:, -1])[:, None], right=True)
    tok_A = j_A.clamp_(max=V - 1).squeeze(1)
    if greedy_A is not None:
        tok_A = torch.where(greedy_A.to(dev), logits_AV.argmax(-1), tok_A)
    lp_A = logp_AV.gather(1, tok_A[:, None]).squeeze(1)
    return tok_A, lp_A


def _post(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> None:
    """Run ``fn(*args)`` on ``loop``; a loop that closed meanwhile (caller gone) is ignored."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _resolve(fut: asyncio.Future[GenerationResult], res: GenerationResult) -> None:
    if not fut.done():
        fut.set_result(res)


def _resolve_all(results: list[tuple[asyncio.Future[GenerationResult], GenerationResult]]) -> None:
    for fut, res in results:
        _resolve(fut, res)


def _fail(fut: asyncio.Future[GenerationResult], err: BaseException) -> None:
    if not fut.done():
        fut.set_exception(err)
