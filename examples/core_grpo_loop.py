"""rl-core in a plain training loop: GRPO advantages and the clipped policy loss on a tiny
transformers model, log-probs from ``rl_hf.packed_logprobs``.

The task: after a 4-token prompt, write token 7 as often as possible (reward = the fraction of
response tokens equal to 7). The model is a random 1-layer Qwen2 built from its config (no
download); the mean reward rises within a few steps.

    OMP_NUM_THREADS=1 python examples/core_grpo_loop.py
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from rl_core.algorithms import GRPO, PolicyLoss
from rl_core.batching import pack_rollouts
from rl_core.types import AdvantageInputs, Rollout
from rl_hf import packed_logprobs

TARGET, VOCAB, PROMPT_LEN, RESPONSE_LEN = 7, 32, 4, 6
PROMPTS, SAMPLES, STEPS = 4, 8, 8


def sample(
    model: torch.nn.Module, prompts: torch.Tensor, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sampled continuations of each prompt, ``[P * n, PROMPT_LEN + RESPONSE_LEN]``, and
    the sampler's log-prob of each response token ``[P * n, RESPONSE_LEN]``."""
    ids = prompts.repeat_interleave(n, dim=0)
    logps = []
    with torch.no_grad():
        for _ in range(RESPONSE_LEN):
            logp = model(ids).logits[:, -1].float().log_softmax(-1)
            nxt = torch.multinomial(logp.exp(), 1)
            logps.append(logp.gather(1, nxt))
            ids = torch.cat([ids, nxt], dim=1)
    return ids, torch.cat(logps, dim=1)


def main(steps: int = STEPS, seed: int = 0) -> list[float]:
    """Train for ``steps`` GRPO steps; the mean reward of each step."""
    torch.manual_seed(seed)
    config = AutoConfig.for_model(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    advantage_fn = GRPO(GRPO.Config())
    loss_fn = PolicyLoss(PolicyLoss.Config(eps_clip_low=0.2, eps_clip_high=0.28))
    history = []
    for step in range(steps):
        prompts = torch.randint(8, VOCAB, (PROMPTS, PROMPT_LEN))
        seqs, sampler_logps = sample(model, prompts, SAMPLES)
        rollouts = []
        for i, (seq, logp) in enumerate(zip(seqs.tolist(), sampler_logps.tolist())):
            response = seq[PROMPT_LEN:]
            rollouts.append(
                Rollout(
                    prompt_uid=f"{step}-{i // SAMPLES}",
                    rollout_id=f"{step}-{i}",
                    sample_id=f"{step}-{i}",
                    tokens=tuple(seq),
                    response_start=PROMPT_LEN,
                    loss_mask=(1,) * RESPONSE_LEN,
                    rollout_logprobs=tuple(logp),
                    versions=(step,) * RESPONSE_LEN,
                    reward=sum(t == TARGET for t in response) / RESPONSE_LEN,
                )
            )
        rewards = torch.tensor([r.reward for r in rollouts])
        history.append(float(rewards.mean()))
        advantages = advantage_fn(
            AdvantageInputs(
                rewards=rewards,
                group_index=torch.arange(len(rollouts)) // SAMPLES,
                response_mask=[torch.ones(RESPONSE_LEN) for _ in rollouts],
            )
        )
        batch = pack_rollouts(rollouts, advantages=advantages)  # token-mean loss weights
        with torch.no_grad():  # the policy before this step's update
            batch.old_logprobs = packed_logprobs(model, batch).logprobs
        for _ in range(2):  # two optimizer steps on the batch: the ratio leaves 1, clipping acts
            out = loss_fn(packed_logprobs(model, batch).logprobs, batch)
            optimizer.zero_grad()
            out.loss.backward()
            optimizer.step()
        # the packed log-probs are the sampler's (same weights, same tokens)
        gap = (batch.old_logprobs - batch.rollout_logprobs) * batch.loss_mask
        mismatch = gap.abs().max().item()
        print(
            f"step {step}: reward {history[-1]:.3f}  loss {out.loss.item():+.4f}  "
            f"clipfrac {out.metrics['pg_clipfrac']:.2f}  |packed - sampler log-prob| {mismatch:.1e}"
        )
    return history


if __name__ == "__main__":
    rewards = main()
    print(f"mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}")
