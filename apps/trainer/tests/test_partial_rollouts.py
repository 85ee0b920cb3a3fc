"""Partial rollouts (``rl.partial_rollouts``) in the trainer: the rollout pipeline serves the
newest release, the reference generator aborts and resumes, the config's rules. (Resumable
generation itself, on a scripted generator, is tested in
packages/rl-buffer/tests/test_resumable_generation.py.)"""

from __future__ import annotations

import asyncio

import pytest

from rl_buffer import GroupBuffer
from rl_buffer.rollout import PartialStats, generate_groups_resumable
from rl_core.errors import ConfigError
from rl_core.types import Prompt, SamplingParams
from rl_trainer.config import load_trainer_config
from rl_trainer.step.pipeline import RolloutPipeline


def test_pipeline_newer_than_and_catch_up_serve_the_newest_release():
    served = []

    async def serve(version, weights):
        served.append((version, weights))

    async def produce(step):  # pragma: no cover - the producer is not started
        return {}

    async def main():
        pipe = RolloutPipeline(
            produce=produce,
            serve=serve,
            max_staleness=2,
            first_version=0,
            last_step=10,
            next_step=1,
            released=0,
        )
        waiter = asyncio.ensure_future(pipe.newer_than(0))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        await pipe.release(1, "w1")
        await pipe.release(2, "w2")
        await asyncio.wait_for(waiter, 1)
        assert await pipe.catch_up() == 2
        await asyncio.wait_for(pipe.newer_than(1), 1)  # already newer: returns at once

    asyncio.run(main())
    assert served == [(2, "w2")]  # the newest copy; the older one is dropped


def test_hf_generator_abort_and_resume(tmp_path):
    """With the reference generator: an update released mid-generation cuts the running batch
    short; every rollout still gets its full budget, and the tokens sampled after the update
    carry the new version."""
    from rl_hf import HFGenerator
    from rl_hf.tiny import build_tiny_model

    model_dir = build_tiny_model(tmp_path / "tiny")
    gen = HFGenerator(
        HFGenerator.Config(model_path=str(model_dir), max_batch_size=2, stop_on_eos=False)
    )
    forwards = [0]  # model calls: one prefill, then one per decode step
    gen.model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    class Updates:
        caught_up = 0

        async def newer_than(self, version: int) -> None:
            if version >= 1:
                await asyncio.Event().wait()
            while forwards[0] < 10:  # the first batch of two is decoding, six are queued
                await asyncio.sleep(0.001)

        async def catch_up(self) -> int:
            Updates.caught_up += 1
            weights = [(n, t.clone()) for n, t in gen.model.state_dict().items()]
            await asyncio.to_thread(gen.load_weights, weights, version=1)
            return 1

    stats = PartialStats()
    buf = GroupBuffer()

    async def main():
        try:
            return await generate_groups_resumable(
                [Prompt(uid=f"p{i}", input="x", token_ids=(3, 4, 5 + i)) for i in range(4)],
                generator=gen,
                buffer=buf,
                sampling=SamplingParams(max_new_tokens=100, temperature=1.0),
                n_samples=2,
                seed_parts=(0,),
                updates=Updates(),
                stats=stats,
            )
        finally:
            await gen.close()

    groups = asyncio.run(main())
    rollouts = [r for g in groups for r in g.rollouts]
    assert Updates.caught_up == 1 and stats.interruptions == 1 and stats.resumed >= 1
    assert all(r.response_length == 100 for r in rollouts)
    assert all(list(r.versions) == sorted(r.versions) for r in rollouts)
    assert any(0 in r.versions and 1 in r.versions for r in rollouts)  # cut mid-response
    assert any(set(r.versions) == {1} for r in rollouts)  # queued: all on the new version
    assert all(len(r.rollout_logprobs) == 100 for r in rollouts)


@pytest.mark.parametrize(
    ("rl", "rollout", "match"),
    [
        ({"partial_rollouts": True}, {}, "async_generation"),
        ({"partial_rollouts": True, "async_generation": True, "max_staleness": 0}, {}, "max_stal"),
        ({"async_mode": "continuous"}, {}, "rl.async_mode"),
        ({"async_mode": "continuous", "async_generation": True, "max_staleness": 0}, {}, "mode"),
        ({"async_mode": "eventually"}, {}, "async_mode"),
    ],
)
def test_partial_rollouts_config_errors(tmp_path, tiny_recipe_dict, rl, rollout, match):
    """Refused: partial rollouts or continuous mode without generation running ahead."""
    recipe = tiny_recipe_dict(tmp_path)
    recipe["rl"].update(rl)
    recipe["rollout"].update(rollout)
    with pytest.raises(ConfigError, match=match):
        load_trainer_config(recipe)
