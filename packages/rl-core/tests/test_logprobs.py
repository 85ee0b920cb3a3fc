"""Chunked log-probs from hidden states (rl_core.logprobs): values and gradients equal the plain
autograd computation, nothing of size [S, V] is kept for backward, and the vocabulary-parallel
form over two processes (gloo) equals the single-process one."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st

from rl_core.logprobs import linear_logprobs


def _inputs(s: int, v: int, h: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden_SH = (torch.randn(s, h, generator=g) * 2).to(dtype).requires_grad_()
    weight_VH = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_()
    targets_S = torch.randint(0, v, (s,), generator=g)
    g_logp_S = torch.randn(s, generator=g)
    g_ent_S = torch.randn(s, generator=g)
    return hidden_SH, weight_VH, targets_S, g_logp_S, g_ent_S


def _run(hidden_SH, weight_VH, targets_S, g_logp_S, g_ent_S, **kw):
    """Values and the gradients of ``sum(g_logp * logp + g_ent * entropy)``."""
    h = hidden_SH.detach().clone().requires_grad_()
    w = weight_VH.detach().clone().requires_grad_()
    logp_S, ent_S = linear_logprobs(h, w, targets_S, **kw)
    loss = (logp_S * g_logp_S).sum()
    if ent_S is not None:
        loss = loss + (ent_S * g_ent_S).sum()
    loss.backward()
    return logp_S.detach(), None if ent_S is None else ent_S.detach(), h.grad, w.grad


def _assert_same(a, b, atol: float, rtol: float) -> None:
    for x, y in zip(a, b, strict=True):
        if x is None or y is None:
            assert x is None and y is None
            continue
        torch.testing.assert_close(x.float(), y.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("chunk", [1, 7, 29, 1000])
@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_equals_unchunked_fp32(chunk: int, with_entropy: bool) -> None:
    args = _inputs(29, 300, 16, torch.float32)
    kw = {"temperature": 0.7, "with_entropy": with_entropy}
    ref = _run(*args, chunk_tokens=0, **kw)
    got = _run(*args, chunk_tokens=chunk, **kw)
    _assert_same(got, ref, atol=1e-5, rtol=1e-5)
    assert got[0].dtype == torch.float32 and (got[0] <= 0).all()


def test_chunked_equals_unchunked_bf16() -> None:
    """bf16 hidden and head (matmul in bf16, softmax in fp32): equal to bf16 autograd within
    bf16 rounding of the gradients, values equal to fp32 rounding."""
    args = _inputs(40, 500, 32, torch.bfloat16, seed=3)
    kw = {"temperature": 1.3, "with_entropy": True}
    ref = _run(*args, chunk_tokens=0, **kw)
    got = _run(*args, chunk_tokens=16, **kw)
    _assert_same(got[:2], ref[:2], atol=1e-5, rtol=1e-5)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    _assert_same(got[2:], ref[2:], atol=2e-2, rtol=2e-2)


def test_tied_head_accumulates_both_gradients() -> None:
    """The head weight also embeds the inputs (tied): its gradient sums both uses exactly as
    plain autograd does."""
    g = torch.Generator().manual_seed(5)
    v, h, s = 200, 12, 33
    weight0 = torch.randn(v, h, generator=g) / h**0.5
    mix0 = torch.randn(h, h, generator=g)
    tokens_S = torch.randint(0, v, (s + 1,), generator=g)

    def grads(chunk: int):
        weight = weight0.clone().requires_grad_()
        mix = mix0.clone().requires_grad_()
        hidden_SH = torch.tanh(weight[tokens_S[:-1]] @ mix)
        logp_S, ent_S = linear_logprobs(
            hidden_SH, weight, tokens_S[1:], with_entropy=True, chunk_tokens=chunk
        )
        (logp_S.sum() - 0.1 * ent_S.sum()).backward()
        return weight.grad, mix.grad

    _assert_same(grads(5), grads(0), atol=1e-5, rtol=1e-5)


def test_padding_columns_are_excluded() -> None:
    """Rows at or beyond ``vocab_size`` (vocabulary padding) take no probability and no gradient."""
    args = _inputs(21, 130, 8, torch.float32, seed=7)
    hidden_SH, weight_VH, targets_S, g_logp_S, g_ent_S = args
    targets_S = targets_S % 100
    kw = {"with_entropy": True}
    ref = _run(hidden_SH, weight_VH[:100], targets_S, g_logp_S, g_ent_S, chunk_tokens=0, **kw)
    got = _run(
        hidden_SH, weight_VH, targets_S, g_logp_S, g_ent_S, chunk_tokens=4, vocab_size=100, **kw
    )
    _assert_same(got[:3], ref[:3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[3][:100], ref[3], atol=1e-5, rtol=1e-5)
    assert (got[3][100:] == 0).all()


def test_backward_keeps_no_full_logits() -> None:
    """No tensor of ``[S, V]`` size is saved for backward by the chunked path (the unchunked
    one saves several: the check can fail)."""
    s, v = 64, 512
    args = _inputs(s, v, 8, torch.float32)

    def largest_saved(chunk: int) -> int:
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            h = args[0].detach().clone().requires_grad_()
            linear_logprobs(h, args[1], args[2], with_entropy=True, chunk_tokens=chunk)
        return max(sizes)

    assert largest_saved(0) >= s * v
    assert largest_saved(16) <= v * 8  # the weight [V, H] is the largest thing kept


def test_empty_selection() -> None:
    h = torch.zeros(0, 4, requires_grad=True)
    w = torch.randn(10, 4, requires_grad=True)
    logp_S, ent_S = linear_logprobs(h, w, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert logp_S.shape == (0,) and ent_S is not None and ent_S.shape == (0,)
    logp_S.sum().backward()
    assert w.grad is not None and (w.grad == 0).all()


@settings(max_examples=15, deadline=None)
@given(
    s=st.integers(1, 40),
    v=st.integers(2, 90),
    chunk=st.integers(1, 50),
    temperature=st.floats(0.3, 3.0),
    with_entropy=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_unchunked_property(
    s: int, v: int, chunk: int, temperature: float, with_entropy: bool, seed: int
) -> None:
    args = _inputs(s, v, 6, torch.float64, seed=seed)
    kw = {"temperature": temperature, "with_entropy": with_entropy}
    _assert_same(
        _run(*args, chunk_tokens=chunk, **kw), _run(*args, chunk_tokens=0, **kw), 1e-9, 1e-9
    )


# ------------------------------------------------------------------ vocabulary-parallel (gloo)


def _tp_worker(rank: int, world: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        args = _inputs(23, 101, 8, torch.float64, seed=11)
        hidden_SH, weight_VH, targets_S, g_logp_S, g_ent_S = args
        padded = torch.cat([weight_VH.detach(), torch.zeros(3, 8, dtype=torch.float64)])  # 104
        width = padded.shape[0] // world
        h = hidden_SH.detach().clone().requires_grad_()
        w = padded[rank * width : (rank + 1) * width].clone().requires_grad_()
        logp_S, ent_S = linear_logprobs(
            h,
            w,
            targets_S,
            temperature=0.9,
            with_entropy=True,
            chunk_tokens=5,
            vocab_start=rank * width,
            vocab_size=101,
            group=torch.distributed.group.WORLD,
        )
        ((logp_S * g_logp_S).sum() + (ent_S * g_ent_S).sum()).backward()
        grad_h = h.grad.clone()
        torch.distributed.all_reduce(grad_h)  # what copy_to_tensor_model_parallel_region does
        ref = _run(*args, chunk_tokens=0, temperature=0.9, with_entropy=True)
        torch.testing.assert_close(logp_S.detach(), ref[0], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(ent_S.detach(), ref[1], atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(grad_h, ref[2], atol=1e-10, rtol=1e-10)
        ref_w = torch.cat([ref[3], torch.zeros(3, 8, dtype=torch.float64)])
        torch.testing.assert_close(w.grad, ref_w[rank * width : (rank + 1) * width])
        out[rank] = "ok"
    finally:
        torch.distributed.destroy_process_group()


def test_vocab_parallel_two_ranks_equal_single_process() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_tp_worker, args=(2, port, out), nprocs=2, start_method="fork")
        assert dict(out) == {0: "ok", 1: "ok"}
