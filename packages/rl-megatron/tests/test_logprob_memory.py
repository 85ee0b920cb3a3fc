"""MegatronPolicy at long context: log-probs from hidden states in token chunks equal the full
vocabulary-parallel logits (TP=1 in this process, TP=2 across two CPU processes), and activation
recomputation leaves the gradients unchanged."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from rl_core.errors import ConfigError
from rl_core.testing.policy import random_batch
from rl_megatron.policy import MegatronPolicy

WORKER = Path(__file__).with_name("_chunk_worker.py")


def _megatron(path: Path, **kw: Any) -> MegatronPolicy:
    return MegatronPolicy(MegatronPolicy.Config(model_path=str(path), **kw))


def _grads(policy: MegatronPolicy) -> dict[str, Any]:
    batch = random_batch(policy.model_shape.vocab_size, [5, 8, 3, 6], seed=11)
    policy.model.zero_grad_buffer()
    logp_T, ent_T = policy._forward(batch, with_entropy=True)
    g = torch.Generator().manual_seed(1)
    w_2T = torch.randn(2, logp_T.shape[0], generator=g)
    ((logp_T * w_2T[0]).sum() + 0.3 * (ent_T * w_2T[1]).sum()).backward()
    grads = {n: p.main_grad.detach().clone() for n, p in policy.module.named_parameters()}
    return {"logp": logp_T.detach(), "ent": ent_T.detach(), "grads": grads}


def _assert_same(
    a: dict[str, Any], b: dict[str, Any], atol: float, rtol: float, *, unused: int = 0
) -> None:
    """Same log-probs, entropy and gradients; all but ``unused`` parameters got a gradient."""
    torch.testing.assert_close(a["logp"], b["logp"], atol=atol, rtol=rtol)
    torch.testing.assert_close(a["ent"], b["ent"], atol=atol, rtol=rtol)
    assert a["grads"].keys() == b["grads"].keys()
    moved = 0
    for name, grad in a["grads"].items():
        torch.testing.assert_close(grad, b["grads"][name], atol=atol, rtol=rtol, msg=name)
        moved += bool(grad.abs().sum() > 0)
    assert moved == len(a["grads"]) - unused, "every parameter should get a gradient"


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_chunked_equals_full_logits_tp1(arch: str, model_dirs: dict[str, Path]) -> None:
    """Tied (qwen2) and untied (llama) heads, temperature 0.8: same values and gradients."""
    path = model_dirs[arch]
    full = _grads(_megatron(path, temperature=0.8, logprob_chunk_tokens=0))
    chunked = _grads(_megatron(path, temperature=0.8, logprob_chunk_tokens=3))
    _assert_same(chunked, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "selective"},
        {"recompute_granularity": "full", "recompute_method": "uniform"},
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},
    ],
)
def test_recompute_leaves_gradients_unchanged(
    recompute: dict[str, Any], model_dirs: dict[str, Path]
) -> None:
    """Selective and full (uniform, block) recomputation keep less for backward and leave
    log-probs, entropy and every gradient unchanged."""
    path = model_dirs["llama"]
    plain = _megatron(path, logprob_chunk_tokens=4)
    again = _megatron(path, logprob_chunk_tokens=4, **recompute)
    assert again.tconfig.recompute_granularity == recompute["recompute_granularity"]
    assert _saved_bytes(again) < _saved_bytes(plain)
    _assert_same(_grads(again), _grads(plain), atol=1e-6, rtol=1e-5)


def _saved_bytes(policy: MegatronPolicy) -> int:
    """Bytes autograd keeps for backward in one training forward."""
    batch = random_batch(policy.model_shape.vocab_size, [5, 8, 3, 6], seed=11)
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        policy._forward(batch, with_entropy=False)
    return total[0]


def test_recompute_config_errors(model_dirs: dict[str, Path]) -> None:
    path = str(model_dirs["llama"])
    with pytest.raises(ConfigError, match="recompute_granularity"):
        MegatronPolicy.Config(model_path=path, recompute_granularity="most")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="recompute_granularity"):
        MegatronPolicy.Config(model_path=path, megatron_args={"recompute_granularity": "full"})
    with pytest.raises(ConfigError, match="logprob_chunk_tokens"):
        MegatronPolicy.Config(model_path=path, logprob_chunk_tokens=-2)


def test_chunked_equals_full_logits_tp2(
    model_dirs: dict[str, Path], tmp_path: Path, launch_ranks: Any
) -> None:
    """Two tensor-parallel ranks (vocabulary split, padding in the last slice): chunked over
    tokens with the vocabulary-parallel reductions equals the full vocab-parallel logits, on
    every rank's shard of every gradient."""
    launch_ranks([sys.executable, str(WORKER), str(tmp_path), str(model_dirs["llama"])], 2)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        # rank 1's embedding slice holds ids >= 256, none of which is in the batch
        _assert_same(res[3], res[0], atol=1e-5, rtol=1e-4, unused=rank)
