"""The async rollout pipeline's schedule: which weight version each round is generated with,
how far generation runs ahead, draining for eval/checkpoints, and failures."""

from __future__ import annotations

import asyncio

import pytest

from rl_core.errors import RLError
from rl_trainer.step.pipeline import RolloutPipeline


class _Fake:
    """A generator version counter plus an event log of what the producer and trainer did."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.version = 0
        self.log: list[tuple] = []
        self.fail_at = fail_at

    async def produce(self, step: int) -> dict:
        await asyncio.sleep(0.001)
        if step == self.fail_at:
            raise RLError(f"round {step} failed")
        self.log.append(("produce", step, self.version))
        return {"step": step}

    async def serve(self, version: int, weights) -> None:
        if version > self.version:
            self.log.append(("serve", version, weights))
            self.version = version


async def _train(pipe: RolloutPipeline, fake: _Fake, steps: int, s: int) -> None:
    for step in range(1, steps + 1):
        assert (await pipe.next_round(step)) == {"step": step}
        fake.log.append(("train", step, step - 1))  # step k trains policy version k - 1
        await asyncio.sleep(0.005)  # training: the producer runs meanwhile
        policy = step
        fake.log.append(("release", policy, None))
        await pipe.release(policy, f"w{policy}" if s > 0 else None)


def _pipe(fake: _Fake, s: int, steps: int) -> RolloutPipeline:
    return RolloutPipeline(
        produce=fake.produce,
        serve=fake.serve,
        max_staleness=s,
        first_version=0,
        last_step=steps,
        next_step=1,
        released=0,
    )


@pytest.mark.parametrize("s", [0, 1, 2])
def test_each_round_uses_exactly_the_version_s_behind(s):
    async def main():
        fake = _Fake()
        pipe = _pipe(fake, s, 6)
        pipe.start()
        await _train(pipe, fake, 6, s)
        await pipe.close()
        return fake.log

    log = asyncio.run(main())
    produced = {step: v for kind, step, v in log if kind == "produce"}
    assert produced == {k: max(0, k - 1 - s) for k in range(1, 7)}
    # The released copy is what gets published (none needed at staleness 0).
    served = [(v, w) for kind, v, w in log if kind == "serve"]
    assert served == [(v, f"w{v}" if s else None) for v in range(1, 6 - s)]
    # Round k+1 is generated while step k trains (before version k exists) iff s >= 1.
    order = [(kind, step) for kind, step, _ in log]
    for k in range(1, 6):
        ahead = order.index(("produce", k + 1)) < order.index(("release", k))
        assert ahead == (s >= 1), (k, order)


def test_drain_waits_for_the_rounds_before_the_version():
    async def main():
        fake = _Fake()
        pipe = _pipe(fake, 2, 8)
        pipe.start()
        assert await pipe.next_round(1) == {"step": 1}
        # Policy now at version 1: rounds needing version 0 (steps 1..3) must be done.
        await pipe.drain(1)
        done = [step for kind, step, _ in fake.log if kind == "produce"]
        assert done == [1, 2, 3]
        assert pipe.state_dict() == {"ready": {2: {"step": 2}, 3: {"step": 3}}}
        await asyncio.sleep(0.02)  # still waiting for version 1
        assert [s for k, s, _ in fake.log if k == "produce"] == [1, 2, 3]
        await pipe.release(1, "w1")
        assert await pipe.next_round(2) == {"step": 2}
        await pipe.drain(2)
        assert [s for k, s, _ in fake.log if k == "produce"] == [1, 2, 3, 4]
        assert fake.version == 1
        await pipe.close()

    asyncio.run(main())


def test_a_failed_round_reaches_the_trainer():
    async def main():
        fake = _Fake(fail_at=2)
        pipe = _pipe(fake, 1, 4)
        pipe.start()
        await pipe.next_round(1)
        with pytest.raises(RLError, match="round 2 failed"):
            await pipe.next_round(2)
        with pytest.raises(RLError, match="round 2 failed"):
            await pipe.drain(1)
        await pipe.close()

    asyncio.run(main())


def test_resumed_pipeline_continues_after_the_ready_rounds():
    async def main():
        fake = _Fake()
        fake.version = 3
        pipe = RolloutPipeline(
            produce=fake.produce,
            serve=fake.serve,
            max_staleness=1,
            first_version=0,
            last_step=6,
            next_step=4,
            released=3,
            ready={4: {"step": 4}},
        )
        pipe.start()
        assert await pipe.next_round(4) == {"step": 4}
        assert await pipe.next_round(5) == {"step": 5}
        await pipe.close()
        return fake.log

    log = asyncio.run(main())
    assert log[0] == ("produce", 5, 3)


def test_continuous_rounds_use_the_newest_release_and_stay_s_rounds_ahead():
    """``rl.async_mode: continuous`` with generation slower than training: each round starts
    on the newest released version (fresher than lockstep's exact ``k - 1 - s``), and the
    producer never holds more than ``s`` unconsumed rounds."""

    async def main():
        fake = _Fake()
        slow = fake.produce

        async def produce(step: int) -> dict:
            await asyncio.sleep(0.03)  # a round takes longer than a training step
            return await slow(step)

        pipe = RolloutPipeline(
            produce=produce,
            serve=fake.serve,
            max_staleness=2,
            first_version=0,
            last_step=6,
            next_step=1,
            released=0,
            continuous=True,
        )
        pipe.start()
        most_ready = 0
        for step in range(1, 7):
            assert await pipe.next_round(step) == {"step": step}  # rounds in order
            await asyncio.sleep(0.005)  # training
            most_ready = max(most_ready, len(pipe.state_dict()["ready"]))
            await pipe.release(step, f"w{step}")
        await pipe.drain(6)  # pauses after the round in progress
        n = len([k for k, *_ in fake.log if k == "produce"])
        await asyncio.sleep(0.08)
        assert len([k for k, *_ in fake.log if k == "produce"]) == n  # paused until a release
        await pipe.close()
        return fake.log, most_ready

    log, most_ready = asyncio.run(main())
    produced = [(step, v) for kind, step, v in log if kind == "produce"]
    versions = [v for _, v in produced[:6]]
    lockstep = [max(0, k - 1 - 2) for k in range(1, 7)]
    assert versions == sorted(versions)
    assert all(v >= need for v, need in zip(versions, lockstep, strict=True))
    assert sum(versions) > sum(lockstep)  # fresher: the newest release, not the oldest allowed
    assert most_ready <= 2
    # What was served is always the newest copy the trainer had released.
    served = [v for kind, v, _ in log if kind == "serve"]
    assert served == sorted(set(served))
