"""rl-hf: a tiny transformers model as a policy and a generator, one RL step between them.

``build_tiny_model`` writes a random Qwen2 with the local byte-level tokenizer (no download).
The generator samples with log-probs, the policy scores the same tokens (equal to the
sampler's), takes one GRPO-style step, and the new weights go back to the generator through
the in-process weight transport.

    OMP_NUM_THREADS=1 python examples/hf_policy_generator.py
"""

from __future__ import annotations

import asyncio
import tempfile

import torch

from rl_core.algorithms import PolicyLoss
from rl_core.batching import pack_rollouts
from rl_core.types import GenerationRequest, Rollout, SamplingParams
from rl_hf import HFGenerator, HFPolicy, build_tiny_model, build_tokenizer
from rl_weightsync import InProcessTransport


async def main(model_dir: str) -> None:
    """Sample, score, train one step, sync the weights back."""
    path = build_tiny_model(model_dir)
    tokenizer = build_tokenizer()
    policy = HFPolicy(HFPolicy.Config(model_path=str(path), lr=1e-3))
    generator = HFGenerator(HFGenerator.Config(model_path=str(path)))
    prompt = tuple(tokenizer.encode("reverse: abc ->"))
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8)
    results = await generator.generate(
        [
            GenerationRequest(request_id=f"r{i}", input_ids=prompt, sampling=sampling)
            for i in range(4)
        ]
    )
    rollouts = [
        Rollout(
            prompt_uid="p0",
            rollout_id=res.request_id,
            sample_id=res.request_id,
            tokens=prompt + res.output_ids,
            response_start=len(prompt),
            loss_mask=(1,) * len(res.output_ids),
            rollout_logprobs=res.output_logprobs,
            versions=(res.weight_version,) * len(res.output_ids),
            reward=float(i == 0),  # a made-up reward
        )
        for i, res in enumerate(results)
    ]
    for r in rollouts:  # a random model writes random bytes
        print(f"{r.sample_id}: response ids {list(r.tokens[r.response_start :])}")
    mean = sum(r.reward for r in rollouts) / len(rollouts)
    advantages = [torch.full((r.response_length,), r.reward - mean) for r in rollouts]
    batch = pack_rollouts(rollouts, advantages=advantages)
    old = policy.compute_logprobs(batch).logprobs
    gap = ((old - batch.rollout_logprobs) * batch.loss_mask).abs().max().item()
    print(f"policy log-probs vs the generator's: max |diff| {gap:.1e}")
    batch.old_logprobs = old
    # on-policy the clipped loss is 0 (ratio 1, advantages summing to 0); its gradient is not
    metrics = policy.train_step(batch, PolicyLoss(PolicyLoss.Config()))
    print(f"train step: loss {metrics['loss']:+.4f}, grad norm {metrics['grad_norm']:.4f}")

    transport = InProcessTransport(InProcessTransport.Config())
    update = transport.publish(1, policy.named_weights())
    await generator.update_weights(update, transport)
    print(f"generator now on weight version {generator.weight_version}")
    await generator.close()


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(main(tmp))
