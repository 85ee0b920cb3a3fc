"""Top-p sampling and the importance ratio, HFGenerator against HFPolicy on one tiny model.

With ``top_p=0.8`` the generator's log-probs are those of the truncated distribution it drew
from. A policy scoring the full vocabulary sits ``log S`` below them on every token (``S`` the
kept mass: the ratio is biased, mean log-ratio clearly negative); the same policy built with
``top_p=0.8`` matches them within float tolerance, so the on-policy ratio is 1.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from rl_core.batching import pack_rollouts
from rl_core.types import GenerationRequest, Rollout, SamplingParams
from rl_hf import HFPolicy, TinyModelSpec, build_tiny_model
from rl_hf.generator import HFGenerator


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Rollout]]:
    path = build_tiny_model(
        tmp_path_factory.mktemp("tiny"),
        TinyModelSpec(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64),
    )
    gen = HFGenerator(HFGenerator.Config(model_path=str(path), max_batch_size=16))
    sampling = dict(temperature=1.0, top_p=0.8, max_new_tokens=12, stop_token_ids=())
    reqs = [
        GenerationRequest(
            request_id=f"r{i}",
            input_ids=(5 + i, 40 + 3 * i, 7),
            sampling=SamplingParams(seed=i, **sampling),
        )
        for i in range(8)
    ]
    results = asyncio.run(gen.generate(reqs))
    asyncio.run(gen.close())
    out = []
    for q, r in zip(reqs, results):
        n = len(r.output_ids)
        out.append(
            Rollout(
                prompt_uid=q.request_id,
                rollout_id=q.request_id,
                sample_id=q.request_id,
                tokens=(*q.input_ids, *r.output_ids),
                response_start=len(q.input_ids),
                loss_mask=(1,) * n,
                rollout_logprobs=tuple(r.output_logprobs),
                versions=(0,) * n,
            )
        )
    return path, out


def _log_ratio(path: Path, rollouts: list[Rollout], **kw) -> torch.Tensor:
    """``logp_train - logp_rollout`` on every response token."""
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), **kw))
    batch = pack_rollouts(rollouts)
    logp_T = policy.compute_logprobs(batch).logprobs
    m_T = batch.loss_mask > 0
    return (logp_T - batch.rollout_logprobs)[m_T]


@pytest.mark.parametrize("chunk", [0, 4])
def test_top_p_ratio_is_biased_without_truncation_and_one_with_it(rollouts, chunk: int) -> None:
    path, rs = rollouts
    assert sum(len(r.loss_mask) for r in rs) >= 40
    biased_R = _log_ratio(path, rs, logprob_chunk_tokens=chunk)
    # log S < 0 on every token whose nucleus cut anything; clearly nonzero on average
    assert biased_R.max() < 1e-4
    assert biased_R.mean() < -0.05, float(biased_R.mean())
    exact_R = _log_ratio(path, rs, logprob_chunk_tokens=chunk, top_p=0.8)
    torch.testing.assert_close(exact_R, torch.zeros_like(exact_R), atol=1e-4, rtol=0)
    torch.testing.assert_close(exact_R.exp(), torch.ones_like(exact_R), atol=1e-4, rtol=0)
