"""One rank of the two-process TP=2 job of ``test_logprob_memory.py`` (not a test file).

Run as ``python _chunk_worker.py OUT_DIR MODEL_DIR`` with torchrun's variables set. Builds the
policy with the full vocabulary-parallel logits (``logprob_chunk_tokens=0``) and with 3-token
chunks, and records log-probs, entropy and every local parameter's gradient of the same loss;
each rank writes ``OUT_DIR/rank<N>.pt``.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch

from rl_core.testing.policy import random_batch
from rl_megatron.policy import MegatronPolicy


def grads_of(policy: MegatronPolicy) -> dict[str, object]:
    """Log-probs, entropy and gradients (DDP main grads) of one weighted loss on both."""
    batch = random_batch(policy.model_shape.vocab_size, [5, 8, 3, 6], seed=11)
    policy.model.zero_grad_buffer()
    logp_T, ent_T = policy._forward(batch, with_entropy=True)
    g = torch.Generator().manual_seed(1)
    w_2T = torch.randn(2, logp_T.shape[0], generator=g)
    ((logp_T * w_2T[0]).sum() + 0.3 * (ent_T * w_2T[1]).sum()).backward()
    grads = {n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()}
    return {"logp": logp_T.detach(), "ent": ent_T.detach(), "grads": grads}


def main() -> None:
    out, model = Path(sys.argv[1]), sys.argv[2]
    res = {}
    for chunk in (0, 3):
        policy = MegatronPolicy(
            MegatronPolicy.Config(
                model_path=model, tp_size=2, temperature=0.8, logprob_chunk_tokens=chunk
            )
        )
        res[chunk] = grads_of(policy)
        del policy
        gc.collect()
    torch.save(res, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main()
