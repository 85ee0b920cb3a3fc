"""Exact resume of the whole data path: source cursor, dynamic sampler, buffer with partial
rollouts. A checkpoint taken mid-epoch with partial rollouts in the buffer, restored into fresh
objects, yields the same next batches as the uninterrupted run."""

from __future__ import annotations

import hashlib
import json

from rl_buffer.buffer import GroupBuffer
from rl_buffer.filters import RewardStdFilter
from rl_buffer.partial import continue_rollout, resume_request
from rl_buffer.sampler import DynamicSampler
from rl_buffer.sources import JsonlSource
from rl_core.types import (
    FinishReason,
    GenerationResult,
    Group,
    Prompt,
    Rollout,
    RolloutStatus,
    SamplingParams,
)

N_SAMPLES, MAX_NEW, ABORT_AT = 4, 8, 5
SAMPLING = SamplingParams(max_new_tokens=MAX_NEW)


def _h(*parts) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:8], "big")


def _tokens(key: str, k: int) -> tuple[int, ...]:
    return tuple(_h(key, j) % 97 + 3 for j in range(k))


def _score(r: Rollout) -> Rollout:
    r.reward = float(_h(r.sample_id, r.tokens) % 2) if r.status.is_trainable() else 0.0
    return r


def toy_generate(prompt: Prompt, version: int) -> Group:
    """Deterministic fake engine: in a third of the groups the first rollout is aborted after
    ABORT_AT tokens (a weight update arrived) and must be resumed on the next version."""
    rollouts = []
    for i in range(N_SAMPLES):
        sid = f"{prompt.uid}/{i}"
        aborted = i == 0 and _h(prompt.uid) % 3 == 0
        length = (
            ABORT_AT + 1 + _h(sid) % (MAX_NEW - ABORT_AT) if aborted else _h(sid) % ABORT_AT + 1
        )
        k = min(length, ABORT_AT)
        status = RolloutStatus.ABORTED if aborted else RolloutStatus.COMPLETED
        rollouts.append(
            _score(
                Rollout(
                    prompt_uid=prompt.uid,
                    rollout_id=sid,
                    sample_id=sid,
                    tokens=prompt.token_ids + _tokens(sid, k),
                    response_start=len(prompt.token_ids),
                    loss_mask=(1,) * k,
                    rollout_logprobs=tuple(-0.1 * (j + 1) for j in range(k)),
                    versions=(version,) * k,
                    status=status,
                    metadata={"target_length": length},
                )
            )
        )
    return Group(prompt=prompt, rollouts=rollouts)


def toy_resume(group: Group, version: int) -> Group:
    out = []
    for r in group.rollouts:
        if r.status == RolloutStatus.ABORTED:
            req = resume_request(r, SAMPLING, request_id=r.sample_id)
            k = r.metadata["target_length"] - r.response_length
            assert req is not None and req.sampling.max_new_tokens == MAX_NEW - r.response_length
            res = GenerationResult(
                request_id=r.sample_id,
                output_ids=_tokens(r.sample_id + "+", k),
                output_logprobs=(-0.5,) * k,
                finish_reason=FinishReason.STOP,
                weight_version=version,
            )
            r = _score(continue_rollout(r, res))
        out.append(r)
    return Group(prompt=group.prompt, rollouts=out)


class Loop:
    def __init__(self, path, tokenizer):
        self.src = JsonlSource(JsonlSource.Config(path=str(path), seed=11), tokenizer)
        self.buf = GroupBuffer(GroupBuffer.Config(max_staleness=1, mask_offpolicy_tokens=True))
        self.sampler = DynamicSampler(DynamicSampler.Config(batch_size=3), [RewardStdFilter()])
        self.version = 0

    def step(self) -> list[Group]:
        self.sampler.add([toy_resume(g, self.version) for g in self.buf.take_partial()])
        for _ in range(50):
            if self.sampler.full:
                break
            done = []
            for p in self.src.next_prompts(self.sampler.request_size()):
                g = toy_generate(p, self.version)
                if any(r.status == RolloutStatus.ABORTED for r in g.rollouts):
                    self.buf.put_partial([g])
                else:
                    done.append(g)
            self.sampler.add(done)
        self.buf.put(self.sampler.pop_batch())
        batch = self.buf.take(3, policy_version=self.version)
        assert batch is not None
        self.version += 1
        return batch

    def state_dict(self):
        return {
            "src": self.src.state_dict(),
            "buf": self.buf.state_dict(),
            "sampler": self.sampler.state_dict(),
            "version": self.version,
        }

    def load_state_dict(self, s):
        self.src.load_state_dict(s["src"])
        self.buf.load_state_dict(s["buf"])
        self.sampler.load_state_dict(s["sampler"])
        self.version = s["version"]


def test_checkpoint_mid_epoch_with_partials_resumes_identically(
    tmp_path, write_jsonl, char_tokenizer
):
    path = write_jsonl(
        tmp_path / "train.jsonl", [{"prompt": f"problem {i}", "label": i} for i in range(40)]
    )
    run = Loop(path, char_tokenizer)
    for _ in range(3):
        run.step()
    state = json.loads(json.dumps(run.state_dict()))
    # the premise: mid-epoch, with partial rollouts and surplus waiting
    assert 0 < state["src"]["position"] < 40 and state["src"]["epoch"] == 0
    assert run.buf.num_partial > 0
    expected = [run.step() for _ in range(4)]

    resumed = Loop(path, char_tokenizer)
    resumed.load_state_dict(state)
    got = [resumed.step() for _ in range(4)]
    assert got == expected
    # resumed partial rollouts were trained on, with tokens of two versions and the older ones
    # masked out of the loss
    mixed = [r for b in expected for g in b for r in g.rollouts if len(set(r.versions)) > 1]
    assert mixed
    for r in mixed:
        newest = max(r.versions)
        assert all(m == (v == newest) for m, v in zip(r.loss_mask, r.versions))


def test_continue_rollout_appends_tokens_logprobs_versions():
    r = Rollout(
        prompt_uid="p",
        rollout_id="p/0",
        sample_id="p/0",
        tokens=(1, 2, 7, 8),
        response_start=2,
        loss_mask=(1, 0),
        rollout_logprobs=(-0.1, 0.0),
        versions=(3, 3),
        status=RolloutStatus.ABORTED,
    )
    res = GenerationResult(
        request_id="p/0",
        output_ids=(9, 10, 11),
        output_logprobs=(-1, -2, -3),
        finish_reason=FinishReason.LENGTH,
        weight_version=4,
    )
    out = continue_rollout(r, res)
    assert out.tokens == (1, 2, 7, 8, 9, 10, 11)
    assert out.loss_mask == (1, 0, 1, 1, 1)
    assert out.rollout_logprobs == (-0.1, 0.0, -1.0, -2.0, -3.0)
    assert out.versions == (3, 3, 4, 4, 4)
    assert out.status == RolloutStatus.TRUNCATED
    req = resume_request(r, SamplingParams(max_new_tokens=5, temperature=0.7), request_id="x")
    assert req.input_ids == r.tokens and req.sampling.max_new_tokens == 3
    assert req.sampling.temperature == 0.7
    assert resume_request(r, SamplingParams(max_new_tokens=2), request_id="x") is None
