"""Top-p / top-k-aware log-probs on MegatronPolicy (TP=1): equal to HFPolicy's with the same
``top_p``/``top_k``, on the chunked and the full-logits path; TP>1 is refused with the field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.errors import ConfigError
from rl_core.testing.policy import random_batch
from rl_hf import HFPolicy
from rl_megatron.policy import MegatronPolicy


@pytest.mark.parametrize("chunk", [0, 5])
def test_truncated_logprobs_match_hf_policy(chunk: int, model_dirs: dict[str, Path]) -> None:
    path = model_dirs["llama"]
    kw = {"temperature": 0.7, "top_p": 0.8, "top_k": 40}
    policy = MegatronPolicy(
        MegatronPolicy.Config(model_path=str(path), logprob_chunk_tokens=chunk, **kw)
    )
    ref = HFPolicy(HFPolicy.Config(model_path=str(path), **kw))
    full = HFPolicy(HFPolicy.Config(model_path=str(path), temperature=0.7))
    batch = random_batch(policy.model_shape.vocab_size, [7, 12, 4], seed=3)
    mine = policy.compute_logprobs(batch, with_entropy=True)
    theirs = ref.compute_logprobs(batch, with_entropy=True)
    torch.testing.assert_close(mine.logprobs, theirs.logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(mine.entropy, theirs.entropy, atol=1e-5, rtol=0)
    untruncated = full.compute_logprobs(batch).logprobs
    assert (mine.logprobs - untruncated).max() > 0.05  # the option changes the values


def test_truncation_with_tensor_parallelism_is_refused(model_dirs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"policy\.tp_size"):
        MegatronPolicy.Config(model_path=str(model_dirs["llama"]), top_p=0.9, tp_size=2)
