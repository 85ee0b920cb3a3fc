"""rl-megatron: a MegatronPolicy built from a Hugging Face checkpoint, on the CPU (gloo), scoring
and training like any ``rl_core.interfaces.Policy``.

Without a launcher environment the process is a world of one; without CUDA, rl_megatron patches
megatron-core's CUDA-only calls (``rl_megatron._cpu_support``, imported only then). Under
``torchrun`` with ``tp_size`` / ``pp_size`` > 1 the same lines run tensor/pipeline parallel.

    OMP_NUM_THREADS=1 python examples/megatron_policy_cpu.py
"""

from __future__ import annotations

import tempfile

from rl_core.algorithms import SFTLoss
from rl_core.batching import pack_sequences
from rl_hf import TinyModelSpec, build_tiny_model, packed_logprobs
from rl_megatron.policy import MegatronPolicy


def main(model_dir: str) -> None:
    """Log-probs equal transformers' on the same weights; two SFT steps lower the loss."""
    path = build_tiny_model(model_dir, TinyModelSpec(hidden_size=32, num_layers=2))
    policy = MegatronPolicy(MegatronPolicy.Config(model_path=str(path), lr=1e-2))
    batch = pack_sequences([[5, 17, 42, 9, 77, 3], [8, 8, 100, 31], [250, 2, 61, 14, 14]])

    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(path))
    want = packed_logprobs(reference, batch).logprobs.detach()
    got = policy.compute_logprobs(batch).logprobs
    print(f"log-probs vs transformers: max |diff| {(got - want).abs().max().item():.1e}")
    assert (got - want).abs().max() < 1e-5

    losses = [policy.train_step(batch, SFTLoss(SFTLoss.Config()))["loss"] for _ in range(2)]
    print(f"SFT loss over two steps: {losses[0]:.4f} -> {losses[1]:.4f}")
    assert losses[1] < losses[0]
    names = [n for n, _ in policy.named_weights()]
    print(f"{len(names)} Hugging Face-named tensors to publish, e.g. {names[0]}")


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        main(tmp)
