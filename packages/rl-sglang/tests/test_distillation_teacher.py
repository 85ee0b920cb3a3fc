"""SGLangTeacher: the session's real SGLang server scores given tokens as transformers does. (The
name sorts before the modules that own their server: the session server is stopped for those.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rl_core.batching import pack_rollouts
from rl_core.errors import ConfigError, RLError
from rl_core.types import Rollout
from rl_hf import HFPolicy
from rl_sglang.teacher import SGLangTeacher


def _rollout(i: int, tokens: list[int], prompt_len: int) -> Rollout:
    r = len(tokens) - prompt_len
    return Rollout(
        prompt_uid=f"p{i}",
        rollout_id=f"r{i}",
        sample_id=f"s{i}",
        tokens=tuple(tokens),
        response_start=prompt_len,
        loss_mask=(1,) * r,
        rollout_logprobs=(0.0,) * r,
        versions=(0,) * r,
    )


def test_teacher_logprobs_equal_transformers(attach, tiny_model: Path) -> None:
    gen = attach()
    teacher = SGLangTeacher(SGLangTeacher.Config(url=gen.server_urls[0], concurrency=2))
    batch = pack_rollouts(
        [_rollout(0, [5, 17, 42, 99, 3], 2), _rollout(1, [120, 64, 7, 250, 31, 11, 2], 3)]
    )
    got_T = teacher.compute_logprobs(batch).logprobs
    want_T = HFPolicy(HFPolicy.Config(model_path=str(tiny_model))).compute_logprobs(batch).logprobs
    assert got_T.shape == want_T.shape == (12,)
    assert got_T[0] == 0 and got_T[5] == 0  # sequence starts
    torch.testing.assert_close(got_T, want_T, atol=1e-3, rtol=0)


def test_teacher_errors() -> None:
    with pytest.raises(ConfigError, match="teacher.url"):
        SGLangTeacher.Config(url="localhost:30000")
    teacher = SGLangTeacher(SGLangTeacher.Config(url="http://127.0.0.1:9", max_retries=0))
    batch = pack_rollouts([_rollout(0, [5, 17, 42], 1)])
    with pytest.raises(RLError, match="cannot reach the SGLang server"):
        teacher.compute_logprobs(batch)
