"""One rank of the three-process TP=3 job of ``test_real_model_parity.py`` (not a test file).

Run with ``torch.distributed.run --nproc-per-node 3`` as ``_real_model_tp_worker.py MODEL_DIR
BATCH_PT OUT_PT``: builds MegatronPolicy at TP=3 on the real model, exports the gathered Hugging
Face tensors and computes log-probs and entropy of the batch; rank 0 saves them with the other
ranks' log-probs (to check that every rank agrees).
"""

from __future__ import annotations

import sys

import torch

from rl_megatron.policy import MegatronPolicy


def main() -> None:
    model_dir, batch_pt, out_pt = sys.argv[1:4]
    torch.set_num_threads(1)
    policy = MegatronPolicy(MegatronPolicy.Config(model_path=model_dir, tp_size=3))
    assert policy.layout.tp_size == 3
    exported = {n: t.clone() for n, t in policy.named_weights()}
    batch = torch.load(batch_pt, weights_only=False)
    out = policy.compute_logprobs(batch, with_entropy=True)
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, out.logprobs)
    if torch.distributed.get_rank() == 0:
        torch.save(
            {
                "exported": exported,
                "logprobs": out.logprobs,
                "entropy": out.entropy,
                "ranks_equal": all(torch.equal(x, every[0]) for x in every),
            },
            out_pt,
        )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
