"""Shared-prefix packing (``HFPolicy.Config.share_prefix``): the model runs on a compact row that
holds each group's prompt once, and every log-prob, entropy, value and gradient equals the
unshared forward's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from rl_core.testing.policy import sft_loss, shared_prompt_batch
from rl_core.types import TrainBatch
from rl_hf import HFCritic, HFPolicy, TinyModelSpec, build_tiny_model
from rl_hf._hf import token_logprobs
from rl_hf._packed_attention import PackingInfo, SharedPrefix

VOCAB = 260


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), TinyModelSpec(arch="qwen2"))


def grouped_batch(
    groups: list[tuple[int, list[int]]], *, seed: int = 0, micro_batch_bounds: tuple[int, ...] = ()
) -> TrainBatch:
    return shared_prompt_batch(VOCAB, groups, seed=seed, micro_batch_bounds=micro_batch_bounds)


def _find(batch: TrainBatch) -> SharedPrefix | None:
    return SharedPrefix.find(
        batch.tokens, batch.cu_seqlens, batch.loss_mask, batch.seq_index(), batch.position_ids()
    )


GROUPS = [(5, [3, 7, 1, 4]), (9, [2, 6]), (4, [5]), (7, [8, 3, 3])]


def test_find_compacts_each_prompt_once() -> None:
    batch = grouped_batch(GROUPS)
    shared = _find(batch)
    assert shared is not None
    prompts = sum(p for p, _ in GROUPS)
    responses = sum(sum(r) for _, r in GROUPS)
    assert shared.num_compact == prompts + responses < batch.num_tokens
    assert int(shared.keep_T.sum()) == shared.num_compact
    # every token reads a compact token equal to itself
    compact_C = batch.tokens[shared.keep_T]
    assert torch.equal(compact_C[shared.expand_T], batch.tokens)
    # a follower's prompt tokens read its leader's, not themselves
    followers_T = ~shared.keep_T
    assert followers_T.any()
    assert bool((shared.prefix_T[followers_T]).all())
    assert not bool((shared.prefix_T & (batch.loss_mask > 0)).any())


def test_find_returns_none_without_a_shared_prompt() -> None:
    batch = grouped_batch([(5, [3]), (6, [4]), (2, [2])])
    assert _find(batch) is None
    # a sequence without trained tokens, or trained from its first token, has no prefix
    one = grouped_batch([(3, [0, 0])])
    assert _find(one) is None


@pytest.mark.parametrize("mode", ["pad", "mask"])
def test_compact_row_gives_the_unshared_logits(qwen_dir: Path, mode: str) -> None:
    """Both attention layouts: the compact row's outputs, expanded, equal the full row's."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), share_prefix=False))
    batch = grouped_batch(GROUPS, seed=3)
    pos_T, seq_T = batch.position_ids(), batch.seq_index()
    lengths_N = batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]
    shared = _find(batch)
    assert shared is not None
    full = PackingInfo.build(seq_T, pos_T, lengths_N, mode=mode)
    compact = PackingInfo.build(seq_T, pos_T, lengths_N, mode=mode, shared=shared)
    assert compact.mode == mode
    # the padded layout's [N * L] indices exist in "pad" mode only
    assert (compact.gather_index_S.numel() > 0) == (mode == "pad")
    with torch.no_grad():
        full_TV = policy.model(
            input_ids=batch.tokens[None], position_ids=pos_T[None], use_cache=False, rl_packing=full
        ).logits[0]
        keep = shared.keep_T
        compact_CV = policy.model(
            input_ids=batch.tokens[keep][None],
            position_ids=pos_T[keep][None],
            use_cache=False,
            rl_packing=compact,
        ).logits[0]
    assert compact_CV.shape[0] == shared.num_compact
    torch.testing.assert_close(
        compact_CV.index_select(0, shared.expand_T), full_TV, atol=1e-5, rtol=0
    )


def _policies(qwen_dir: Path, **kw) -> tuple[HFPolicy, HFPolicy]:
    plain = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=1e-2, share_prefix=False, **kw))
    shared = HFPolicy(HFPolicy.Config(model_path=str(qwen_dir), lr=1e-2, share_prefix=True, **kw))
    return plain, shared


@pytest.mark.parametrize(
    "kw",
    [{}, {"logprob_positions": "loss_mask", "logprob_chunk_tokens": 7}],
    ids=["logits", "hidden"],
)
def test_logprobs_entropy_and_training_match_unshared(qwen_dir: Path, kw: dict) -> None:
    plain, shared = _policies(qwen_dir, **kw)
    assert shared.shares_prefixes and not plain.shares_prefixes  # what the trainer plans by
    batch = grouped_batch(GROUPS, seed=5, micro_batch_bounds=(0, 4, 10))
    a = plain.compute_logprobs(batch, with_entropy=True)
    b = shared.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(b.logprobs, a.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(b.entropy, a.entropy, atol=1e-5, rtol=0)
    # the prompt's gradient is summed over the group: the gradients agree
    grads = []
    for policy in (plain, shared):
        policy.model.zero_grad(set_to_none=True)
        for mb in batch.micro_batches():
            logp_T, _ = policy._packed_logprobs(mb, with_entropy=False)
            sft_loss(logp_T, mb, None).loss.backward()
        grads.append({n: p.grad.clone() for n, p in policy.model.named_parameters()})
        policy.model.zero_grad(set_to_none=True)
    assert any(bool(g.abs().max() > 1e-3) for g in grads[0].values())
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-4, msg=name)
    ma = plain.train_step(batch, sft_loss)
    mb = shared.train_step(batch, sft_loss)
    assert mb["loss"] == pytest.approx(ma["loss"], abs=1e-5)
    assert mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=1e-4)


def test_critic_values_match_unshared(qwen_dir: Path) -> None:
    plain = HFCritic(HFCritic.Config(model_path=str(qwen_dir), share_prefix=False))
    shared = HFCritic(HFCritic.Config(model_path=str(qwen_dir), share_prefix=True))
    for critic in (plain, shared):  # a non-zero head, so values depend on the hidden states
        torch.manual_seed(0)
        torch.nn.init.normal_(critic.value_head.weight)
    batch = grouped_batch(GROUPS, seed=7)
    torch.testing.assert_close(
        shared.compute_values(batch), plain.compute_values(batch), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "kw",
    [{}, {"temperature": 0.7}, {"top_p": 0.8}, {"top_k": 5, "temperature": 1.3}],
    ids=["plain", "temperature", "top_p", "top_k"],
)
def test_token_logprobs_on_compact_rows_equal_the_expanded_logits(kw: dict) -> None:
    """``token_logprobs(logits_CV, ..., rows_T=expand_T)`` (log-sum-exp and entropy once per
    compact row) gives the log-probs, entropy and logits gradient of the ``[T, V]`` logits
    gathered from the compact row."""
    gen = torch.Generator().manual_seed(3)
    rows_T = torch.tensor([0, 1, 2, 3, 0, 1, 2, 4, 5, 0, 1, 6], dtype=torch.int64)  # C = 7
    starts_T = torch.tensor([1, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0], dtype=torch.bool)
    tokens_T = torch.randint(0, 11, (12,), generator=gen)
    base_CV = torch.randn(7, 11, generator=gen) * 3
    out = []
    for compact in (False, True):
        logits_CV = base_CV.clone().requires_grad_(True)
        logits = logits_CV if compact else logits_CV.index_select(0, rows_T)
        logp_T, ent_T = token_logprobs(
            logits, tokens_T, starts_T, with_entropy=True, rows_T=rows_T if compact else None, **kw
        )
        (logp_T * torch.arange(12.0)).sum().add(ent_T.sum()).backward()
        out.append((logp_T.detach(), ent_T.detach(), logits_CV.grad))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = out
    assert bool((lp_a[~starts_T] < 0).all()) and bool((ent_a[~starts_T] > 0).all())
    torch.testing.assert_close(lp_b, lp_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(ent_b, ent_a, atol=1e-6, rtol=0)
    torch.testing.assert_close(g_b, g_a, atol=1e-6, rtol=1e-6)
